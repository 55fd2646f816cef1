"""Times every candidate of `fusepass::linear` (Triton GEMM precisions and tile configs, K-major copies,
cuBLAS) on the three layouts of a training step's GEMMs, with each one's error to float64, timed with
the L2 cache flushed before each call (do_bench) and as the tuner times them (tuning.gpu_time). GPU only.

    python tools/tune_linear.py [--size M,K,N ...] [--precision tf32x3|tf32|native]

A size M,K,N is the forward x (M, K) @ W (N, K)^T; grad_x is then g (M, N) @ W, grad_weight g^T @ x."""

from __future__ import annotations

import argparse

import torch
import triton
from tabulate import tabulate

from fusepass.lowering import linear, tuning
from fusepass.numerics import rel_error

DTYPES = {"tf32x3": torch.float32, "tf32": torch.float32, "native": torch.bfloat16}
# with --size defaults: the MLP problem's layers for bf16 ("native"), the chain problems' otherwise
DEFAULT_SIZES = {"native": ["4096,1024,4096", "4096,4096,4096"]}


def layouts(m: int, k: int, n: int, dtype: torch.dtype) -> dict:
    x, w, g = (torch.randn(s, device="cuda").to(dtype) for s in ((m, k), (n, k), (m, n)))
    return {"forward": (x, w), "grad_x": (g, w.t()), "grad_weight": (g.t(), x.t())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", nargs="+")
    parser.add_argument("--precision", default="tf32x3", choices=sorted(DTYPES))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    rows = []
    for size in args.size or DEFAULT_SIZES.get(args.precision, ["1024,8192,8192", "16384,4096,4096"]):
        m, k, n = (int(v) for v in size.split(","))
        for layout, (a, b) in layouts(m, k, n, DTYPES[args.precision]).items():
            ref = a.double() @ b.double().t()
            flop = 2 * a.shape[0] * a.shape[1] * b.shape[0]
            call_args = linear.LinearCall(a, b, None, "tf32x3", "auto")
            problem = linear.problem(call_args, traced=False)
            for name, run in linear.candidates(call_args, problem, traced=False).items():
                call = lambda: run(call_args)  # noqa: E731
                ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                graph_ms = tuning.gpu_time(call)
                rows.append([size, layout, name, f"{ms:.3f}", f"{graph_ms:.3f}", f"{flop / ms / 1e9:.0f}",
                             f"{rel_error(call(), ref):.2e}"])
    print(tabulate(rows, headers=["M,K,N", "layout", "candidate", "ms (L2 flushed)", "ms (tuner)", "TFLOP/s",
                                  "error to float64"]))


if __name__ == "__main__":
    main()
