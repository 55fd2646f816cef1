"""Splitting fp32 into tf32 halves, t == hi + lo exactly with hi representable in tf32: the 3xTF32 GEMM's
three products (gemm.py) take the halves of a tile in registers (`tf32_split`), or of a whole operand
split once in memory (`split_tf32`, the pre-split precisions); the TF32 GEMM takes hi alone, of a tile or
of an operand rounded once in memory (`round_tf32`; gemm_precisions.py)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusepass.lowering.launch import ceil_div, launch, present_or_placeholder, unused_pointer
from fusepass.lowering.tiles import tile_offsets

SPLIT_ROW_ALIGNMENT = 16  # elements: a split operand's rows are 64-byte aligned, whatever its width


def split_row_stride(cols: int) -> int:
    """The row stride of a split operand's buffers: its columns rounded up to SPLIT_ROW_ALIGNMENT."""
    return (cols + SPLIT_ROW_ALIGNMENT - 1) // SPLIT_ROW_ALIGNMENT * SPLIT_ROW_ALIGNMENT


@triton.jit
def tf32_split(a):
    """a = hi + lo exactly, hi rounded to tf32's 10 mantissa bits (nearest, ties away from zero)."""
    bits = a.to(tl.int32, bitcast=True)
    hi = ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)  # -8192 == 0xFFFFE000
    return hi, a - hi


@triton.jit(do_not_specialize=["rows", "cols"])
def _tf32_split_kernel(
    src_ptr, hi_ptr, lo_ptr,  # pointers: src any layout; hi and lo row-major
    after_ptr,  # pointer never read: the tensor this split must follow in a traced graph (split_tf32)
    rows, cols,  # sizes
    stride_src_row, stride_src_col, stride_out_row,  # strides
    STORE_LO: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,  # meta-parameters
):
    """Splits a 2-D tensor of any strides into row-major hi + lo (STORE_LO; else hi alone) in one pass: a
    transposed operand is made K-major here, in the same read and write as the split, not by a copy
    before it."""
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    hi, lo = tf32_split(tl.load(src_ptr + tile_offsets(r, c, stride_src_row, stride_src_col), mask=mask, other=0.0))
    out_offsets = tile_offsets(r, c, stride_out_row, 1)
    tl.store(hi_ptr + out_offsets, hi, mask=mask)
    if STORE_LO:
        tl.store(lo_ptr + out_offsets, lo, mask=mask)


def split_tf32(t: Tensor, after: Optional[Tensor] = None,
               into: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor]:
    """(hi, lo) with t == hi + lo exactly and hi representable in tf32, from a 2-D t of any strides: in
    row-major buffers of t's rows and its columns rounded up to SPLIT_ROW_ALIGNMENT, whose first
    columns hold the halves (`hi[:, :cols] + lo[:, :cols] == t`). A weight gradient's split operand has
    the batch as its columns; padded, its row stride is divisible by 16 for every batch size, so the GEMM
    reading it compiles once and loads it vectorized. The buffers are returned whole, not as views of
    t's width: a view's contiguity check on a symbolic batch would guard on batch % 16 and recompile
    the graph when it changes (seen on an H100).

    `after`: a tensor the kernel takes and never reads, so that a traced graph makes the split after it
    exists. Given the GEMM's other operand, the split stays beside its GEMM: AOTAutograd's partitioner
    computes in the forward, and keeps for the backward, any backward node whose inputs the forward
    already has, so a weight gradient's split of the saved input would otherwise be made in the forward
    and held until the backward (H100, the forward of a training-mode TF32 chain at 16384 x 4096 -> 4096:
    768 MB above what it was given and 2.009 ms, against 514 MB and 1.930 ms with `after`).

    `into`: (hi, lo) buffers from split_buffer of at least t's rows, written in their first rows and
    returned whole (a block's workspace that blocks of one GEMM reuse)."""
    hi, lo = into if into is not None else (split_buffer(*t.shape, t), split_buffer(*t.shape, t))
    _launch_split(t, hi, lo, after)
    return hi, lo


def round_tf32(t: Tensor, after: Optional[Tensor] = None, into: Optional[Tensor] = None) -> Tensor:
    """t rounded to tf32 (split_tf32's hi alone), in a buffer laid out as split_tf32's; `after` and `into`
    as there."""
    hi = into if into is not None else split_buffer(*t.shape, t)
    _launch_split(t, hi, None, after)
    return hi


def split_buffer(rows: int, cols: int, like: Tensor) -> Tensor:
    """A buffer for `rows` rows of a split (rounded) operand of `cols` columns, of like's dtype and device."""
    return torch.empty((rows, split_row_stride(cols)), device=like.device, dtype=like.dtype)


def _launch_split(t: Tensor, hi: Tensor, lo: Optional[Tensor], after: Optional[Tensor]) -> None:
    rows, cols = t.shape
    block = 64
    grid = (ceil_div(rows, block), ceil_div(cols, block))
    # An absent tensor is a placeholder, not hi again: traced, a buffer in two slots of which the kernel
    # writes one is cloned by Inductor (launch.unused_pointer).
    placeholder = unused_pointer(t.device)
    launch(_tf32_split_kernel)[grid](t, hi, present_or_placeholder(lo, placeholder),
                                     present_or_placeholder(after, placeholder), rows, cols, t.stride(0), t.stride(1),
                                     hi.stride(0), STORE_LO=lo is not None, BLOCK_ROWS=block, BLOCK_COLS=block)
