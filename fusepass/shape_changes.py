"""fusepass-bench's shape-changes mode: a loop over a sequence of batch sizes (a training step with an
SGD step, or an eval forward under no_grad), the wall time of every step with compilation and tuning
included, for each provider in a process of its own.

    fusepass-bench PROBLEM.py --batch-sequence 1024,1024,777,1024,512 --mode train --caches cold warm

Caches: "cold" gives each provider's process fresh, empty cache directories (Inductor's, Triton's and
fusepass's tuning cache); "warm" runs the same process twice on one set of directories and reports the
second, as a second process of the same job would meet them. After the sequence, each distinct size is
run a few more times: its median is the steady step, and a provider's compile-and-tune time is the sum
over the sequence of each step's time beyond its size's steady time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import torch
from tabulate import tabulate
from torch._dynamo.utils import counters

from fusepass.providers import (build_model, load, make_provider, precision_context, problem_inputs, sync,
                                training_step)
from fusepass.warmup import with_batch

STEADY_REPEATS = 5
CACHE_ENVS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FUSEPASS_CACHE_DIR")


def run_sequence(path: str, provider: str, sequence: list[int], mode: str, precision: str, device: str,
                 size: Optional[list[int]] = None, shrink: int = 1) -> dict[str, Any]:
    """In this process: the provider's model (the problem at `size` / `shrink`, as the benchmark takes
    them) through `sequence`, each step timed with compilation."""
    module = load(path, size, shrink)
    model = build_model(module, mode, device)
    example = problem_inputs(module, device)
    fn = make_provider(provider, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4) if mode == "train" else None

    def step(batch: int) -> float:
        inputs = [with_batch(value, batch) for value in example]
        sync(device)
        start = time.perf_counter()
        if optimizer is None:
            with torch.no_grad(), precision_context(precision, device):
                fn(*inputs)
        else:
            training_step(fn, optimizer, inputs, precision, device)
        sync(device)
        return time.perf_counter() - start

    steps = [step(batch) for batch in sequence]
    steady = {batch: statistics.median(step(batch) for _ in range(STEADY_REPEATS)) for batch in sorted(set(sequence))}
    overhead = sum(max(0.0, t - steady[b]) for t, b in zip(steps, sequence))
    return {"provider": provider, "steps": steps, "steady": {str(b): t for b, t in steady.items()},
            "compile_and_tune": overhead, "counters": dict(counters["fusepass"])}


def compare(path: str, sequence: list[int], mode: str, precision: str, providers: list[str], caches: list[str],
            device: str, size: Optional[list[int]] = None, shrink: int = 1) -> list[dict[str, Any]]:
    """Each provider in a process of its own, for each cache state; the results in that order."""
    problem = [path, ",".join(map(str, size)) if size else "-", str(shrink)]
    results = []
    for cache_state in caches:
        for provider in providers:
            with tempfile.TemporaryDirectory(prefix="fusepass-shapes-") as root:
                env = {**os.environ, **{name: os.path.join(root, name.lower()) for name in CACHE_ENVS}}
                if cache_state == "warm":
                    _child(problem, provider, sequence, mode, precision, device, env)  # fills the caches
                result = _child(problem, provider, sequence, mode, precision, device, env)
            results.append({**result, "caches": cache_state})
    return results


def _child(problem: list[str], provider: str, sequence: list[int], mode: str, precision: str, device: str,
           env: dict) -> dict[str, Any]:
    command = [sys.executable, "-m", "fusepass.shape_changes", *problem, provider, ",".join(map(str, sequence)),
               mode, precision, device]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{provider} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_table(results: list[dict[str, Any]], sequence: list[int]) -> str:
    """Seconds per step, a column per provider and cache state, then the totals."""
    columns = [f"{r['provider']} ({r['caches']})" for r in results]
    rows = [[i + 1, batch, *(f"{r['steps'][i]:.2f}" for r in results)] for i, batch in enumerate(sequence)]
    rows.append(["", "total", *(f"{sum(r['steps']):.2f}" for r in results)])
    rows.append(["", "compile+tune", *(f"{r['compile_and_tune']:.2f}" for r in results)])
    return tabulate(rows, headers=["step", "batch", *columns])


def main(argv: Optional[list[str]] = None) -> int:
    """The child process: python -m fusepass.shape_changes PROBLEM SIZE SHRINK PROVIDER SEQUENCE MODE
    PRECISION DEVICE (SIZE "N,K,F" or "-")."""
    path, size, shrink, provider, sequence, mode, precision, device = argv or sys.argv[1:]
    result = run_sequence(path, provider, [int(b) for b in sequence.split(",")], mode, precision, device,
                          None if size == "-" else [int(s) for s in size.split(",")], int(shrink))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
