"""fusepass's Triton GEMM alone (y = x @ W^T, no epilogue) against cuBLAS, per precision, at the seed
shapes and the MLP's layers: for each, cuBLAS's time and fusepass's best tile config (every candidate the
full search would time, gemm_configs.candidates; in fp32 also the variants with an operand prepared in
memory, split or rounded, the preparation included; in 3xTF32 also the warp-specialized Gluon kernel
splitting W or x, as the linear op runs it), TFLOP/s and the fraction of the GPU's dense peak.
GPU only.

    python tools/gemm_alone.py [--json FILE] [--shapes M,K,N ...] [--precisions bf16 bf16-autocast tf32 tf32x3]

Precisions: bf16 (both operands bf16, fp32 accumulation) against cuBLAS bf16; bf16-autocast (x bf16, W
fp32 as a model under autocast holds it) against its cast and cuBLAS bf16, as eager runs it, fusepass's
native GEMM after the same cast or cast_w (W's tiles cast in the kernel); tf32 (fp32 operands on
TF32 tensor cores, rounded to nearest) against cuBLAS with TF32 allowed; tf32x3 (fp32-accurate 3xTF32)
against cuBLAS's IEEE fp32, eager's fp32. Each side is timed twice, L2 flushed before every call: launched
from Python (do_bench medians), where a call whose host work outlasts its kernels is timed by its host,
and by GPU time (tuning.gpu_time: replayed from a CUDA graph, as the tuner times candidates), the GEMM's
own speed; each method picks fusepass's fastest candidate by its own times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
from tabulate import tabulate

from fusepass.lowering import gemm, gemm_configs, linear, tuning, warp_specialized_gemm
from fusepass.lowering.schema import Linear
from fusepass.measure import source_commit
from fusepass.numerics import rel_error

# (M, K, N): the seed chains' 1024 x 8192 -> 8192 and 16384 x 4096 -> 4096, and the MLP's three layers
# (torchvision MLP(1024, [4096, 4096, 256]) at batch 4096).
SHAPES = [(1024, 8192, 8192), (16384, 4096, 4096), (4096, 1024, 4096), (4096, 4096, 4096), (4096, 4096, 256)]
PRECISIONS = ("bf16", "bf16-autocast", "tf32", "tf32x3")
# Dense tensor-core peaks from the data sheets (H100 SXM and H200 alike), TFLOP/s; 3xTF32 makes three
# TF32 products per fp32 one, so its peak is TF32's over three.
PEAKS = {"bf16": 989e12, "bf16-autocast": 989e12, "tf32": 495e12, "tf32x3": 495e12 / 3}


def candidates(precision: str) -> list[tuple[str, gemm_configs.GemmConfig]]:
    """(kernel precision, config) for every candidate; the fp32 precisions' prepared variants too."""
    kernel_precisions = {"bf16": ["native"], "bf16-autocast": ["native", "cast_w"],
                         "tf32": ["tf32", "round_w", "round_x"], "tf32x3": ["tf32x3", "split_w", "split_x"]}
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    return [(p, c) for p in kernel_precisions[precision] for c in gemm_configs.candidates(p, dtype)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


class Fastest:
    """fusepass's fastest candidate by each timing method: {method: (ms, config, error)}."""

    def __init__(self):
        self.best: dict[str, tuple[float, str, float]] = {}

    def time(self, run, config: str, error) -> None:
        for method, ms in (("launched", bench(run)), ("gpu", tuning.gpu_time(run))):
            if method not in self.best or ms < self.best[method][0]:
                self.best[method] = (ms, config, error())


def measure(m: int, k: int, n: int, precision: str) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    # Under autocast W stays fp32, and eager casts it on every call, its cast timed with the GEMM
    held = torch.float32 if precision == "bf16-autocast" else dtype
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(held)
    exact = F.linear(x.double(), w.to(dtype).double())
    flop = 2 * m * n * k
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"

    def cublas():
        return F.linear(x, w.to(dtype))
    cublas_ms, cublas_gpu_ms = bench(cublas), tuning.gpu_time(cublas)
    cublas_err = rel_error(F.linear(x, w.to(dtype)), exact)
    torch.backends.cuda.matmul.allow_tf32 = False
    fastest = Fastest()
    for kernel_precision, config in candidates(precision):
        def weight_read() -> torch.Tensor:  # made inside the timed call: a cast is part of its time
            return w if kernel_precision == "cast_w" else w.to(dtype)

        if gemm.unlaunchable(x, weight_read(), kernel_precision, config):
            continue

        def run():
            return gemm.run_gemm(Linear(x, weight_read(), None), kernel_precision, config)
        fastest.time(run, f"{kernel_precision} {config.describe()}", lambda: rel_error(run().y, exact))
    if precision in ("tf32", "tf32x3"):
        _warp_specialized(x, w, exact, precision, fastest)
    (ms, config, err), (gpu_ms, gpu_config, gpu_err) = fastest.best["launched"], fastest.best["gpu"]
    return dict(m=m, k=k, n=n, precision=precision, cublas_ms=cublas_ms, cublas_tflops=flop / cublas_ms / 1e9,
                cublas_rel_err=cublas_err, fusepass_config=config, fusepass_ms=ms, fusepass_tflops=flop / ms / 1e9,
                fusepass_rel_err=err, vs_cublas=cublas_ms / ms, of_peak=flop / ms * 1e3 / PEAKS[precision],
                cublas_gpu_ms=cublas_gpu_ms, cublas_gpu_tflops=flop / cublas_gpu_ms / 1e9,
                fusepass_gpu_config=gpu_config, fusepass_gpu_ms=gpu_ms, fusepass_gpu_tflops=flop / gpu_ms / 1e9,
                fusepass_gpu_rel_err=gpu_err, gpu_vs_cublas=cublas_gpu_ms / gpu_ms,
                gpu_of_peak=flop / gpu_ms * 1e3 / PEAKS[precision])


def _warp_specialized(x, w, exact, precision: str, fastest: Fastest) -> None:
    """Times the warp-specialized configs (the linear op's), preparing W or x (split or rounded), the
    preparation included; the prepared operand's blocks are the linear op's."""
    call = linear.LinearCall(x, w, None, "tf32x3", "triton")  # (the implementation fixes the precision)
    sizes = (x.shape[0], w.shape[0], x.shape[1], x.device)
    for variant, config in warp_specialized_gemm.candidates(precision, True, sizes):
        impl = linear.LinearImplementation(variant, config)
        if impl.unlaunchable(call) is None:
            fastest.time(lambda: impl(call), f"{variant} {config.describe()}", lambda: rel_error(impl(call), exact))


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--shapes", nargs="+", default=[",".join(map(str, s)) for s in SHAPES], metavar="M,K,N")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    return parser


def main() -> None:
    args = parser().parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    started = time.time()
    rows = []
    for shape in args.shapes:
        m, k, n = (int(v) for v in shape.split(","))
        for precision in args.precisions:
            rows.append(measure(m, k, n, precision))
            print(rows[-1], flush=True)
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    if args.json:
        environment = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           date=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(started)),
                           command=" ".join(["python", *sys.argv]), commit=source_commit())
        with open(args.json, "w") as f:
            json.dump({"environment": environment, "peaks": PEAKS, "gemm_alone": rows}, f, indent=1)


if __name__ == "__main__":
    main()
