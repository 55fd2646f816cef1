"""Times fusepass's Triton GEMM (with the statistics epilogue) per precision and tile config against
cuBLAS, with its error to float64. GPU only.
Usage: python tools/tune_gemm.py [--json FILE] [--quick] [--shapes N]
                                [--precisions tf32x3,split_w,split_x,tf32,round_w,round_x,native]

cuBLAS runs in IEEE fp32 here (TF32 off); the tf32 and round_* rows are TF32 products, not fp32-accurate."""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from tabulate import tabulate

from fusepass.lowering import gemm, gemm_configs
from fusepass.lowering.schema import Linear, Scale
from fusepass.lowering.tf32_split import round_tf32, split_tf32
from fusepass.numerics import rel_error

# Timed besides the candidates, to see whether the candidate list should change: the one-warpgroup
# tiles that came closest for split_w (64x128x32 and 128x64x32 w4 s3: two or three programs per SM,
# whose split and tensor-core phases could overlap) and a two-stage 128x128x64. BENCHMARKS.md's "Tried
# and rejected" lists the other shapes measured.
EXTRA_CONFIGS = [gemm_configs.GemmConfig(64, 128, 32, 8, 4, 3), gemm_configs.GemmConfig(128, 64, 32, 8, 4, 3),
                 gemm_configs.GemmConfig(128, 128, 64, 8, 8, 2)]
SHAPES = [(16384, 4096, 4096), (1024, 8192, 8192), (128, 1024, 512)]


def run_case(m, k, n, dtype, precision, config, x, w, b, s, ref):
    def call():
        return gemm.run_gemm(Linear(x, w, b), precision, config, epilogue=gemm.EPILOGUE_STATISTICS.value,
                             scale_before=Scale(s))

    y = call().y
    ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
    return dict(m=m, k=k, n=n, dtype=str(dtype).split(".")[-1], kernel=f"triton {precision}",
                config=config.describe(), ms=ms, tflops=2 * m * n * k / ms / 1e9, rel_err=rel_error(y, ref))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true", help="first two configs only")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="the first this many shapes")
    parser.add_argument("--precisions", default="tf32x3,split_w,split_x,tf32,round_w,round_x,native")
    args = parser.parse_args()
    wanted = args.precisions.split(",")
    rows = []
    for m, k, n in SHAPES[:args.shapes]:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=g)
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        b = torch.randn(n, device="cuda", generator=g)
        s = torch.randn(n, device="cuda", generator=g)
        ref = F.linear(x.double(), w.double(), b.double())
        by_dtype = ((torch.float32, ["tf32x3", "split_w", "split_x", "tf32", "round_w", "round_x"]),
                    (torch.bfloat16, ["native"]))
        for dtype, precisions in by_dtype:
            precisions = [p for p in precisions if p in wanted]
            if not precisions:
                continue
            xd, wd, bd = x.to(dtype), w.to(dtype), b.to(dtype)
            torch.backends.cuda.matmul.allow_tf32 = False
            ms = triton.testing.do_bench(lambda: F.linear(xd, wd, bd), warmup=25, rep=100, return_mode="median")
            rows.append(dict(m=m, k=k, n=n, dtype=str(dtype).split(".")[-1], kernel="cuBLAS", config="",
                             ms=ms, tflops=2 * m * n * k / ms / 1e9, rel_err=rel_error(F.linear(xd, wd, bd), ref)))
            for precision in precisions:
                configs = gemm_configs.candidates(precision, dtype) + EXTRA_CONFIGS
                for config in configs[:2] if args.quick else configs:
                    try:
                        rows.append(run_case(m, k, n, dtype, precision, config, xd, wd, bd, s, ref))
                    except Exception as exc:  # an out-of-resources config: report, go on
                        rows.append(dict(m=m, k=k, n=n, dtype=str(dtype), kernel=f"triton {precision}",
                                         config=config.describe(), error=repr(exc)[:120]))
                    print(rows[-1], flush=True)
        for name, operand in (("W", w), ("x", x)):
            split_ms = triton.testing.do_bench(lambda: split_tf32(operand), return_mode="median")
            rows.append(dict(m=m, k=k, n=n, dtype="float32", kernel=f"split {name} into tf32 hi+lo", ms=split_ms))
            round_ms = triton.testing.do_bench(lambda: round_tf32(operand), return_mode="median")
            rows.append(dict(m=m, k=k, n=n, dtype="float32", kernel=f"round {name} to tf32", ms=round_ms))
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
