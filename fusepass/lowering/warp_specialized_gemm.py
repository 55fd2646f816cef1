"""A warp-specialized 3xTF32 GEMM for Hopper, in Gluon: y = x @ W^T in fp32 from tf32 hi + lo halves of both
operands. The kernel computes out = a @ b^T: b = W (split_w, out = y) or b = x (split_x, out = y^T = W @ x^T,
stored through y's transposed strides). a's tile is split in registers, read K-major or MN-major (a
transposed view: TMA loads the tile of a^T) from shared memory. wgmma reads its second operand from shared
memory only, and tf32 there K-major only, so b is split one of two ways (the config's `split_in_kernel`):
- in memory (split_tf32, in blocks of rows that bound the copies): TMA loads hi's and lo's tiles;
- in the kernel, nothing copied: TMA loads b's tile as it lies (K-major, or MN-major: the tile of b^T),
  and each consumer warpgroup splits half of it into K-major hi and lo tiles in shared memory, one K block
  ahead of its wgmmas. It costs shared-memory bandwidth (the split's reads and writes beside the wgmmas'):
  on an H100, over the forward's, dX's and dW's layouts, 113-127 TFLOP/s at 1024 x 8192 -> 8192 and
  102-117 at 16384 x 4096 -> 4096, against 104-128 and 114-128 split in memory, the split's pass
  included (another run on that GPU); the tuners time both.
So a weight gradient, g^T @ x, whose operands are both transposed views, and an input gradient, g @ W,
run without copying the operand that is not split, or, split in the kernel, either.

Its users: the linear op (linear.py: a training step's GEMMs outside a chain's forward, and bare
linears) and the chain's forward (implementations.py; offered by choice.warp_specialized_offered), through
`torch.ops.fusepass.warp_specialized_linear`, an opaque custom op: Inductor cannot trace a Gluon kernel
(its user-kernel support reads Triton's TTIR), so the compiled graph calls the op, which splits in
memory and launches the kernel per block, or launches it once.
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
from fusepass.lowering.tiles import SCALE_NUMBER, SCALE_PER_FEATURE, scale_mode
from fusepass.lowering.warp_specialized_kernels import B_K_MAJOR, B_MN_MAJOR, B_SPLIT_IN_MEMORY, gemm_kernel, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

OP_NAME = "fusepass::warp_specialized_linear"
CONSUMER_REGISTERS = 232  # per thread of a consumer warpgroup: two 64 x 128 fp32 accumulators and the split tile
LOADER_REGISTERS = 40
GROUP_M = 8
TILE = 128  # output tile rows (two consumer warpgroups of 64) and columns (one wgmma's N)
# The kernel's configs, the linear op's candidates. The split operand split in memory (H100, W already split):
# 130-134 TFLOP/s at 32-wide K blocks in 4 stages, 129-136 at 64 in 2, depending on the shape. Split in the
# kernel (above), 32-wide K blocks only: at 64, an MN-major b's tile leaves room for one stage.
CONFIGS = [GemmConfig(TILE, TILE, 32, GROUP_M, 4, 4, warp_specialized=True),
           GemmConfig(TILE, TILE, 64, GROUP_M, 4, 2, warp_specialized=True),
           GemmConfig(TILE, TILE, 32, GROUP_M, 4, 4, warp_specialized=True, split_in_kernel=True)]
# The stages' buffers the configs were measured with (a's tile, hi and lo: 4 x 48 KiB at 32-wide K blocks),
# below the 227 KiB an sm_90 block may use, with room for the epilogue's reductions.
SHARED_MEMORY_BYTES = 4 * 3 * TILE * 32 * 4


SPLIT_OPERANDS = ("weight", "x")  # which operand of x @ W^T is b, the one split in memory or in the kernel
# What the tuners are offered: each precision that splits an operand with each config
CANDIDATES = [(precision, config) for precision in PRE_SPLIT for config in CONFIGS]


def candidates(operand_copies: bool) -> list[tuple[str, GemmConfig]]:
    """CANDIDATES, with operand copies forbidden only those that split in the kernel (they copy nothing)."""
    return [(precision, config) for precision, config in CANDIDATES if operand_copies or config.split_in_kernel]


def unlaunchable(x: Tensor, weight: Tensor, out_dtype: torch.dtype, split: str = "weight",
                 config: GemmConfig = CONFIGS[0]) -> Optional[str]:
    """Why x @ weight^T (+ bias) with `split` (b) split as `config` splits it cannot run on this kernel, or
    None: it needs Gluon, an sm_90 GPU (wgmma), fp32 operands and output, a K of at least one, operands K-major
    or MN-major as TMA reads them (b split in memory: a only; the split makes b's halves row-major), and shared
    memory for two stages (stages_that_fit)."""
    if gluon is None:
        return "this Triton has no Gluon"
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "the warp-specialized GEMM is Hopper's (sm_90 wgmma)"
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or out_dtype != torch.float32:
        return "the warp-specialized GEMM is fp32's (3xTF32)"
    if x.shape[1] == 0:  # (its consumers would wait for a first K block that never comes)
        return "a product over no columns"
    a, b = (x, weight) if split == "weight" else (weight, x)
    for operand in (a, b) if config.split_in_kernel else (a,):
        k_major = limits.tma_layout(operand)
        if k_major and limits.tma_layout(operand.t()):
            return f"{k_major}, nor does its transpose"
    if stages_that_fit(config.block_k, config.num_stages, b_mode(b, config)) < 2:
        return f"an MN-major operand split in K blocks of {config.block_k} leaves shared memory for one stage"
    return None


def b_mode(b: Tensor, config: GemmConfig) -> int:
    """How the kernel reads b (B_MODE) under `config`."""
    return _raw_mode(b) if config.split_in_kernel else B_SPLIT_IN_MEMORY.value


def _raw_mode(b: Tensor) -> int:
    return (B_K_MAJOR if limits.k_major(b) else B_MN_MAJOR).value


def stages_that_fit(block_k: int, stages: int, mode: int) -> int:
    """The config's stages, or fewer where b's raw tile needs a buffer of its own: split in memory its
    halves are loaded, a K-major tile is split in place (hi over it), an MN-major one beside it."""
    tile_bytes = TILE * block_k * 4
    per_stage = tile_bytes * (4 if mode == B_MN_MAJOR.value else 3)  # a's tile, hi, lo (and b's raw tile)
    return min(stages, SHARED_MEMORY_BYTES // per_stage)


def _descriptor(t: Tensor, k: int, block_k: int) -> "TensorDescriptor":
    """TMA's view of t's first k columns (rows, k) in TILE x block_k tiles where t is K-major, else of its
    transpose (k, rows) in block_k x TILE tiles (limits.k_major, as limits.tma_layout reads it)."""
    rows = t.shape[0]
    if limits.k_major(t):
        shape, block = [rows, k], (TILE, block_k)
    else:
        t, shape, block = t.t(), [k, rows], (block_k, TILE)
    return TensorDescriptor(t, shape, [t.stride(0), 1], list(block), _shared_layout(block))


@functools.cache
def _shared_layout(block: tuple[int, int]) -> "gl.NVMMASharedLayout":
    """Made once per block shape: a training step's launches are host-bound (a profiled fp32 MLP step at
    4096 rows made eleven), and making the three descriptors with their layouts took two thirds of one
    launch's host time (78 us against 25 for the launch with descriptors made beforehand, on the H100
    machine's host)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float32)


@dataclass(frozen=True)
class Epilogue:
    """What the kernel does with y's tile besides storing it (pointers at the launch's first feature and part): add
    the bias; with `parts`, store the mean and M2 of z = y * scale (scale: a per-feature or one-element tensor, else
    scale_value) over each part of the batch's rows, its means `part_stride` apart, its M2s `m2_offset` after them
    (normalize.Partials' layout)."""
    bias: Optional[Tensor] = None
    scale: Optional[Tensor] = None
    scale_value: float = 1.0
    parts: Optional[Tensor] = None
    part_stride: int = 0
    m2_offset: int = 0


def gemm_into(out: Tensor, a: Tensor, b: Tensor, block_k: int, stages: int, transposed: bool = False,
              epilogue: Epilogue = Epilogue(), b_lo: Optional[Tensor] = None) -> None:
    """out = a @ b^T in TILE x TILE tiles; out of any strides, a K-major or else MN-major; b raw (split in the
    kernel; K-major or else MN-major), or with `b_lo` b's hi (split_tf32's buffers: their first K columns);
    `transposed`: out is y^T (its rows are y's features)."""
    (m, k), n = a.shape, b.shape[0]
    a_desc, b_desc = _descriptor(a, k, block_k), _descriptor(b, k, block_k)
    mode = _raw_mode(b) if b_lo is None else B_SPLIT_IN_MEMORY.value
    lo_desc = b_desc if b_lo is None else _descriptor(b_lo, k, block_k)  # (not read where b is raw)
    grid = (ceil_div(m, TILE) * ceil_div(n, TILE),)
    e = epilogue
    gemm_kernel[grid](
        a_desc, b_desc, lo_desc,
        out, *(t if t is not None else out for t in (e.bias, e.scale, e.parts)),
        m, n, k, out.stride(0), out.stride(1), e.part_stride, e.m2_offset,
        e.scale_value,
        BLOCK_M=TILE, A_K_MAJOR=limits.k_major(a), B_MODE=mode, HALF_LAYOUT=_shared_layout((TILE, block_k)),
        STATISTICS=e.parts is not None, TRANSPOSED=transposed, HAS_BIAS=e.bias is not None,
        SCALE_MODE=scale_mode(e.scale) if e.parts is not None else SCALE_NUMBER.value,
        STAGES=stages_that_fit(block_k, stages, mode), GROUP=GROUP_M, CONSUMER_REGS=CONSUMER_REGISTERS,
        LOADER_REGS=LOADER_REGISTERS, num_warps=4)


def rows_per_part(split: str) -> int:
    """The batch's rows each part of the statistics covers: a consumer's rows of y's tile, or, y^T's tile
    computed (split x), its columns."""
    return TILE // 2 if split == "weight" else TILE


def warp_specialized_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale: Optional[Tensor],
                            scale_value: float, statistics: bool, split: str, block_rows: int, block_k: int,
                            stages: int) -> tuple[Tensor, Tensor]:
    """(y, parts): y = x @ weight^T + bias, `split` ("weight" or "x") the operand split into tf32 halves:
    in the kernel's shared memory, one launch (block_rows 0), or in memory block_rows rows at a time (the
    linear op's bound on its copies; with statistics of split x, whole parts), a launch per block. W's rows
    make columns of y, x's rows make rows of y, written as columns of y^T = W @ x^T. With `statistics`,
    parts holds the per-feature means and M2s of z = y * scale (the tensor, else scale_value) over each
    rows_per_part(split) rows of the batch (normalize.Partials' flat layout); else it is empty."""
    if split not in SPLIT_OPERANDS or block_rows < 0 or (statistics and split == "x"
                                                         and block_rows % rows_per_part(split)):
        raise ValueError(f"warp_specialized_linear: split {split!r} in blocks of {block_rows} rows")
    m, f = x.shape[0], weight.shape[0]
    y = torch.empty((m, f), device=x.device, dtype=torch.float32)
    n_parts = ceil_div(m, rows_per_part(split))
    parts = torch.empty(2 * n_parts * f if statistics else 0, device=x.device, dtype=torch.float32)
    a, b, out = (x, weight, y) if split == "weight" else (weight, x, y.t())
    if block_rows == 0:
        epilogue = Epilogue(bias, scale, scale_value, parts if statistics else None, f, n_parts * f)
        gemm_into(out, a, b, block_k, stages, split == "x", epilogue)
        return y, parts
    for r0 in range(0, b.shape[0], block_rows):
        hi, lo = split_tf32(b[r0:r0 + block_rows])
        epilogue = _block_epilogue(split, r0, bias, scale, scale_value, parts if statistics else None, n_parts * f, f)
        gemm_into(out[:, r0:], a, hi, block_k, stages, split == "x", epilogue, b_lo=lo)
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
