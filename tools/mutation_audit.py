"""Does the test suite catch a broken kernel? Applies one mutation at a time to fusepass's source (an
always-raising fused op, dropped gamma / beta / post-BN scale in the Triton kernels, a biased running
variance, a flipped scale gradient, a wrong tail derivative), runs the README's test command with -x,
and restores the file. Each mutation must fail the suite; the table says which test caught it.

    python tools/mutation_audit.py [--repo PATH] [--only NAME ...] [--timeout SECONDS] [pytest args ...]

Runs in the repository it lives in, or in another checkout (--repo: an earlier commit, for a before and
after). CPU is enough: the kernels run under TRITON_INTERPRET=1. The source is restored even when
interrupted. Exit status 1 if a mutation survives.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    original: str  # a line's text, found exactly once in fusepass/
    mutated: str


MUTATIONS = [
    Mutation("always-raising fused op", "        self.kernel.validate()",
             "        raise RuntimeError('mutation: the fused op always raises')"),
    Mutation("dropped gamma (kernels)",
             "        u = u * tl.load(gamma_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]",
             "        u = u"),
    Mutation("dropped beta (kernels)",
             "        u = u + tl.load(beta_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]",
             "        u = u"),
    Mutation("dropped post-BN scale (kernels)", "    elif OP == MUL:\n        r = x * other",
             "    elif OP == MUL:\n        r = x"),
    Mutation("biased running variance (kernels)", "        unbiased_var = var * (count / (count - 1.0))",
             "        unbiased_var = var"),
    Mutation("flipped scale gradient", "    closed_form = sum_g_xhat * ctx.eps",
             "    closed_form = -sum_g_xhat * ctx.eps"),
    Mutation("wrong tail derivative (sigmoid)", "(aten.sigmoid_backward(g, out), None)",
             "(aten.sigmoid_backward(g, x), None)"),
]


def locate(mutation: Mutation, repo: Path) -> Path:
    sources = sorted((repo / "fusepass").rglob("*.py"))
    hits = [path for path in sources for _ in range(path.read_text().count(mutation.original))]
    if len(hits) != 1:
        raise SystemExit(f"{mutation.name}: its line is found {len(hits)} times in fusepass/, not once")
    return hits[0]


def run_suite(repo: Path, pytest_args: list[str], timeout: float) -> tuple[str, str, float]:
    """(outcome, first failing test, seconds) of `pytest -x` on the mutated tree."""
    env = dict(os.environ, PYTHONPATH=str(repo))  # subprocesses the tests start import the mutated tree
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *pytest_args]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timed out", "", time.perf_counter() - start
    seconds = time.perf_counter() - start
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.MULTILINE)
    if done.returncode == 0:
        return "SURVIVED", "", seconds
    return "caught", failed[0] if failed else f"pytest exit {done.returncode}", seconds


def audit(mutation: Mutation, repo: Path, pytest_args: list[str], timeout: float) -> list:
    path = locate(mutation, repo)
    text = path.read_text()
    try:
        path.write_text(text.replace(mutation.original, mutation.mutated))
        outcome, test, seconds = run_suite(repo, pytest_args, timeout)
    finally:
        path.write_text(text)
    return [mutation.name, str(path.relative_to(repo)), outcome, test, f"{seconds:.0f}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout to mutate and test")
    parser.add_argument("--only", nargs="*", help="mutation names (substrings) to run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for one suite run")
    args, pytest_args = parser.parse_known_args()
    chosen = [m for m in MUTATIONS if not args.only or any(s in m.name for s in args.only)]
    rows = []
    for mutation in chosen:
        rows.append(audit(mutation, args.repo.resolve(), pytest_args, args.timeout))
        print(" | ".join(rows[-1]), flush=True)
    print(tabulate(rows, headers=["mutation", "file", "outcome", "first failing test", "s"], tablefmt="github"))
    return int(any(row[2] != "caught" for row in rows))


if __name__ == "__main__":
    sys.exit(main())
