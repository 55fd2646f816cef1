"""A probe for issue 26's GEMM engine, not used by fusepass: a persistent bf16 GEMM (y = x @ W^T) whose
programs loop over the output tiles in grouped order, the tile loop flattened into the K loop so that the
next tile's loads overlap this tile's epilogue, loading through TMA descriptors made inside the kernel
(tl.make_tensor_descriptor; host-made descriptors cannot be traced), storing each tile in two halves.
Timed against cuBLAS and fusepass's current Triton GEMM (its fastest config), launched directly and from a
torch.compile'd graph through a triton_op, to show that the traced path can carry it. GPU only.

    python tools/persistent_gemm_probe.py [--shapes M,K,N ...]

TMA needs 16-byte aligned row strides (K and N multiples of 8 in bf16); the probe does not check.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from fusepass.lowering import gemm, gemm_configs
from fusepass.lowering.schema import Linear
from fusepass.numerics import rel_error

SHAPES = ["1024,8192,8192", "16384,4096,4096", "4096,4096,4096", "777,4096,4096"]
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 128, 256, 64, 8


@triton.jit
def _tile_coordinates(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles share each column tile of W while it is in L2."""
    group_size = GROUP_M * num_pid_n
    first_m = (tile // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % group_size) % rows_in_group, (tile % group_size) // rows_in_group


@triton.jit
def persistent_gemm(
    # pointers
    x_ptr, w_ptr, y_ptr,
    # sizes
    M, N, K,
    # strides (the last dimension of each is contiguous)
    stride_xm, stride_wn, stride_ym,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
):
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[stride_ym, 1],
                                       block_shape=[BLOCK_M, BLOCK_N // 2])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coordinates(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        # Two half-width stores: half the registers and shared memory of a whole tile's store.
        halves = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], halves[0].to(y_ptr.dtype.element_ty))
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], halves[1].to(y_ptr.dtype.element_ty))


def run(kernel, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    programs = min(torch.cuda.get_device_properties(x.device).multi_processor_count,
                   triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N))
    kernel[(programs,)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                        BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, PROGRAMS=programs, num_warps=8, num_stages=3)
    return y


@triton_op("fusepass_probe::persistent_mm", mutates_args=())
def persistent_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return run(wrap_triton(persistent_gemm), x, w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES, metavar="M,K,N")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    # Descriptors made in a kernel live in global scratch memory, which Triton asks this allocator for
    # (Inductor installs its own for the kernels it launches).
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    traced = torch.compile(lambda x, w: torch.ops.fusepass_probe.persistent_mm(x, w), fullgraph=True)
    for shape in args.shapes:
        m, k, n = (int(v) for v in shape.split(","))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ref = F.linear(x, w)
        for name, y in (("direct", run(persistent_gemm, x, w)), ("traced", traced(x, w))):
            if rel_error(y, ref) > 1e-2:
                raise SystemExit(f"{shape}: the {name} persistent GEMM is wrong ({rel_error(y, ref):.2g} from cuBLAS)")
        cublas = bench(lambda: F.linear(x, w))
        current = min(bench(lambda c=c: gemm.run_gemm(Linear(x, w, None), "native", c))
                      for c in gemm_configs.candidates("native", x.dtype))
        direct, compiled = bench(lambda: run(persistent_gemm, x, w)), bench(lambda: traced(x, w))
        tflops = 2 * m * n * k / 1e9
        print(f"{m}x{k}->{n}: cuBLAS {cublas:.3f} ms ({tflops / cublas:.0f} TFLOP/s); fusepass's GEMM "
              f"{current:.3f} ({cublas / current:.2f}x); persistent {direct:.3f} ({cublas / direct:.2f}x), "
              f"traced {compiled:.3f} ({cublas / compiled:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
