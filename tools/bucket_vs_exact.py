"""Steady step time of fusepass's bucketed choices against choices tuned for each exact size.

    python tools/bucket_vs_exact.py PROBLEM.py --size 1024,4096,4096 --sizes 1024,777,16384 [--mode train]
        [--precision fp32] [--backward]

"exact": for each size, a static compile (dynamic=False) whose fused ops were tuned at that very size.
"bucketed": one compile as a training loop meets the sizes: the first size static, the second with a
symbolic batch (Dynamo's automatic dynamic shapes), whose choice, made for the second size's bucket,
then serves every size. Each is timed with triton.testing.do_bench (median, L2 flushed) in the same
process; the last column is bucketed / exact.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton.testing
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusepass.bench import add_problem_arguments  # noqa: E402
from fusepass.lowering import linear, op, tuning  # noqa: E402
from fusepass.providers import model_and_inputs, provider_call  # noqa: E402
from fusepass.warmup import with_batch  # noqa: E402


def timed(fn, inputs, args) -> float:
    call = provider_call(fn, inputs, mode=args.mode, precision=args.precision, device="cuda", backward=args.backward)
    return triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_arguments(parser, providers=["fusepass"])
    parser.add_argument("--sizes", default="1024,777,16384")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    model, example = model_and_inputs(args.problem, args.mode, "cuda", args.size)
    exact = {}
    for batch in sizes:
        torch._dynamo.reset()
        for remembers in (tuning.TUNER, op.CHAIN, linear.LINEAR):
            remembers.forget()
        with tuning.tune_every_bucket():
            fn = torch.compile(model, backend="fusepass", dynamic=False)
            inputs = [with_batch(v, batch) for v in example]
            exact[batch] = timed(fn, inputs, args)
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fusepass")
    bucketed = {}
    for batch in sizes[:2]:  # the first static, the second symbolic
        provider_call(fn, [with_batch(v, batch) for v in example], mode=args.mode, precision=args.precision,
                      device="cuda", backward=args.backward)()
    for batch in sizes:
        bucketed[batch] = timed(fn, [with_batch(v, batch) for v in example], args)
    rows = [[b, f"{exact[b]:.3f}", f"{bucketed[b]:.3f}", f"{bucketed[b] / exact[b]:.3f}"] for b in sizes]
    print(f"{Path(args.problem).stem} {args.mode} {args.precision}{' backward' if args.backward else ''}, "
          f"symbolic graph traced at {sizes[1]} rows")
    print(tabulate(rows, headers=["rows", "exact ms", "bucketed ms", "bucketed / exact"]))


if __name__ == "__main__":
    main()
