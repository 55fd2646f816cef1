"""Times fusepass's Triton GEMM (with the statistics epilogue) per precision and tile config against
cuBLAS, with its error to float64; for bf16 also the GEMM of fp32 operands rounded as loaded (autocast)
against the cast it replaces. GPU only.
Usage: python tools/tune_gemm.py [--json FILE] [--quick] [--shapes N] [--dtypes float32,bfloat16]"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.nn.functional as F
import triton
from tabulate import tabulate

from fusepass.lowering import gemm

# Tried besides the candidates, to see whether the candidate list should change.
EXTRA_CONFIGS = [gemm.GemmConfig(128, 256, 32, 8, 8, 3), gemm.GemmConfig(128, 128, 32, 8, 8, 4),
                 gemm.GemmConfig(256, 128, 32, 8, 8, 3)]
AUTOCAST_CONFIGS = [gemm.GemmConfig(128, 256, 32, 8, 8, 3), gemm.GemmConfig(128, 256, 32, 8, 8, 4),
                    gemm.GemmConfig(128, 128, 64, 8, 8, 3), gemm.GemmConfig(256, 128, 32, 8, 8, 3)]
SHAPES = [(16384, 4096, 4096), (1024, 8192, 8192), (128, 1024, 512)]


def rel_error(value: torch.Tensor, ref: torch.Tensor) -> float:
    return ((value.double() - ref).norm() / ref.norm()).item()


def run_case(m, k, n, dtype, precision, config, x, w, b, s, ref, kernel=None):
    def call():
        return gemm.linear_epilogue(x, w, b, precision, config, epilogue=gemm.STATISTICS, scale=s, gemm_dtype=dtype)

    y = call().y
    ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
    return dict(m=m, k=k, n=n, dtype=str(dtype).split(".")[-1], kernel=kernel or f"triton {precision}",
                config=config.describe(), ms=ms, tflops=2 * m * n * k / ms / 1e9, rel_err=rel_error(y, ref))


def autocast_rows(m, k, n, dtype, x, w, b, s, ref, quick):
    """The casts autocast puts before a 16-bit GEMM, and the GEMM that rounds fp32 operands as it loads
    them (both, or one with the other cast before), with and without swapped dot operands."""
    name = str(dtype).split(".")[-1]
    rows = []
    for what, fn in (("cast x, W, b", lambda: (x.to(dtype), w.to(dtype), b.to(dtype))),
                     ("cast x", lambda: x.to(dtype)), ("cast W", lambda: w.to(dtype))):
        rows.append(dict(m=m, k=k, n=n, dtype=name, kernel=what + " from fp32",
                         ms=triton.testing.do_bench(fn, return_mode="median")))
    configs = list(AUTOCAST_CONFIGS[:2] if quick else AUTOCAST_CONFIGS)
    configs += [dataclasses.replace(c, swap_ab=True) for c in configs]
    for label, (xd, wd) in (("x, W fp32", (x, w)), ("x fp32, W cast", (x, w.to(dtype))),
                            ("x cast, W fp32", (x.to(dtype), w))):
        for config in configs:
            kernel = f"triton native, {label}"
            try:
                rows.append(run_case(m, k, n, dtype, "native", config, xd, wd, b, s, ref, kernel=kernel))
            except Exception as exc:
                rows.append(dict(m=m, k=k, n=n, dtype=name, kernel=kernel, config=config.describe(),
                                 error=repr(exc)[:120]))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true", help="first two configs only")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="the first this many shapes")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    rows = []
    for m, k, n in SHAPES[:args.shapes]:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=g)
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        b = torch.randn(n, device="cuda", generator=g)
        s = torch.randn(n, device="cuda", generator=g)
        ref = F.linear(x.double(), w.double(), b.double())
        for dtype, precisions in ((torch.float32, ["tf32x3", "split_w", "tf32"]), (torch.bfloat16, ["native"])):
            if str(dtype).split(".")[-1] not in dtypes:
                continue
            xd, wd, bd = x.to(dtype), w.to(dtype), b.to(dtype)
            torch.backends.cuda.matmul.allow_tf32 = False
            ms = triton.testing.do_bench(lambda: F.linear(xd, wd, bd), warmup=25, rep=100, return_mode="median")
            rows.append(dict(m=m, k=k, n=n, dtype=str(dtype).split(".")[-1], kernel="cuBLAS", config="",
                             ms=ms, tflops=2 * m * n * k / ms / 1e9, rel_err=rel_error(F.linear(xd, wd, bd), ref)))
            for precision in precisions:
                configs = gemm.gemm_configs(precision, dtype) + EXTRA_CONFIGS
                for config in configs[:2] if args.quick else configs:
                    try:
                        rows.append(run_case(m, k, n, dtype, precision, config, xd, wd, bd, s, ref))
                    except Exception as exc:  # an out-of-resources config: report, go on
                        rows.append(dict(m=m, k=k, n=n, dtype=str(dtype), kernel=f"triton {precision}",
                                         config=config.describe(), error=repr(exc)[:120]))
                    print(rows[-1], flush=True)
            if dtype != torch.float32:
                rows += autocast_rows(m, k, n, dtype, x, w, b, s, ref, args.quick)
        split_ms = triton.testing.do_bench(lambda: gemm.split_tf32(w), return_mode="median")
        rows.append(dict(m=m, k=k, n=n, dtype="float32", kernel="split W into tf32 hi+lo", ms=split_ms))
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
