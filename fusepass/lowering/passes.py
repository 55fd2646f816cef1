"""The Triton passes after the GEMM, and their launchers.

After a GEMM that computed no statistics (cuBLAS), a statistics pass writes per strip of rows and per
feature the mean and M2 of z = y * s1 (the Triton GEMM writes these in its epilogue instead). The
output pass then normalizes: elementwise, or row-wise with an online max-subtracted softmax for rows
of any length. It takes mean and invstd from one of three sources (STATS_SOURCE): it READs them (a
finalize kernel merged the strips first), it MERGEs the strips itself with Chan's formula (one launch
fewer), or it turns the RUNNING statistics into them (eval). A pass that computes them itself has its
first row program write mean/invstd and the running-statistics update, as the finalize kernel would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusepass.lowering import pointwise, sync
from fusepass.lowering.launch import hint, launch, present_or_placeholder, unused_pointer
from fusepass.lowering.pointwise import apply_tail
from fusepass.lowering.reference import new_running_stat_shape, running_stats_dtype, updated_running_stats
from fusepass.lowering.schema import BatchNorm, ChainArgs, Scale, Tail
from fusepass.lowering.tiles import (INTERPRETED, batch_norm_tile, chan_merge, exp_accurate, inverse_std,
                                     load_scale, tile_column_stats)

# Where an output pass gets mean and invstd (STATS_SOURCE).
STATS_READ = tl.constexpr(0)
STATS_MERGE = tl.constexpr(1)
STATS_RUNNING = tl.constexpr(2)

# --------------------------------------------------------------------------- kernels
# Row counts (n_rows, and n_parts, the row strips) change with the batch: runtime arguments that are never
# specialized, so a new batch size compiles nothing.
# `stats` below is the tuple of statistics pointers Statistics.pointers() gives, in this order:
# (part_mean, part_m2, running_mean, running_var, mean, invstd, new_running_mean, new_running_var).


@triton.jit(do_not_specialize=["n_rows"])
def _partial_stats_kernel(
    # pointers
    y_ptr, scale_ptr, part_mean_ptr, part_m2_ptr,
    # sizes
    n_rows, n_cols, rows_per_program,
    # strides
    stride_yr, stride_yc,
    # scalars
    scale_value,
    # meta-parameters
    SCALE_MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per column, the mean and M2 of z = y * s over one strip of rows (Chan-merged tile by tile)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    s = load_scale(scale_ptr, scale_value, cols, col_mask, SCALE_MODE)

    row_start = pid_r * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    count = tl.zeros((BLOCK_C,), dtype=tl.float32)
    mean = tl.zeros((BLOCK_C,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        y = tl.load(y_ptr + rows[:, None] * stride_yr + cols[None, :] * stride_yc, mask=mask, other=0.0)
        tile_count = tl.minimum(row_end - r0, BLOCK_R).to(tl.float32)
        tile_mean, tile_m2 = tile_column_stats(y.to(tl.float32) * s[None, :], row_mask, tile_count)
        count, mean, m2 = chan_merge(count, mean, m2, tile_count, tile_mean, tile_m2)

    out_offsets = pid_r * n_cols + cols
    tl.store(part_mean_ptr + out_offsets, mean, mask=col_mask)
    tl.store(part_m2_ptr + out_offsets, m2, mask=col_mask)


@triton.jit
def _merged_statistics(part_mean_ptr, part_m2_ptr, cols, col_mask, n_rows, n_cols, n_parts, rows_per_part):
    """Per column: the row strips' (mean, M2) of z merged with Chan's formula. Returns (count, mean,
    biased variance)."""
    count = tl.zeros(cols.shape, dtype=tl.float32)
    mean = tl.zeros(cols.shape, dtype=tl.float32)
    m2 = tl.zeros(cols.shape, dtype=tl.float32)
    for p in range(0, n_parts):
        part_count = tl.minimum(rows_per_part, n_rows - p * rows_per_part).to(tl.float32)
        part_mean = tl.load(part_mean_ptr + p * n_cols + cols, mask=col_mask, other=0.0)
        part_m2 = tl.load(part_m2_ptr + p * n_cols + cols, mask=col_mask, other=0.0)
        count, mean, m2 = chan_merge(count, mean, m2, part_count, part_mean, part_m2)
    return count, mean, m2 / count


@triton.jit
def _store_statistics(stats, mean, var, count, cols, mask, momentum, eps, UPDATE_RUNNING: tl.constexpr):
    """Stores mean and invstd, and (training with running statistics) the momentum update of the
    running statistics with the unbiased variance. Returns invstd."""
    _, _, running_mean_ptr, running_var_ptr, mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr = stats
    invstd = inverse_std(var, eps)
    tl.store(mean_ptr + cols, mean, mask=mask)
    tl.store(invstd_ptr + cols, invstd, mask=mask)
    if UPDATE_RUNNING:
        momentum = tl.cast(momentum, tl.float32)
        unbiased_var = var * (count / (count - 1.0))
        running_mean = tl.load(running_mean_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        running_var = tl.load(running_var_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        new_mean = momentum * mean + (1.0 - momentum) * running_mean
        new_var = momentum * unbiased_var + (1.0 - momentum) * running_var
        tl.store(new_running_mean_ptr + cols, new_mean.to(new_running_mean_ptr.dtype.element_ty), mask=mask)
        tl.store(new_running_var_ptr + cols, new_var.to(new_running_var_ptr.dtype.element_ty), mask=mask)
    return invstd


@triton.jit
def _column_statistics(
    stats, cols, col_mask, row_program, n_rows, n_cols, n_parts, rows_per_part, momentum, eps,
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr,
):
    """(mean, invstd) of some columns, from STATS_SOURCE (see the module docstring). When computed here,
    row program 0 stores them and the running-statistics update (a nonzero row_program stores nothing)."""
    part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr, mean_ptr, invstd_ptr, _, _ = stats
    if STATS_SOURCE == STATS_READ:
        mean = tl.load(mean_ptr + cols, mask=col_mask, other=0.0)
        invstd = tl.load(invstd_ptr + cols, mask=col_mask, other=0.0)
    else:
        if STATS_SOURCE == STATS_MERGE:
            count, mean, var = _merged_statistics(part_mean_ptr, part_m2_ptr, cols, col_mask, n_rows, n_cols,
                                                  n_parts, rows_per_part)
        else:
            count = tl.zeros(cols.shape, dtype=tl.float32)
            mean = tl.load(running_mean_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            var = tl.load(running_var_ptr + cols, mask=col_mask, other=1.0).to(tl.float32)
        # A vector comparison: Triton's interpreter rejects a mask and-ed with a scalar condition.
        store_mask = col_mask & ((cols * 0 + row_program) == 0)
        invstd = _store_statistics(stats, mean, var, count, cols, store_mask, momentum, eps, UPDATE_RUNNING)
    return mean, invstd


@triton.jit(do_not_specialize=["n_rows", "n_parts"])
def _finalize_stats_kernel(
    # pointers: statistics
    part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
    mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
    # sizes
    n_rows, n_cols, n_parts, rows_per_part,
    # scalars
    momentum, eps,
    # meta-parameters
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per column: merge the strips' statistics (training) or read the running ones (eval); store
    mean/invstd and update the running statistics, once, for an output pass that reads them."""
    stats = (part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
             mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    _column_statistics(stats, cols, cols < n_cols, 0, n_rows, n_cols, n_parts, rows_per_part, momentum, eps,
                       STATS_SOURCE, UPDATE_RUNNING)


@triton.jit
def _normalized_tile(
    params, tail_tensors, mean, invstd, rows, cols, row_mask, col_mask, stride_yr, stride_yc, scale_value,
    SCALE_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
    TAIL_OPS: tl.constexpr, TAIL_INPUTS: tl.constexpr, TAIL_OTHERS: tl.constexpr, TAIL_TENSORS: tl.constexpr,
    TAIL_A: tl.constexpr, TAIL_B: tl.constexpr, TAIL_TENSOR_MODES: tl.constexpr,
):
    """tail((y * s1 - mean) * invstd * gamma + beta) for one tile, in fp32. `params` holds the pointers
    (y, s1, gamma, beta), `tail_tensors` the tail's tensor operands."""
    y_ptr, scale_ptr, gamma_ptr, beta_ptr = params
    mask = row_mask[:, None] & col_mask[None, :]
    s = load_scale(scale_ptr, scale_value, cols, col_mask, SCALE_MODE)
    y = tl.load(y_ptr + rows[:, None] * stride_yr + cols[None, :] * stride_yc, mask=mask, other=0.0)
    u = batch_norm_tile(y.to(tl.float32), s, mean, invstd, gamma_ptr, beta_ptr, cols, col_mask, HAS_GAMMA, HAS_BETA)
    return apply_tail(u, cols, col_mask, tail_tensors, TAIL_OPS, TAIL_INPUTS, TAIL_OTHERS, TAIL_TENSORS, TAIL_A,
                      TAIL_B, TAIL_TENSOR_MODES)


@triton.jit
def _output_tile(
    params, tail_tensors, stats, rows, cols, row_mask, col_mask, row_program, n_rows, n_cols, n_parts,
    rows_per_part, stride_yr, stride_yc, scale_value, momentum, eps,
    SCALE_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr,
    TAIL_OPS: tl.constexpr, TAIL_INPUTS: tl.constexpr, TAIL_OTHERS: tl.constexpr, TAIL_TENSORS: tl.constexpr,
    TAIL_A: tl.constexpr, TAIL_B: tl.constexpr, TAIL_TENSOR_MODES: tl.constexpr,
):
    """The normalized tile u of some rows and columns, with its columns' statistics. Every output pass
    (and both softmax sweeps) computes u through this one function, so the compiler builds the same
    expression, with the same rounding, in each: had one sweep let `u - max` contract into an FMA and
    the other not, numerators and sum would disagree by up to |u| ulps."""
    mean, invstd = _column_statistics(stats, cols, col_mask, row_program, n_rows, n_cols, n_parts, rows_per_part,
                                      momentum, eps, STATS_SOURCE, UPDATE_RUNNING)
    return _normalized_tile(params, tail_tensors, mean, invstd, rows, cols, row_mask, col_mask, stride_yr, stride_yc,
                            scale_value, SCALE_MODE, HAS_GAMMA, HAS_BETA,
                            TAIL_OPS, TAIL_INPUTS, TAIL_OTHERS, TAIL_TENSORS, TAIL_A, TAIL_B, TAIL_TENSOR_MODES)


@triton.jit(do_not_specialize=["n_rows", "n_parts"])
def _normalize_kernel(
    # pointers: input, parameters, output
    y_ptr, scale_ptr, gamma_ptr, beta_ptr, out_ptr,
    # pointers: the tail's tensor operands
    tail_tensor_0, tail_tensor_1, tail_tensor_2, tail_tensor_3,
    # pointers: statistics
    part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
    mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
    # sizes
    n_rows, n_cols, n_parts, rows_per_part,
    # strides
    stride_yr, stride_yc, stride_or, stride_oc,
    # scalars
    scale_value, momentum, eps,
    # meta-parameters
    SCALE_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    TAIL_OPS: tl.constexpr, TAIL_INPUTS: tl.constexpr, TAIL_OTHERS: tl.constexpr, TAIL_TENSORS: tl.constexpr,
    TAIL_A: tl.constexpr, TAIL_B: tl.constexpr, TAIL_TENSOR_MODES: tl.constexpr,
):
    """out = tail((y * s1 - mean) * invstd * gamma + beta), stored in out's dtype."""
    params = (y_ptr, scale_ptr, gamma_ptr, beta_ptr)
    tail_tensors = (tail_tensor_0, tail_tensor_1, tail_tensor_2, tail_tensor_3)
    stats = (part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
             mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr)
    pid_r = tl.program_id(0)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    u = _output_tile(params, tail_tensors, stats, rows, cols, row_mask, col_mask, pid_r, n_rows, n_cols, n_parts,
                     rows_per_part, stride_yr, stride_yc, scale_value, momentum, eps,
                     SCALE_MODE, HAS_GAMMA, HAS_BETA, STATS_SOURCE, UPDATE_RUNNING,
                     TAIL_OPS, TAIL_INPUTS, TAIL_OTHERS, TAIL_TENSORS, TAIL_A, TAIL_B, TAIL_TENSOR_MODES)
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :] * stride_oc,
             u.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["n_rows", "n_parts"])
def _normalize_softmax_kernel(
    # pointers: input, parameters, output
    y_ptr, scale_ptr, gamma_ptr, beta_ptr, out_ptr,
    # pointers: the tail's tensor operands
    tail_tensor_0, tail_tensor_1, tail_tensor_2, tail_tensor_3,
    # pointers: statistics
    part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
    mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
    # sizes
    n_rows, n_cols, n_parts, rows_per_part,
    # strides
    stride_yr, stride_yc, stride_or, stride_oc,
    # scalars
    scale_value, momentum, eps,
    # meta-parameters
    SCALE_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    TAIL_OPS: tl.constexpr, TAIL_INPUTS: tl.constexpr, TAIL_OTHERS: tl.constexpr, TAIL_TENSORS: tl.constexpr,
    TAIL_A: tl.constexpr, TAIL_B: tl.constexpr, TAIL_TENSOR_MODES: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
):
    """out = softmax(tail(u), dim=-1) for BLOCK_R whole rows of any length: an online max/sum sweep over
    the columns, then a sweep that writes exp(u - max) / sum. fp32 throughout."""
    params = (y_ptr, scale_ptr, gamma_ptr, beta_ptr)
    tail_tensors = (tail_tensor_0, tail_tensor_1, tail_tensor_2, tail_tensor_3)
    stats = (part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
             mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr)
    pid_r = tl.program_id(0)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    row_max = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_mask = cols < n_cols
        u = _output_tile(params, tail_tensors, stats, rows, cols, row_mask, col_mask, pid_r, n_rows, n_cols,
                         n_parts, rows_per_part, stride_yr, stride_yc, scale_value, momentum, eps,
                         SCALE_MODE, HAS_GAMMA, HAS_BETA, STATS_SOURCE, UPDATE_RUNNING,
                         TAIL_OPS, TAIL_INPUTS, TAIL_OTHERS, TAIL_TENSORS, TAIL_A, TAIL_B, TAIL_TENSOR_MODES)
        u = tl.where(col_mask[None, :], u, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(u, axis=1))
        # While a row has seen only -inf, subtract 0 instead of -inf so that no -inf - -inf NaN appears
        # (a row that is -inf throughout still ends 0 / 0 = NaN, as in eager).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = (row_sum * exp_accurate(row_max - shift, ACCURATE_EXP)
                   + tl.sum(exp_accurate(u - shift[:, None], ACCURATE_EXP), axis=1))
        row_max = new_max
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_mask = cols < n_cols
        # Row program 1 stores no statistics: the first sweep stored them already.
        u = _output_tile(params, tail_tensors, stats, rows, cols, row_mask, col_mask, 1, n_rows, n_cols,
                         n_parts, rows_per_part, stride_yr, stride_yc, scale_value, momentum, eps,
                         SCALE_MODE, HAS_GAMMA, HAS_BETA, STATS_SOURCE, UPDATE_RUNNING,
                         TAIL_OPS, TAIL_INPUTS, TAIL_OTHERS, TAIL_TENSORS, TAIL_A, TAIL_B, TAIL_TENSOR_MODES)
        u = tl.where(col_mask[None, :], u, float("-inf"))
        p = tl.math.div_rn(exp_accurate(u - shift[:, None], ACCURATE_EXP), row_sum[:, None])
        tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :] * stride_oc,
                 p.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# --------------------------------------------------------------------------- launch configuration

STATS_BLOCK_R, STATS_BLOCK_C = 32, 64
NORM_BLOCK_R, NORM_BLOCK_C = 32, 64
FINALIZE_BLOCK_C = 64
# Rows each statistics program covers: enough strips to fill a GPU, few enough to keep partials small.
TARGET_ROW_STRIPS = 64
# The output pass merges the strips' statistics itself (no finalize launch) while that costs it at most
# this many bytes of (L2-resident) partials read per byte of y it reads anyway, or at most a few MB in
# all: reading those from L2 costs less than a launch.
MERGE_READS_PER_Y_READ = 1.0
MERGE_BYTES_ALWAYS_CHEAP = 4 * 2**20


@dataclass(frozen=True)
class SoftmaxLaunch:
    """How the row-softmax pass is launched: rows per program, the widest column block, warps (None:
    from the block width). The default was measured on an H200 for 1024 x 8192 (tools/tune_softmax.py):
    2 rows x 2048 columns with 16 warps ran in 0.035 ms against 0.058 ms for 4 x 1024 with 4 warps;
    the floor is 0.024 ms."""
    block_r: int = 2
    max_block_c: int = 2048
    num_warps: Optional[int] = None

    def block_c(self, n_cols: int) -> int:
        return min(self.max_block_c, triton.next_power_of_2(n_cols))

    def warps(self, n_cols: int) -> int:
        return self.num_warps or max(4, min(16, self.block_c(n_cols) // 128))


SOFTMAX_LAUNCH = SoftmaxLaunch()


# --------------------------------------------------------------------------- statistics


class Partials(NamedTuple):
    """Per strip of rows and per feature, the mean and M2 of z = y * s (strips of rows_per_part rows)."""
    mean: Tensor
    m2: Tensor
    rows_per_part: int


@dataclass
class Statistics:
    """The per-feature statistics an output pass normalizes with, and where it gets them (`source`)."""
    mean: Tensor
    invstd: Tensor
    new_mean: Tensor
    new_var: Tensor
    batch_norm: BatchNorm
    parts: Optional[Partials] = None
    source: int = STATS_READ.value

    @classmethod
    def allocate(cls, n_cols: int, device, bn: BatchNorm) -> "Statistics":
        def new_running(running):
            return torch.empty(new_running_stat_shape(bn, running), device=device, dtype=running_stats_dtype(bn))
        return cls(_fp32_vector(n_cols, device), _fp32_vector(n_cols, device),
                   new_running(bn.running_mean), new_running(bn.running_var), bn)

    def pointers(self) -> tuple[Tensor, ...]:
        """The kernels' statistics pointers, in their order; absent tensors get a placeholder."""
        placeholder = unused_pointer(self.mean.device)
        parts = self.parts or Partials(placeholder, placeholder, 1)
        bn = self.batch_norm
        return (parts.mean, parts.m2, present_or_placeholder(bn.running_mean, placeholder),
                present_or_placeholder(bn.running_var, placeholder), self.mean, self.invstd, self.new_mean,
                self.new_var)

    def sizes(self) -> tuple[int, int]:
        """(n_parts, rows_per_part)."""
        return (self.parts.mean.shape[0], self.parts.rows_per_part) if self.parts else (0, 1)

    def scalars(self) -> tuple[float, float]:
        return self.batch_norm.momentum, self.batch_norm.eps


def _fp32_vector(n: int, device) -> Tensor:
    return torch.empty(n, device=device, dtype=torch.float32)


def tail_pointers(tail: Tail, placeholder: Tensor) -> tuple[Tensor, ...]:
    """The kernels' four tail-tensor pointers; absent ones get the placeholder."""
    return tuple(present_or_placeholder(t, placeholder) for t in tail.tensors)


def partial_statistics(y: Tensor, scale: Scale) -> Partials:
    """Per strip of rows and column, mean and M2 of y * s. The strip height is decided from the row
    count's hint (launch.hint): a symbolic batch does not specialize the graph."""
    n_rows, n_cols = y.shape
    rows_per_part = STATS_BLOCK_R * max(1, triton.cdiv(hint(n_rows), STATS_BLOCK_R * TARGET_ROW_STRIPS))
    n_parts = triton.cdiv(n_rows, rows_per_part)
    part_mean = torch.empty((n_parts, n_cols), device=y.device, dtype=torch.float32)
    part_m2 = torch.empty_like(part_mean)
    launch(_partial_stats_kernel)[(n_parts, triton.cdiv(n_cols, STATS_BLOCK_C))](
        y, present_or_placeholder(scale.tensor, part_mean), part_mean, part_m2,
        n_rows, n_cols, rows_per_part,
        y.stride(0), y.stride(1),
        scale.value,
        SCALE_MODE=scale.mode, BLOCK_R=STATS_BLOCK_R, BLOCK_C=STATS_BLOCK_C,
    )
    return Partials(part_mean, part_m2, rows_per_part)


def finalize_statistics(stats: Statistics, parts: Optional[Partials], n_rows: int) -> None:
    """Fills stats' mean/invstd (and new running statistics) from the strips' statistics (training) or
    from the running statistics (eval, parts None), for an output pass that reads them."""
    stats.parts = parts
    n_cols = stats.mean.shape[0]
    launch(_finalize_stats_kernel)[(triton.cdiv(n_cols, FINALIZE_BLOCK_C),)](
        *stats.pointers(), n_rows, n_cols, *stats.sizes(), *stats.scalars(),
        STATS_SOURCE=(STATS_MERGE if parts is not None else STATS_RUNNING).value,
        UPDATE_RUNNING=stats.batch_norm.updates_running_stats, BLOCK_C=FINALIZE_BLOCK_C,
    )
    stats.source = STATS_READ.value


def merges_in_output_pass(n_rows: int, n_cols: int, n_parts: int, y_element_size: int, softmax: bool) -> bool:
    """Whether the output pass should compute the statistics itself: every program of it merges its
    columns' partials (twice for the softmax, once per sweep), which is cheap only while the partials
    are few against the rows it normalizes. In eval, pass n_parts=1 (the running mean and variance
    are one partial's worth of reads). Decided from the sizes' hints: either way is right for any size."""
    n_rows, n_parts = hint(n_rows), hint(n_parts)
    row_programs = triton.cdiv(n_rows, SOFTMAX_LAUNCH.block_r if softmax else NORM_BLOCK_R)
    merge_bytes = (2 if softmax else 1) * row_programs * n_parts * n_cols * 8
    return merge_bytes <= max(MERGE_READS_PER_Y_READ * n_rows * n_cols * y_element_size, MERGE_BYTES_ALWAYS_CHEAP)


# --------------------------------------------------------------------------- output pass


def output_pass(y: Tensor, args: ChainArgs, stats: Statistics, out: Tensor,
                softmax_launch: SoftmaxLaunch = SOFTMAX_LAUNCH) -> Tensor:
    """Writes out = [softmax](tail((y * s1 - mean) * invstd * gamma + beta)), with mean and invstd from
    stats.source. `out` may be y itself: every program reads a tile (or a row) before it writes it, and
    nothing else reads it."""
    n_rows, n_cols = y.shape
    placeholder = unused_pointer(y.device)
    s1, bn = args.scale_before, args.batch_norm
    kernel_args = (
        y, present_or_placeholder(s1.tensor, placeholder), present_or_placeholder(bn.weight, placeholder),
        present_or_placeholder(bn.bias, placeholder), out,
        *tail_pointers(args.tail, placeholder),
        *stats.pointers(),
        n_rows, n_cols, *stats.sizes(),
        y.stride(0), y.stride(1), out.stride(0), out.stride(1),
        s1.value, *stats.scalars(),
    )
    meta = dict(SCALE_MODE=s1.mode, HAS_GAMMA=bn.weight is not None,
                HAS_BETA=bn.bias is not None, STATS_SOURCE=stats.source,
                UPDATE_RUNNING=stats.source == STATS_MERGE.value and bn.updates_running_stats,
                **pointwise.kernel_meta(args.tail.program, args.tail.tensors))
    if args.softmax:
        launch(_normalize_softmax_kernel)[(triton.cdiv(n_rows, softmax_launch.block_r),)](
            *kernel_args, **meta, BLOCK_R=softmax_launch.block_r, BLOCK_C=softmax_launch.block_c(n_cols),
            ACCURATE_EXP=not INTERPRETED, num_warps=softmax_launch.warps(n_cols))
    else:
        launch(_normalize_kernel)[(triton.cdiv(n_rows, NORM_BLOCK_R), triton.cdiv(n_cols, NORM_BLOCK_C))](
            *kernel_args, **meta, BLOCK_R=NORM_BLOCK_R, BLOCK_C=NORM_BLOCK_C)
    return out


def normalize_training(y: Tensor, parts: Partials, stats: Statistics, args: ChainArgs, out: Tensor) -> Tensor:
    """Training: out from y and the strips' statistics, filling stats. Merges the statistics in the
    output pass when that is cheap (one launch), else in a finalize kernel first (two).

    The softmax pass never merges: its two sweeps over a row each compute the normalized values, and
    the sum of the first must be of the very numbers the second divides. Merged in each sweep, by a loop
    over the strips whose trip count the compiler does not know (a batch never specialized), they came
    out a few ulps apart (measured on an H100 at 48 rows: the output 3.96e-7 from float64 against eager's
    1.57e-7, and 1.80e-7 with the count known); read from memory, they are the same loads."""
    n_rows, n_cols = y.shape
    if args.batch_norm.synced:
        synced_statistics(stats, parts, n_rows)
    elif not args.softmax and merges_in_output_pass(n_rows, n_cols, parts.mean.shape[0], y.element_size(), False):
        stats.parts, stats.source = parts, STATS_MERGE.value
    else:
        finalize_statistics(stats, parts, n_rows)
    return output_pass(y, args, stats, out)


def synced_statistics(stats: Statistics, parts: Partials, n_rows: int) -> None:
    """SyncBatchNorm: fills stats from every rank's batch. The strips' statistics are merged into the
    rank's (count, mean, M2), one all-gather merges the ranks' (sync.py); (F,)-sized torch ops, which
    Inductor fuses where the op's body is traced."""
    bn = stats.batch_norm
    count, mean, var = sync.merge_across_ranks(*sync.merge_strips(parts.mean, parts.m2, parts.rows_per_part, n_rows),
                                               bn.group_name)
    stats.mean.copy_(mean)
    stats.invstd.copy_(1.0 / torch.sqrt(var + bn.eps))
    if bn.updates_running_stats:
        new_mean, new_var = updated_running_stats(bn, count, mean, var)
        stats.new_mean.copy_(new_mean)
        stats.new_var.copy_(new_var)
    stats.source = STATS_READ.value


def normalize_eval(y: Tensor, stats: Statistics, args: ChainArgs, out: Tensor) -> Tensor:
    """Eval: the output pass turns the running statistics into mean/invstd itself, or (when that would
    cost it many reads) reads what a tiny finalize kernel computed."""
    n_rows, n_cols = y.shape
    if merges_in_output_pass(n_rows, n_cols, 1, y.element_size(), args.softmax):
        stats.source = STATS_RUNNING.value
    else:
        finalize_statistics(stats, None, n_rows)
    return output_pass(y, args, stats, out)


def normalize_linear_output(y: Tensor, args: ChainArgs, out: Optional[Tensor] = None) -> tuple[Tensor, Statistics]:
    """Every pass after a GEMM that computed no statistics (cuBLAS), on its output y of shape (N, F):
    in training a statistics pass, then the output pass (with a finalize launch between them unless the
    output pass merges). Returns (out, the statistics it was normalized with)."""
    n_rows, n_cols = y.shape
    stats = Statistics.allocate(n_cols, y.device, args.batch_norm)
    if out is None:
        out = torch.empty((n_rows, n_cols), device=y.device, dtype=args.out_dtype)
    if args.batch_norm.training:
        normalize_training(y, partial_statistics(y, args.scale_before), stats, args, out)
    else:
        normalize_eval(y, stats, args, out)
    return out, stats
