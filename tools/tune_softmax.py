"""Times the row-softmax output pass alone for a few launch configurations, through the public
`fusepass.lowering.normalize.output_pass` (GPU).
Usage: python tools/tune_softmax.py [--rows N] [--features F]"""

from __future__ import annotations

import argparse
import itertools


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--features", type=int, default=8192)
    args = parser.parse_args()

    import torch
    import triton

    from fusepass.lowering import normalize
    from fusepass.lowering.schema import BatchNorm, ChainArgs, KernelOptions, Linear, Scale, Tail

    n, f = args.rows, args.features
    y = torch.randn(n, f, device="cuda")
    vector = lambda: torch.randn(f, device="cuda")  # noqa: E731
    bn = BatchNorm(weight=vector(), bias=vector(), running_mean=vector(), running_var=vector().abs() + 0.5,
                   training=False, momentum=0.1, eps=1e-5)
    chain = ChainArgs(linear=Linear(y, y, None), scale_before=Scale(), batch_norm=bn,
                      tail=Tail("mul(v0,t0)", torch.ones(1, device="cuda")), softmax=True, out_dtype=torch.float32,
                      save_linear_out=False, kernel=KernelOptions())
    stats = normalize.Statistics.allocate(f, "cuda", bn)
    normalize.finalize_statistics(stats, None, n)  # the pass reads mean/invstd, as after a GEMM epilogue
    out = torch.empty_like(y)
    floor_ms = 3 * n * f * 4 / 4.2e12 * 1e3  # read y twice (the second sweep may hit L2), write out
    print(f"floor (3 passes of {n * f * 4 / 2**20:.0f} MB at 4.2 TB/s): {floor_ms:.3f} ms")
    for block_r, block_c, warps in itertools.product((1, 2, 4), (1024, 2048, 4096), (4, 8, 16)):
        launch = normalize.SoftmaxLaunch(block_r, block_c, warps)
        ms = triton.testing.do_bench(lambda: normalize.output_pass(y, chain, stats, out, launch), warmup=25, rep=100,
                                     return_mode="median")
        print(f"BLOCK_R={block_r} BLOCK_C={block_c} warps={warps}: {ms:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
