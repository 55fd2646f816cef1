"""Steady step time of fusepass's bucketed choices against choices tuned for each exact size, with the
cost of a symbolic batch shown apart from the cost of the choice.

    python tools/bucket_vs_exact.py PROBLEM.py --size 1024,4096,4096 --sizes 1024,777,16384 [--mode train]
        [--precision fp32] [--backward] [--profile] [--json FILE]

For each size, in one process, each compile with fresh tuning choices (an empty tuning cache of its own):
- "static exact": dynamic=False, the fused ops tuned at that very size;
- "symbolic exact": the batch marked dynamic (torch._dynamo.mark_dynamic), tuned at that size;
- "bucketed": one compile as a training loop meets the sizes: the first size static, the second with a
  symbolic batch (Dynamo's automatic dynamic shapes), whose choice, made for the second size's bucket,
  then serves every size;
- Inductor static (dynamic=False) and Inductor after the same loop (symbolic), for the cost of a symbolic
  batch without fusepass.
"bucketed / symbolic exact" is the choice's cost alone (same graph kind, other choice). Each time is
triton.testing.do_bench's median (L2 flushed). --profile prints the kernels of one call at the first
size, static exact against bucketed, and the host time per call. --json writes the table, with GPU,
versions and date, for tools/benchmark_report.py (section "Shape changes").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
import triton.testing
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusepass.bench import add_problem_arguments  # noqa: E402
from fusepass.lowering import forget_choices, tuning  # noqa: E402
from fusepass.measure import environment  # noqa: E402
from fusepass.providers import model_and_inputs, provider_call  # noqa: E402
from fusepass.warmup import with_batch  # noqa: E402
from tools.profile_host import kernel_table, per_call_us  # noqa: E402


@contextlib.contextmanager
def fresh_choices():
    """No choice remembered: this process's tables dropped, an empty tuning cache directory."""
    torch._dynamo.reset()
    forget_choices()
    with tempfile.TemporaryDirectory(prefix="fusepass-bucket-") as root, \
            mock.patch.dict(os.environ, {tuning.CACHE_DIR_ENV: root}):
        yield


class Runner:
    def __init__(self, args):
        self.args = args
        self.model, self.example = model_and_inputs(args.problem, args.mode, "cuda", args.size)

    def call(self, fn, batch: int, symbolic: bool = False):
        inputs = [with_batch(v, batch) for v in self.example]
        if symbolic:
            for value in inputs:
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    torch._dynamo.mark_dynamic(value, 0)
        return provider_call(fn, inputs, mode=self.args.mode, precision=self.args.precision, device="cuda",
                             backward=self.args.backward)

    def timed(self, fn, batch: int) -> float:
        return triton.testing.do_bench(self.call(fn, batch), warmup=25, rep=200, return_mode="median")

    def exact(self, backend: str, batch: int, symbolic: bool, profile: bool = False) -> float:
        with fresh_choices(), tuning.tune_every_bucket():
            fn = torch.compile(self.model, backend=backend, dynamic=None if symbolic else False)
            self.call(fn, batch, symbolic)()
            ms = self.timed(fn, batch)
            if profile:
                self.profile(f"{backend} {'symbolic' if symbolic else 'static'} exact", fn, batch)
            return ms

    def after_loop(self, backend: str, sizes: list[int], profile_at: int = 0) -> dict[int, float]:
        """Times at every size after a loop's first two sizes (the second compiles a symbolic batch)."""
        with fresh_choices():
            fn = torch.compile(self.model, backend=backend)
            for batch in sizes[:2]:
                self.call(fn, batch)()
            times = {batch: self.timed(fn, batch) for batch in sizes}
            if profile_at:
                self.profile(f"{backend} after the loop (symbolic)", fn, profile_at)
            return times

    def profile(self, title: str, fn, batch: int) -> None:
        call = self.call(fn, batch)
        host, wall = per_call_us(call, 100)
        print(f"\n=== {title}, {batch} rows: host {host:.1f} us/call, wall {wall:.1f} us/call")
        print(kernel_table(call, 10))



COLUMNS = ("static_exact_ms", "symbolic_exact_ms", "bucketed_ms", "inductor_static_ms", "inductor_symbolic_ms")
KEY = "bucket_vs_exact"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_arguments(parser, providers=["fusepass"])
    parser.add_argument("--sizes", default="1024,777,16384")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    return parser


def write_json(path: str, args, sizes: list[int], measured: list[dict[int, float]]) -> None:
    command = ["tools/bucket_vs_exact.py", *sys.argv[1:]]
    run = {"problem": Path(args.problem).stem, "size": list(args.size) if args.size else None, "mode": args.mode,
           "precision": args.precision, "backward": args.backward, "traced_at": sizes[1],
           "rows": [{"rows": b, **{name: times[b] for name, times in zip(COLUMNS, measured)}} for b in sizes]}
    env = {**environment("cuda", []), "command": "python " + " ".join(command)}
    Path(path).write_text(json.dumps({"environment": env, KEY: [run]}, indent=2))


def main() -> None:
    args = parser().parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runner = Runner(args)
    static = {b: runner.exact("fusepass", b, symbolic=False, profile=args.profile and b == sizes[0]) for b in sizes}
    symbolic = {b: runner.exact("fusepass", b, symbolic=True) for b in sizes}
    bucketed = runner.after_loop("fusepass", sizes, sizes[0] if args.profile else 0)
    inductor_static = {b: runner.exact("inductor", b, symbolic=False) for b in sizes}
    inductor_loop = runner.after_loop("inductor", sizes)
    rows = [[b, f"{static[b]:.3f}", f"{symbolic[b]:.3f}", f"{bucketed[b]:.3f}", f"{bucketed[b] / symbolic[b]:.3f}",
             f"{bucketed[b] / static[b]:.3f}", f"{inductor_static[b]:.3f}", f"{inductor_loop[b]:.3f}"] for b in sizes]
    print(f"\n{Path(args.problem).stem} {args.mode} {args.precision}{' backward' if args.backward else ''}, "
          f"loop's symbolic graph traced at {sizes[1]} rows, {torch.cuda.get_device_name()}")
    print(tabulate(rows, headers=["rows", "static exact ms", "symbolic exact ms", "bucketed ms",
                                  "bucketed / symbolic exact", "bucketed / static exact", "Inductor static ms",
                                  "Inductor symbolic ms"]))
    if args.json:
        write_json(args.json, args, sizes, [static, symbolic, bucketed, inductor_static, inductor_loop])


if __name__ == "__main__":
    main()
