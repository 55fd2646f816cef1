"""Two equally exact fp32 runs of a real-model system (tests/real_models.py) against float64: eager, and
eager fed each step's rows permuted (the same training in exact arithmetic, another rounding), judged
as the tests judge fusepass: each quantity step by step, and each gradient over all steps as one vector
(TrainingRun's gradients_over_steps). Where the permuted run fails the per-step criterion against eager,
that criterion measures noise there, not exactness. Also per step: how many relu outputs differ in sign
from float64's in each run (a flipped mask moves a gradient by the flipped element's whole contribution).

    python tools/equally_exact.py moco_v3 --seeds 8 --steps 10 [--size cuda|cpu]

Systems whose loss is a mean over rows (or of row-order-free statistics) qualify; those with dropout
do not (the permuted rows draw other masks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusepass.numerics import no_further_than_eager, rel_error  # noqa: E402
from tests.real_models import CPU_SIZES, CUDA_SIZES, SYSTEMS, TrainingRun, Trajectory  # noqa: E402
from tests.real_models import zero_in_exact_arithmetic  # noqa: E402


def permuted(value, rows: torch.Tensor):
    if isinstance(value, (list, tuple)):
        return type(value)(permuted(v, rows) for v in value)
    return value[rows] if isinstance(value, torch.Tensor) else value


class PermutedRun(TrainingRun):
    """A TrainingRun whose 'fused' copy is eager fed permuted rows; comparisons recorded, not asserted."""

    step_failures: list  # (step, what, permuted's error, eager's)
    masks: dict  # copy -> this step's relu output signs, in call order
    rows: torch.Tensor

    def prepare(self, seed: int) -> None:
        self.calls["fused"] = {}  # the copy runs uncompiled
        self.step_failures, self.masks, self.step = [], {}, 0
        for name, model in self.copies.items():
            for module in model.modules():
                if isinstance(module, nn.ReLU):
                    module.register_forward_hook(lambda m, i, out, name=name: self.masks[name].append(out > 0))
        self.generator = torch.Generator().manual_seed(seed)

    def _each(self, method, inputs, seed):
        first = next(_tensors(inputs))
        self.rows = torch.randperm(first.shape[0], generator=self.generator).to(first.device)
        self.masks = {name: [] for name in self.copies}
        return super()._each(method, inputs, seed)

    def _inputs_of(self, name, inputs):
        return permuted(inputs, self.rows) if name == "fused" else inputs

    def relu_flips(self) -> dict:
        """Per copy, this step's relu outputs whose sign differs from float64's, over the relus whose rows
        are the inputs' rows (not DINO's concatenated crops)."""
        back = torch.argsort(self.rows)
        flips = {}
        for name in ("eager", "fused"):
            pairs = zip(self.masks[name], self.masks["ref"])
            flips[name] = sum(int(((m[back] if name == "fused" else m) != ref).sum())
                              for m, ref in pairs if m.shape[0] == back.numel())
        return flips

    def _compare(self, what, values, over_steps=False):
        fused, eager, ref = (values[n] for n in ("fused", "eager", "ref"))
        if fused.numel() == 1 or zero_in_exact_arithmetic(eager, ref):
            return
        if what.startswith("grad "):
            self.trajectories.setdefault(what, Trajectory()).add(what, fused, eager, ref)
        error, eager_error = rel_error(fused, ref), rel_error(eager, ref)
        if not no_further_than_eager(error, eager_error):
            self.step_failures.append((self.step, what, error, eager_error))


def _tensors(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, torch.Tensor):
        yield value


def run_seed(system: str, sizes, device: str, seed: int, steps: int) -> tuple[list, list, list]:
    """(per-step failures, each gradient's (name, permuted's error, eager's) over the steps, relu flips)."""
    run = PermutedRun.of(lambda: SYSTEMS[system](sizes), device)  # the tests' start: built from seed 0
    torch.manual_seed(seed)  # the steps' inputs
    if run.random:
        raise SystemExit(f"{system} draws random masks per row: permuted rows are another training")
    run.prepare(seed)
    flips = []
    for step in range(steps):
        run.step = step
        run.train_step(step, device)
        flips.append(run.relu_flips())
    return run.step_failures, [(what, *t.errors()) for what, t in run.trajectories.items()], flips


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("system", choices=sorted(SYSTEMS))
    parser.add_argument("--seeds", type=int, default=8, help="draws of the steps' inputs and permutations")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = CUDA_SIZES if args.size == "cuda" else CPU_SIZES
    print(f"{args.system} on {device}, {sizes}, {args.steps} steps: eager against eager on permuted rows")
    failing = {"per step": 0, "over steps": 0}
    for seed in range(args.seeds):
        per_step, gradients, flips = run_seed(args.system, sizes, device, seed, args.steps)
        over_steps = [g for g in gradients if not no_further_than_eager(g[1], g[2])]
        worst = max(gradients, key=lambda g: g[1] / max(g[2], 1e-300))
        failing["per step"] += bool(per_step)
        failing["over steps"] += bool(over_steps)
        print(f"seed {seed}: {len(per_step)} per-step comparisons over the bound, {len(over_steps)} gradients over "
              f"the bound over steps; relu signs unlike float64's per step (eager/permuted): "
              + " ".join(f"{f['eager']}/{f['fused']}" for f in flips), flush=True)
        print(f"    over steps, the furthest gradient: {worst[0]}, permuted {worst[1] / worst[2]:.3f}x eager's error")
        for step, what, error, eager_error in sorted(per_step, key=lambda r: -r[2] / r[3])[:3]:
            print(f"    step {step}: {what}: permuted {error:.3g}, eager {eager_error:.3g}")
        for what, error, eager_error in over_steps:
            print(f"    over steps: {what}: permuted {error:.3g}, eager {eager_error:.3g}")
    print(f"seeds where the permuted run fails: per step {failing['per step']} of {args.seeds}, "
          f"gradients over steps {failing['over steps']} of {args.seeds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
