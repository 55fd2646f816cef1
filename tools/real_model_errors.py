"""Trains the real-model systems of tests/real_models.py (eager, fusepass, float64) and prints, per step,
the quantities whose fusepass error to float64 is furthest above eager's: where a drift starts.

    python tools/real_model_errors.py moco_v3 --steps 10 [--size cuda|cpu] [--options '{"gemm": "cublas"}']

Each quantity is judged as the tests judge it (fusepass's error against 1.5x eager's plus a floor); the
run goes on past a failing step so the whole trajectory shows. Exit status 1 if any step failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusepass.numerics import no_further_than_eager, rel_error  # noqa: E402
from tests.real_models import (CPU_SIZES, CUDA_SIZES, NOISE_SLACK, SYSTEMS, TrainingRun,  # noqa: E402
                               zero_in_exact_arithmetic)


class Recorder(TrainingRun):
    """A TrainingRun that records every comparison instead of asserting."""

    rows: list

    def _compare(self, what, values):
        """(what, fusepass's error, eager's, within the bound): relative errors to float64, or for a
        quantity that is 0 in exact arithmetic the sizes of the two values' rounding noise."""
        fused, eager, ref = (values[n] for n in ("fused", "eager", "ref"))
        if zero_in_exact_arithmetic(eager, ref):
            size, eager_size = fused.double().norm().item(), eager.double().norm().item()
            self.rows.append((f"{what} (0: noise sizes)", size, eager_size, size <= NOISE_SLACK * eager_size))
        else:
            error, eager_error = rel_error(fused, ref), rel_error(eager, ref)
            self.rows.append((what, error, eager_error, no_further_than_eager(error, eager_error)))

    def _compare_gradients(self):
        for key, params in self._named("parameters"):
            if params["ref"].grad is not None:
                self._compare(f"grad {key}", {name: p.grad for name, p in params.items()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("system", choices=sorted(SYSTEMS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--options", default="{}", help="the backend's options, as JSON")
    parser.add_argument("--top", type=int, default=4, help="quantities shown per step")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = CUDA_SIZES if args.size == "cuda" else CPU_SIZES
    options = json.loads(args.options)
    print(f"{args.system} on {device}, {sizes}, options {options}", flush=True)
    start = time.perf_counter()
    try:
        run = Recorder.of(lambda: SYSTEMS[args.system](sizes), device, options=options)
        run.rows = []
        failed = False
        for step in range(args.steps + 1):
            run.rows.clear()
            t = time.perf_counter()
            if step < args.steps:
                run.train_step(step, device)
                label = f"step {step + 1}"
            else:
                run.eval_forward(device)
                label = "eval"
            rows = sorted(run.rows, key=lambda r: r[1] / max(r[2], 1e-30), reverse=True)
            bad = [r for r in rows if not r[3]]
            failed |= bool(bad)
            print(f"{label}: {time.perf_counter() - t:.1f} s, {len(bad)} over the bound", flush=True)
            for what, error, eager, _ in rows[:args.top]:
                print(f"    {what:60s} fusepass {error:.3g}  eager {eager:.3g}  ratio {error / max(eager, 1e-30):.2f}")
    except Exception:  # noqa: BLE001  (a diagnosis: show everything)
        traceback.print_exc()
        return 2
    from torch._dynamo.utils import counters
    print(f"counters {dict(counters['fusepass'])}, {time.perf_counter() - start:.1f} s in all", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
