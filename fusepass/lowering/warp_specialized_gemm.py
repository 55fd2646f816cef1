"""A warp-specialized 3xTF32 GEMM for Hopper, in Gluon: y = x @ W^T in fp32, W split into tf32 hi + lo in
memory (split_w), the x tile split in registers.

Why Gluon: each K block's three tf32 products go into a fresh accumulator that is added to the running
sum in fp32 (gemm._three_pass_dot: the tensor cores' own accumulation truncates), and that add must wait
for the block's wgmmas. With `tl.dot`, triton 3.6 then waits for every wgmma (`wait_group 0`), and a
second accumulator to add one block late is serialized by ptxas ("non wgmma instructions reading
accumulator registers"). Here one loader warp feeds two consumer warpgroups of 64 rows each through
mbarriers; they are not in lockstep, so one warpgroup's add and split run while the other's wgmmas hold
the tensor cores. Measured on an H100 with W already split: 130-136 TFLOP/s at 1024 x 8192 -> 8192,
16384 x 4096 -> 4096 and 4096 x 4096 -> 4096, against 96-108 for the same math with one warpgroup pair in
lockstep (1024 x 8192 -> 8192: 1.027 against 1.268 ms); with the split in the linear op's blocks,
BENCHMARKS.md "GEMM alone".

Its one user is the linear op (linear.py: a training step's input gradients and bare linears), through
`torch.ops.fusepass.warp_specialized_linear`, an opaque custom op: Inductor cannot trace a Gluon kernel
(its user-kernel support reads Triton's TTIR), so the compiled graph calls the op, which splits W in
blocks of `block_rows` and launches the kernel for each.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from torch import Tensor

from fusepass.lowering import limits
from fusepass.lowering.gemm_configs import GemmConfig
from fusepass.lowering.tf32_split import split_tf32

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # The TMA load's name: triton 3.6's, renamed by 3.9 (same arguments)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # a Triton without Gluon: the kernel is never offered (unlaunchable)
    gluon = None

OP_NAME = "fusepass::warp_specialized_linear"
CONSUMER_REGISTERS = 232  # per thread of a consumer warpgroup: two 64 x 128 fp32 accumulators and the split tile
LOADER_REGISTERS = 40
GROUP_M = 8
TILE = 128  # output tile rows (two consumer warpgroups of 64) and columns (one wgmma's N)
# The kernel's configs, the linear op's candidates (H100, W already split): 130-134 TFLOP/s at 32-wide K blocks
# in 4 stages, 129-136 at 64 in 2, depending on the shape.
CONFIGS = [GemmConfig(TILE, TILE, 32, GROUP_M, 4, 4, warp_specialized=True),
           GemmConfig(TILE, TILE, 64, GROUP_M, 4, 2, warp_specialized=True)]


def unlaunchable(x: Tensor, weight: Tensor, bias: Optional[Tensor], out_dtype: torch.dtype) -> Optional[str]:
    """Why x @ weight^T cannot run on this kernel, or None: it needs Gluon, an sm_90 GPU (wgmma), fp32
    operands and output, no bias, and x K-major as TMA reads it (W is read from its split)."""
    if gluon is None:
        return "this Triton has no Gluon"
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "the warp-specialized GEMM is Hopper's (sm_90 wgmma)"
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or out_dtype != torch.float32:
        return "the warp-specialized GEMM is fp32's (3xTF32)"
    if bias is not None:
        return "the warp-specialized GEMM adds no bias"
    return limits.tma_layout(x)


if gluon is not None:

    @gluon.jit
    def _tf32_split(a):
        """a = hi + lo exactly, hi rounded to tf32 (tf32_split.tf32_split's formula)."""
        bits = a.to(gl.int32, bitcast=True)
        hi = ((bits + 0x1000) & -8192).to(gl.float32, bitcast=True)
        return hi, a - hi

    @gluon.jit
    def _loader(x_desc, hi_desc, lo_desc, x_bufs, hi_bufs, lo_bufs, ready, empty, off_m, off_n, k_steps,
                STAGES: gl.constexpr):
        """Fills stage after stage once both consumers have released it (empty), with x's tile and W's two."""
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        for i in range(k_steps):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, x_desc.block_type.nbytes + 2 * hi_desc.block_type.nbytes)
            _tma_load(x_desc, [off_m, i * BLOCK_K], bar, x_bufs.index(s))
            _tma_load(hi_desc, [off_n, i * BLOCK_K], bar, hi_bufs.index(s))
            _tma_load(lo_desc, [off_n, i * BLOCK_K], bar, lo_bufs.index(s))

    @gluon.jit
    def _consumer(x_bufs, hi_bufs, lo_bufs, ready, empty, y_ptr, M, N, stride_ym, off_m, off_n, k_steps,
                  ROW0: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """ROWS rows of the output tile from ROW0: per K block, three wgmmas into a fresh accumulator,
        waited for, the stage released, the block added in fp32."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=1)
        unused = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=mma_layout)  # use_acc=False ignores it
        acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        for i in range(k_steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            a_hi, a_lo = _tf32_split(x_bufs.index(s).slice(ROW0, ROWS).load(a_layout))
            b_hi = hi_bufs.index(s).permute((1, 0))
            block = warpgroup_mma(a_lo, b_hi, unused, use_acc=False, is_async=True)
            block = warpgroup_mma(a_hi, lo_bufs.index(s).permute((1, 0)), block, is_async=True)
            block = warpgroup_mma(a_hi, b_hi, block, is_async=True)
            block = warpgroup_mma_wait(0, deps=(block,))
            mbarrier.arrive(empty.index(s), count=1)
            acc = acc + block
        rows = off_m + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_layout))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        offsets = rows[:, None].to(gl.int64) * stride_ym + cols[None, :]
        gl.store(y_ptr + offsets, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))

    @gluon.jit
    def _gemm_kernel(
        x_desc, hi_desc, lo_desc,  # descriptors: x (M, K), W's tf32 halves (N, K)
        y_ptr,  # pointer: y (M, N), rows stride_ym apart
        M, N, K, stride_ym,  # sizes, stride
        STAGES: gl.constexpr, GROUP: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = hi_desc.block_type.shape[0]
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        tiles_in_group = GROUP * gl.cdiv(N, BLOCK_N)
        first_m = (pid // tiles_in_group) * GROUP
        group_rows = min(num_pid_m - first_m, GROUP)
        off_m = (first_m + (pid % tiles_in_group) % group_rows) * BLOCK_M
        off_n = ((pid % tiles_in_group) // group_rows) * BLOCK_N

        x_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        hi_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + hi_desc.block_type.shape, hi_desc.layout)
        lo_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + hi_desc.block_type.shape, hi_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # one arrive per consumer warpgroup
        k_steps = gl.cdiv(K, BLOCK_K)
        rows: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize([
            (_consumer, (x_bufs, hi_bufs, lo_bufs, ready, empty, y_ptr, M, N, stride_ym, off_m, off_n, k_steps, 0, rows,
                         BLOCK_N, STAGES)),
            (_consumer, (x_bufs, hi_bufs, lo_bufs, ready, empty, y_ptr, M, N, stride_ym, off_m, off_n, k_steps, rows,
                         rows, BLOCK_N, STAGES)),
            (_loader, (x_desc, hi_desc, lo_desc, x_bufs, hi_bufs, lo_bufs, ready, empty, off_m, off_n, k_steps,
                       STAGES)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _descriptor(t: Tensor, rows: int, cols: int, block: list[int]) -> "TensorDescriptor":
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float32)
    return TensorDescriptor(t, [rows, cols], [t.stride(0), 1], block, layout)


def gemm_into(y: Tensor, x: Tensor, hi: Tensor, lo: Tensor, k: int, block_k: int, stages: int) -> None:
    """y = x @ (hi + lo)^T, the halves' first k columns (split_tf32's buffers), in TILE x TILE tiles."""
    m, n = x.shape[0], hi.shape[0]
    x_desc = _descriptor(x, m, k, [TILE, block_k])
    hi_desc, lo_desc = (_descriptor(t, n, k, [TILE, block_k]) for t in (hi, lo))
    grid = (triton.cdiv(m, TILE) * triton.cdiv(n, TILE),)
    _gemm_kernel[grid](x_desc, hi_desc, lo_desc, y, m, n, k, y.stride(0), STAGES=stages, GROUP=GROUP_M,
                       CONSUMER_REGS=CONSUMER_REGISTERS, LOADER_REGS=LOADER_REGISTERS, num_warps=4)


@torch.library.custom_op(OP_NAME, mutates_args=())
def warp_specialized_linear(x: Tensor, weight: Tensor, block_rows: int, block_k: int, stages: int) -> Tensor:
    """x @ weight^T: W split into tf32 halves block_rows rows at a time (the linear op's bound on its
    copies), each block's GEMM on the warp-specialized kernel."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=torch.float32)
    for n0 in range(0, n, block_rows):
        hi, lo = split_tf32(weight[n0:n0 + block_rows])
        gemm_into(y[:, n0:], x, hi, lo, k, block_k, stages)
        del hi, lo  # before the next block's split is made: one block's copies at a time
    return y


@warp_specialized_linear.register_fake
def _fake(x: Tensor, weight: Tensor, block_rows: int, block_k: int, stages: int) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
