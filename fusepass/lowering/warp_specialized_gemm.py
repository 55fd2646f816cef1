"""A warp-specialized 3xTF32 GEMM for Hopper, in Gluon: y = x @ W^T in fp32, one operand split into tf32
hi + lo in memory, the other's tile split in registers. The kernel computes out = a @ b^T with b split:
b = W (split_w, out = y) or b = x (split_x, out = y^T = W @ x^T, stored through y's transposed strides). Its
`a` is read K-major or MN-major (a transposed view: TMA loads the tile of a^T, and the consumers read it
from shared memory transposed), so a weight gradient, g^T @ x, whose operands are both transposed views,
and an input gradient, g @ W, split either operand without copying the other.

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

Its epilogue adds the bias and, for a training chain's forward, stores the batch statistics' partials as
the Triton GEMM's EPILOGUE_STATISTICS does (per feature, the mean and M2 of z = y * scale over each part
of the batch), which the chain's passes then merge (normalize.py).

Its users: the linear op (linear.py: a training step's GEMMs outside a chain's forward, and bare
linears) and the chain's forward (implementations.py; offered by choice.warp_specialized_offered), through
`torch.ops.fusepass.warp_specialized_linear`, an opaque custom op: Inductor cannot trace a Gluon kernel
(its user-kernel support reads Triton's TTIR), so the compiled graph calls the op, which splits the
chosen operand in blocks of `block_rows` rows and launches the kernel for each.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from fusepass.lowering import limits
from fusepass.lowering.gemm_configs import GemmConfig
from fusepass.lowering.gemm_precisions import PRE_SPLIT
from fusepass.lowering.launch import ceil_div
from fusepass.lowering.tf32_split import split_tf32
from fusepass.lowering.tiles import SCALE_NUMBER, SCALE_PER_FEATURE, SCALE_SINGLE, scale_mode

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


SPLIT_OPERANDS = ("weight", "x")  # which operand of x @ W^T the op splits in memory
# What the tuners are offered: each precision that splits an operand in memory with each config
CANDIDATES = [(precision, config) for precision in PRE_SPLIT for config in CONFIGS]


def unlaunchable(x: Tensor, weight: Tensor, out_dtype: torch.dtype, split: str = "weight") -> Optional[str]:
    """Why x @ weight^T (+ bias) with `split` split in memory cannot run on this kernel, or None: it needs
    Gluon, an sm_90 GPU (wgmma), fp32 operands and output, and the other operand K-major or MN-major as
    TMA reads it (the split operand is read from its split)."""
    if gluon is None:
        return "this Triton has no Gluon"
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "the warp-specialized GEMM is Hopper's (sm_90 wgmma)"
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or out_dtype != torch.float32:
        return "the warp-specialized GEMM is fp32's (3xTF32)"
    a = x if split == "weight" else weight
    k_major = limits.tma_layout(a)
    return k_major and limits.tma_layout(a.t()) and f"{k_major}, nor does its transpose"


if gluon is not None:

    @gluon.jit
    def _tf32_split(a):
        """a = hi + lo exactly, hi rounded to tf32 (tf32_split.tf32_split's formula)."""
        bits = a.to(gl.int32, bitcast=True)
        hi = ((bits + 0x1000) & -8192).to(gl.float32, bitcast=True)
        return hi, a - hi

    @gluon.jit
    def _loader(a_desc, hi_desc, lo_desc, a_bufs, hi_bufs, lo_bufs, ready, empty, off_m, off_n, k_steps,
                STAGES: gl.constexpr, A_K_MAJOR: gl.constexpr):
        """Fills stage after stage once both consumers have released it (empty), with a's tile and b's two."""
        BLOCK_K: gl.constexpr = hi_desc.block_type.shape[1]
        for i in range(k_steps):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * hi_desc.block_type.nbytes)
            if A_K_MAJOR:
                _tma_load(a_desc, [off_m, i * BLOCK_K], bar, a_bufs.index(s))
            else:
                _tma_load(a_desc, [i * BLOCK_K, off_m], bar, a_bufs.index(s))
            _tma_load(hi_desc, [off_n, i * BLOCK_K], bar, hi_bufs.index(s))
            _tma_load(lo_desc, [off_n, i * BLOCK_K], bar, lo_bufs.index(s))

    @gluon.jit
    def _consumer(a_bufs, hi_bufs, lo_bufs, ready, empty, out_ptr, bias_ptr, scale_ptr, parts_ptr,
                  M, N, stride_om, stride_on, part_stride, m2_offset, scale_value, off_m, off_n, k_steps,
                  ROW0: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  A_K_MAJOR: gl.constexpr, STATISTICS: gl.constexpr, TRANSPOSED: gl.constexpr,
                  HAS_BIAS: gl.constexpr, SCALE_MODE: gl.constexpr):
        """ROWS rows of the output tile from ROW0: per K block, three wgmmas into a fresh accumulator,
        waited for, the stage released, the block added in fp32; then the epilogue."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=1)
        unused = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=mma_layout)  # use_acc=False ignores it
        acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        for i in range(k_steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            if A_K_MAJOR:
                a_tile = a_bufs.index(s).slice(ROW0, ROWS)
            else:
                a_tile = a_bufs.index(s).slice(ROW0, ROWS, dim=1).permute((1, 0))
            a_hi, a_lo = _tf32_split(a_tile.load(a_layout))
            b_hi = hi_bufs.index(s).permute((1, 0))
            block = warpgroup_mma(a_lo, b_hi, unused, use_acc=False, is_async=True)
            block = warpgroup_mma(a_hi, lo_bufs.index(s).permute((1, 0)), block, is_async=True)
            block = warpgroup_mma(a_hi, b_hi, block, is_async=True)
            block = warpgroup_mma_wait(0, deps=(block,))
            mbarrier.arrive(empty.index(s), count=1)
            acc = acc + block
        rows = off_m + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_layout))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        if TRANSPOSED:  # y^T: the tile's rows are features, its columns the batch's rows
            part = off_n // BLOCK_N
        else:
            part = (off_m + ROW0) // ROWS
        _epilogue(acc, rows, cols, M, N, out_ptr, stride_om, stride_on, bias_ptr, scale_ptr, scale_value,
                  parts_ptr, part, part_stride, m2_offset, STATISTICS, TRANSPOSED, HAS_BIAS, SCALE_MODE)

    @gluon.jit
    def _per_feature(v, TRANSPOSED: gl.constexpr):
        """A vector over the features, broadcast over the tile (y^T's tile has them as rows)."""
        if TRANSPOSED:
            return v[:, None]
        else:
            return v[None, :]

    @gluon.jit
    def _per_batch_row(v, TRANSPOSED: gl.constexpr):
        """A vector over the batch's rows, broadcast over the tile (y^T's tile has them as columns)."""
        if TRANSPOSED:
            return v[None, :]
        else:
            return v[:, None]

    @gluon.jit
    def _load_scale(scale_ptr, scale_value, features, feature_ok, SCALE_MODE: gl.constexpr):
        """tiles.load_scale's three forms of the scale, as an fp32 vector over the features."""
        if SCALE_MODE == SCALE_PER_FEATURE:
            s = gl.load(scale_ptr + features, mask=feature_ok, other=0.0)
        elif SCALE_MODE == SCALE_SINGLE:
            s = gl.load(scale_ptr + features * 0, mask=feature_ok, other=0.0)
        else:
            s = (features * 0).to(gl.float32) + scale_value
        return s.to(gl.float32)

    @gluon.jit
    def _epilogue(acc, rows, cols, M, N, out_ptr, stride_om, stride_on, bias_ptr, scale_ptr, scale_value,
                  parts_ptr, part, part_stride, m2_offset, STATISTICS: gl.constexpr, TRANSPOSED: gl.constexpr,
                  HAS_BIAS: gl.constexpr, SCALE_MODE: gl.constexpr):
        """y = acc + bias stored; with STATISTICS, the mean and M2 of z = y * scale over the tile's rows of
        the batch, per feature, at `part` of the partials (gemm_epilogue.EPILOGUE_STATISTICS's)."""
        row_ok = rows < M
        col_ok = cols < N
        if TRANSPOSED:
            features, feature_ok, in_batch = rows, row_ok, col_ok
        else:
            features, feature_ok, in_batch = cols, col_ok, row_ok
        if HAS_BIAS:
            acc = acc + _per_feature(gl.load(bias_ptr + features, mask=feature_ok, other=0.0), TRANSPOSED)
        offsets = rows[:, None].to(gl.int64) * stride_om + cols[None, :].to(gl.int64) * stride_on
        gl.store(out_ptr + offsets, acc, mask=row_ok[:, None] & col_ok[None, :])
        if STATISTICS:
            z = acc * _per_feature(_load_scale(scale_ptr, scale_value, features, feature_ok, SCALE_MODE),
                                   TRANSPOSED)
            batch_axis: gl.constexpr = 1 if TRANSPOSED else 0
            batch_ok = _per_batch_row(in_batch, TRANSPOSED)
            count = gl.sum(in_batch.to(gl.float32), axis=0)
            mean = gl.sum(gl.where(batch_ok, z, 0.0), axis=batch_axis) / count
            centered = gl.where(batch_ok, z - _per_feature(mean, TRANSPOSED), 0.0)
            m2 = gl.sum(centered * centered, axis=batch_axis)
            at = parts_ptr + part.to(gl.int64) * part_stride + features
            stored = feature_ok & (count > 0)  # a consumer's rows past the batch write no part
            gl.store(at, mean, mask=stored)
            gl.store(at + m2_offset, m2, mask=stored)

    @gluon.jit
    def _gemm_kernel(
        a_desc, hi_desc, lo_desc,  # descriptors: a (M, K) K-major, or a^T (K, M); b's tf32 halves (N, K)
        out_ptr, bias_ptr, scale_ptr, parts_ptr,  # pointers: out (M, N); per feature; the partials
        M, N, K, stride_om, stride_on, part_stride, m2_offset,  # sizes, strides
        scale_value,
        BLOCK_M: gl.constexpr, A_K_MAJOR: gl.constexpr, STATISTICS: gl.constexpr, TRANSPOSED: gl.constexpr,
        HAS_BIAS: gl.constexpr, SCALE_MODE: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    ):
        BLOCK_N: gl.constexpr = hi_desc.block_type.shape[0]
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        tiles_in_group = GROUP * gl.cdiv(N, BLOCK_N)
        first_m = (pid // tiles_in_group) * GROUP
        group_rows = min(num_pid_m - first_m, GROUP)
        off_m = (first_m + (pid % tiles_in_group) % group_rows) * BLOCK_M
        off_n = ((pid % tiles_in_group) // group_rows) * BLOCK_N

        a_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        hi_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + hi_desc.block_type.shape, hi_desc.layout)
        lo_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + hi_desc.block_type.shape, hi_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # one arrive per consumer warpgroup
        k_steps = gl.cdiv(K, hi_desc.block_type.shape[1])
        rows: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize([
            (_consumer, (a_bufs, hi_bufs, lo_bufs, ready, empty, out_ptr, bias_ptr, scale_ptr, parts_ptr,
                         M, N, stride_om, stride_on, part_stride, m2_offset, scale_value, off_m, off_n, k_steps,
                         0, rows, BLOCK_N, STAGES, A_K_MAJOR, STATISTICS, TRANSPOSED, HAS_BIAS, SCALE_MODE)),
            (_consumer, (a_bufs, hi_bufs, lo_bufs, ready, empty, out_ptr, bias_ptr, scale_ptr, parts_ptr,
                         M, N, stride_om, stride_on, part_stride, m2_offset, scale_value, off_m, off_n, k_steps,
                         rows, rows, BLOCK_N, STAGES, A_K_MAJOR, STATISTICS, TRANSPOSED, HAS_BIAS, SCALE_MODE)),
            (_loader, (a_desc, hi_desc, lo_desc, a_bufs, hi_bufs, lo_bufs, ready, empty, off_m, off_n, k_steps,
                       STAGES, A_K_MAJOR)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _descriptor(t: Tensor, rows: int, cols: int, block: tuple[int, int]) -> "TensorDescriptor":
    return TensorDescriptor(t, [rows, cols], [t.stride(0), 1], list(block), _shared_layout(block))


@functools.cache
def _shared_layout(block: tuple[int, int]) -> "gl.NVMMASharedLayout":
    """Made once per block shape: a training step's launches are host-bound (a profiled fp32 MLP step at
    4096 rows made eleven), and making the three descriptors with their layouts took two thirds of one
    launch's host time (78 us against 25 for the launch with descriptors made beforehand, on the H100
    machine's host)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float32)


@dataclass(frozen=True)
class Epilogue:
    """What the kernel does with y's tile besides storing it (pointers at the launch's first feature and
    part): add the bias; with `parts`, store the mean and M2 of z = y * scale (scale: a per-feature or
    one-element tensor, else scale_value) over each part of the batch's rows, its means `part_stride`
    apart, its M2s `m2_offset` after them (normalize.Partials' layout)."""
    bias: Optional[Tensor] = None
    scale: Optional[Tensor] = None
    scale_value: float = 1.0
    parts: Optional[Tensor] = None
    part_stride: int = 0
    m2_offset: int = 0


def gemm_into(out: Tensor, a: Tensor, hi: Tensor, lo: Tensor, k: int, block_k: int, stages: int,
              transposed: bool = False, epilogue: Epilogue = Epilogue()) -> None:
    """out = a @ (hi + lo)^T, the halves' first k columns (split_tf32's buffers), in TILE x TILE tiles; out of
    any strides, a K-major or else MN-major; `transposed`: out is y^T (its rows are y's features)."""
    m, n = a.shape[0], hi.shape[0]
    a_k_major = limits.k_major(a)  # as limits.tma_layout reads it (unlaunchable)
    a_desc = _descriptor(a, m, k, (TILE, block_k)) if a_k_major else _descriptor(a.t(), k, m, (block_k, TILE))
    hi_desc, lo_desc = (_descriptor(t, n, k, (TILE, block_k)) for t in (hi, lo))
    grid = (ceil_div(m, TILE) * ceil_div(n, TILE),)
    e = epilogue
    _gemm_kernel[grid](
        a_desc, hi_desc, lo_desc,
        out, *(t if t is not None else out for t in (e.bias, e.scale, e.parts)),
        m, n, k, out.stride(0), out.stride(1), e.part_stride, e.m2_offset,
        e.scale_value,
        BLOCK_M=TILE, A_K_MAJOR=a_k_major, STATISTICS=e.parts is not None, TRANSPOSED=transposed,
        HAS_BIAS=e.bias is not None, SCALE_MODE=scale_mode(e.scale) if e.parts is not None else SCALE_NUMBER.value,
        STAGES=stages, GROUP=GROUP_M, CONSUMER_REGS=CONSUMER_REGISTERS, LOADER_REGS=LOADER_REGISTERS, num_warps=4)


def rows_per_part(split: str) -> int:
    """The batch's rows each part of the statistics covers: a consumer's rows of y's tile, or, y^T's tile
    computed (split x), its columns."""
    return TILE // 2 if split == "weight" else TILE


def warp_specialized_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale: Optional[Tensor],
                            scale_value: float, statistics: bool, split: str, block_rows: int, block_k: int,
                            stages: int) -> tuple[Tensor, Tensor]:
    """(y, parts): y = x @ weight^T + bias, `split` ("weight" or "x") split into tf32 halves block_rows
    rows at a time (the linear op's bound on its copies; with statistics of split x, whole parts), each
    block's GEMM on the warp-specialized kernel: W's rows make columns of y, x's rows make rows of y,
    written as columns of y^T = W @ x^T. With `statistics`, parts holds the per-feature means and M2s of
    z = y * scale (the tensor, else scale_value) over each rows_per_part(split) rows of the batch
    (normalize.Partials' flat layout); else it is empty."""
    if split not in SPLIT_OPERANDS or (statistics and split == "x" and block_rows % rows_per_part(split)):
        raise ValueError(f"warp_specialized_linear: split {split!r} in blocks of {block_rows} rows")
    m, f = x.shape[0], weight.shape[0]
    y = torch.empty((m, f), device=x.device, dtype=torch.float32)
    n_parts = ceil_div(m, rows_per_part(split))
    parts = torch.empty(2 * n_parts * f if statistics else 0, device=x.device, dtype=torch.float32)
    a, b, out = (x, weight, y) if split == "weight" else (weight, x, y.t())
    for r0 in range(0, b.shape[0], block_rows):
        hi, lo = split_tf32(b[r0:r0 + block_rows])
        epilogue = _block_epilogue(split, r0, bias, scale, scale_value, parts if statistics else None, n_parts * f, f)
        gemm_into(out[:, r0:], a, hi, lo, b.shape[1], block_k, stages, split == "x", epilogue)
        del hi, lo  # before the next block's split is made: one block's copies at a time
    return y, parts


def _block_epilogue(split: str, r0: int, bias: Optional[Tensor], scale: Optional[Tensor], scale_value: float,
                    parts: Optional[Tensor], m2_offset: int, n_features: int) -> Epilogue:
    """The epilogue's tensors from the block's first feature (a block of W's rows) or part (of x's rows)."""
    if split == "weight":
        per_feature_scale = scale is not None and scale_mode(scale) == SCALE_PER_FEATURE.value
        return Epilogue(bias[r0:] if bias is not None else None, scale[r0:] if per_feature_scale else scale,
                        scale_value, parts[r0:] if parts is not None else None, n_features, m2_offset)
    part0 = r0 // rows_per_part(split)
    return Epilogue(bias, scale, scale_value, parts[part0 * n_features:] if parts is not None else None,
                    n_features, m2_offset)


# Defined with torch.library.Library, not custom_op: the compiled graph calls it on every step, and custom_op's
# Python layers (its autograd kernel, the dynamo-disabling wrapper, the outputs' aliasing check) cost more host
# time than the op's own Python (2-core CPU, kernels mocked out: 43 us per call through custom_op, 17-20 as
# defined here, 14 for the body alone).
_LIBRARY = torch.library.Library("fusepass", "FRAGMENT")
_LIBRARY.define(OP_NAME.split("::")[1] + "(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, float scale_value, "
                "bool statistics, str split, SymInt block_rows, SymInt block_k, SymInt stages) -> (Tensor, Tensor)")
_LIBRARY.impl(OP_NAME.split("::")[1], warp_specialized_linear, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME, lib=_LIBRARY)
def _fake(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale: Optional[Tensor], scale_value: float,
          statistics: bool, split: str, block_rows: int, block_k: int, stages: int) -> tuple[Tensor, Tensor]:
    m, f = x.shape[0], weight.shape[0]
    n_parts = ceil_div(m, rows_per_part(split))
    return x.new_empty((m, f)), x.new_empty((2 * n_parts * f if statistics else 0,))
