"""The best rates this GPU reaches, for BENCHMARKS.md's floors (tools/benchmark_report.py's RATES):
cuBLAS TF32 and bf16 GEMMs (the best of a few large shapes) and a device-to-device copy. fp32's floor
(3xTF32) is not measured here: it is the data sheet's dense TF32 peak over three, since fusepass's
3xTF32 GEMMs run faster than a third of cuBLAS's best TF32. GPU only.

    python tools/gpu_rates.py
"""

from __future__ import annotations

import torch
import triton

SHAPES = [(16384, 4096, 4096), (8192, 8192, 8192), (4096, 8192, 16384)]


def gemm_rate(dtype: torch.dtype, tf32: bool) -> float:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    best = 0.0
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(k, n, device="cuda", dtype=dtype)
        ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
        best = max(best, 2 * m * n * k / ms * 1e3)
    return best


def copy_rate() -> float:
    src = torch.empty(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms * 1e3  # read + write


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    tf32, bf16 = gemm_rate(torch.float32, True), gemm_rate(torch.bfloat16, False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f'"gemm": {{"tf32": {tf32 / 1e12:.0f}e12, "bf16-autocast": {bf16 / 1e12:.0f}e12}}, '
          f'"copy": {copy_rate() / 1e12:.1f}e12')


if __name__ == "__main__":
    main()
