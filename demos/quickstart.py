"""Compile a reference problem with backend="fusepass" and compare it with eager and float64.

    python demos/quickstart.py [--problem gemm_scale_batchnorm] [--device cuda|cpu]

On a machine without a GPU the problem is shrunk to a CPU-friendly size (and the script says so).
Shows the explain() report, then output, running-statistics and gradient errors to a float64 copy
of the model for eager and fusepass, in training and eval mode.
"""

import argparse
import copy
import warnings
from pathlib import Path

import torch
from tabulate import tabulate

import fusepass
from fusepass.numerics import rel_error
from fusepass.problems import load_problem, problem_size

PROBLEMS = Path(__file__).parent / "problems"
CPU_SIZE = (256, 512, 384)  # batch, in_features, out_features when shrunk

# On an Ampere or newer GPU, Inductor advises TF32 whenever it compiles an fp32 matmul at PyTorch's
# default "highest" precision. This demo compares at that precision on purpose: fusepass's fp32 GEMM
# there is 3xTF32, at least as close to float64 as eager's fp32, which plain TF32 is not.
warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix multiplication",
                        category=UserWarning)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", default="gemm_scale_batchnorm",
                        help="a file name in demos/problems/, without .py")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    problem = load_problem(PROBLEMS / f"{args.problem}.py", CPU_SIZE if args.device == "cpu" else None)
    batch, in_features, out_features = problem_size(problem)
    if args.device == "cpu":
        print(f"No GPU in use: {args.problem} shrunk to {batch} x {in_features} -> {out_features}.\n")

    torch.manual_seed(0)
    eager = problem.Model(*problem.get_init_inputs()).to(args.device)
    fused, ref = copy.deepcopy(eager), copy.deepcopy(eager).double()
    compiled = torch.compile(fused, backend="fusepass")

    x = torch.rand(batch, in_features, device=args.device)
    print(fusepass.explain(eager, x), "\n")

    rows = []
    for mode in ("train", "eval"):
        for model in (eager, fused, ref):
            model.train(mode == "train")
        x = torch.rand(batch, in_features, device=args.device)
        outs = {"eager": eager(x), "fusepass": compiled(x), "float64": ref(x.double())}
        upstream = torch.randn_like(outs["float64"])
        for out in outs.values():
            (out.double() * upstream).sum().backward()
        for name, model in (("eager", eager), ("fusepass", fused)):
            rows.append([mode, name, rel_error(outs[name], outs["float64"]),
                         rel_error(model.bn.running_var, ref.bn.running_var),
                         rel_error(model.gemm.weight.grad, ref.gemm.weight.grad)])
        for model in (eager, fused, ref):
            model.zero_grad()
    print("Relative error to the float64 model (lower is better):")
    print(tabulate(rows, headers=["mode", "provider", "output", "running_var", "grad W"], floatfmt=".2e"))


if __name__ == "__main__":
    main()
