"""The Triton kernels of the passes after the GEMM (normalize.py launches them).

After a GEMM that computed no statistics (cuBLAS), a statistics kernel writes per strip of rows and per
feature the mean and M2 of z = y * s1 (the Triton GEMM writes these in its epilogue instead). The
output kernels then normalize: elementwise, or row-wise with an online max-subtracted softmax for rows
of any length. They take mean and invstd from one of three sources (STATS_SOURCE): they READ them (the
finalize kernel merged the strips first), they MERGE the strips themselves with Chan's formula (one
launch fewer), or they turn the RUNNING statistics into them (eval). A kernel that computes them itself
has its first row program write mean/invstd and the running-statistics update, as the finalize kernel
would.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusepass.lowering.pointwise import apply_tail
from fusepass.lowering.tiles import (batch_norm_tile, chan_merge, exp_accurate, inverse_std, load_scale,
                                     tile_column_stats, tile_offsets)

# Where an output pass gets mean and invstd (STATS_SOURCE).
STATS_READ = tl.constexpr(0)
STATS_MERGE = tl.constexpr(1)
STATS_RUNNING = tl.constexpr(2)

# Row strips whose statistics one merge step loads at once (a power of 2).
STRIPS_PER_MERGE = tl.constexpr(32)

# --------------------------------------------------------------------------- kernels
# Row counts (n_rows; the row strips' count follows from it) change with the batch: runtime arguments that
# are never specialized, so a new batch size compiles nothing.
# `stats` below is the tuple of statistics pointers Statistics.pointers() gives, in this order:
# (part_stats, running_mean, running_var, mean, invstd, new_running_mean, new_running_var). part_stats holds
# the strips' means, then their M2s, each n_parts x n_cols row-major: one pointer, so that the kernels stay
# within 30 arguments (wrap_triton tracks tensors only as top-level arguments; pointer tuples are out).
# The output kernels take their meta-parameters as one constexpr tuple, META (normalize.OutputMeta), and TAIL.


@triton.jit(do_not_specialize=["n_rows"])
def partial_stats_kernel(
    # pointers
    y_ptr, scale_ptr, part_stats_ptr,
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
        y = tl.load(y_ptr + tile_offsets(rows, cols, stride_yr, stride_yc), mask=mask, other=0.0)
        tile_count = tl.minimum(row_end - r0, BLOCK_R).to(tl.float32)
        tile_mean, tile_m2 = tile_column_stats(y.to(tl.float32) * s[None, :], row_mask, tile_count)
        count, mean, m2 = chan_merge(count, mean, m2, tile_count, tile_mean, tile_m2)

    out_offsets = pid_r * n_cols + cols
    tl.store(part_stats_ptr + out_offsets, mean, mask=col_mask)
    tl.store(part_stats_ptr + tl.num_programs(0) * n_cols + out_offsets, m2, mask=col_mask)


@triton.jit
def _merged_statistics(part_stats_ptr, cols, col_mask, n_rows, n_cols, rows_per_part):
    """Per column: the row strips' (mean, M2) of z merged. Returns (count, mean, biased variance).

    STRIPS_PER_MERGE strips are loaded at once and merged in one step, with the k-strip form of Chan's
    formula, M2 = sum(M2_p) + sum(n_p * (mean_p - mean)^2), each strip's mean taken relative to the
    step's first one: a common mean cancels exactly before anything is rounded, so that strips of equal
    means merge to that mean and add nothing to M2, whatever its value (weighted means of the raw means
    would round it, and leave n * ulp^2 in M2, which eps does not hide). The steps merge pairwise
    (tiles.chan_merge). Merged one strip after another, each merge waiting on the last one's loads, 32
    strips of 4096 columns took 16.7 us in the finalize kernel (H100): loaded together, their loads
    overlap."""
    count = tl.zeros(cols.shape, dtype=tl.float32)
    mean = tl.zeros(cols.shape, dtype=tl.float32)
    m2 = tl.zeros(cols.shape, dtype=tl.float32)
    n_parts = tl.cdiv(n_rows, rows_per_part)
    for p0 in range(0, n_parts, STRIPS_PER_MERGE):
        parts = p0 + tl.arange(0, STRIPS_PER_MERGE)
        part_mask = parts < n_parts
        mask = part_mask[:, None] & col_mask[None, :]
        # a strip past the last counts no rows and adds nothing below
        part_count = tl.where(part_mask, tl.minimum(rows_per_part, n_rows - parts * rows_per_part), 0)
        part_count = part_count.to(tl.float32)
        part_mean = tl.load(part_stats_ptr + parts[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
        part_m2 = tl.load(part_stats_ptr + (n_parts + parts[:, None]) * n_cols + cols[None, :], mask=mask,
                          other=0.0)
        shift = tl.load(part_stats_ptr + p0 * n_cols + cols, mask=col_mask, other=0.0)
        step_count = tl.sum(part_count, axis=0)
        offset = tl.where(mask, part_mean - shift[None, :], 0.0)
        step_offset = tl.sum(part_count[:, None] * offset, axis=0) / step_count
        deviation = offset - step_offset[None, :]
        step_m2 = tl.sum(part_m2, axis=0) + tl.sum(tl.where(mask, part_count[:, None] * deviation * deviation, 0.0),
                                                   axis=0)
        count, mean, m2 = chan_merge(count, mean, m2, step_count, shift + step_offset, step_m2)
    return count, mean, m2 / count


@triton.jit
def _store_statistics(stats, mean, var, count, cols, mask, momentum, eps, UPDATE_RUNNING: tl.constexpr):
    """Stores mean and invstd, and (training with running statistics) the momentum update of the
    running statistics with the unbiased variance. Returns invstd."""
    _, running_mean_ptr, running_var_ptr, mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr = stats
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
    stats, cols, col_mask, row_program, n_rows, n_cols, rows_per_part, momentum, eps,
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr,
):
    """(mean, invstd) of some columns, from STATS_SOURCE (see the module docstring). When computed here,
    row program 0 stores them and the running-statistics update (a nonzero row_program stores nothing)."""
    part_stats_ptr, running_mean_ptr, running_var_ptr, mean_ptr, invstd_ptr, _, _ = stats
    if STATS_SOURCE == STATS_READ:
        mean = tl.load(mean_ptr + cols, mask=col_mask, other=0.0)
        invstd = tl.load(invstd_ptr + cols, mask=col_mask, other=0.0)
    else:
        if STATS_SOURCE == STATS_MERGE:
            count, mean, var = _merged_statistics(part_stats_ptr, cols, col_mask, n_rows, n_cols, rows_per_part)
        else:
            count = tl.zeros(cols.shape, dtype=tl.float32)
            mean = tl.load(running_mean_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            var = tl.load(running_var_ptr + cols, mask=col_mask, other=1.0).to(tl.float32)
        # A vector comparison: Triton's interpreter rejects a mask and-ed with a scalar condition.
        store_mask = col_mask & ((cols * 0 + row_program) == 0)
        invstd = _store_statistics(stats, mean, var, count, cols, store_mask, momentum, eps, UPDATE_RUNNING)
    return mean, invstd


@triton.jit(do_not_specialize=["n_rows"])
def finalize_stats_kernel(
    # pointers: statistics
    part_stats_ptr, running_mean_ptr, running_var_ptr,
    mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
    # sizes
    n_rows, n_cols, rows_per_part,
    # scalars
    momentum, eps,
    # meta-parameters
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per column: merge the strips' statistics (training) or read the running ones (eval); store
    mean/invstd and update the running statistics, once, for an output pass that reads them."""
    stats = (part_stats_ptr, running_mean_ptr, running_var_ptr,
             mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    _column_statistics(stats, cols, cols < n_cols, 0, n_rows, n_cols, rows_per_part, momentum, eps,
                       STATS_SOURCE, UPDATE_RUNNING)


@triton.jit
def _normalized_tile(
    params, tail_tensors, mean, invstd, rows, cols, row_mask, col_mask, stride_yr, stride_yc, scale_value,
    SCALE_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr, TAIL: tl.constexpr,
):
    """tail((y * s1 - mean) * invstd * gamma + beta) for one tile, in fp32. `params` holds the pointers
    (y, s1, gamma, beta), `tail_tensors` the tail's tensor operands."""
    y_ptr, scale_ptr, gamma_ptr, beta_ptr = params
    mask = row_mask[:, None] & col_mask[None, :]
    s = load_scale(scale_ptr, scale_value, cols, col_mask, SCALE_MODE)
    y = tl.load(y_ptr + tile_offsets(rows, cols, stride_yr, stride_yc), mask=mask, other=0.0)
    u = batch_norm_tile(y.to(tl.float32), s, mean, invstd, gamma_ptr, beta_ptr, cols, col_mask, HAS_GAMMA, HAS_BETA)
    return apply_tail(u, cols, col_mask, tail_tensors, TAIL)


@triton.jit
def _output_tile(
    params, tail_tensors, stats, rows, cols, row_mask, col_mask, row_program, n_rows, n_cols,
    rows_per_part, stride_yr, stride_yc, scale_value, momentum, eps,
    SCALE_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr, TAIL: tl.constexpr,
):
    """The normalized tile u of some rows and columns, with its columns' statistics. Every output pass
    (and both softmax sweeps) computes u through this one function, so the compiler builds the same
    expression, with the same rounding, in each: had one sweep let `u - max` contract into an FMA and
    the other not, numerators and sum would disagree by up to |u| ulps."""
    mean, invstd = _column_statistics(stats, cols, col_mask, row_program, n_rows, n_cols, rows_per_part,
                                      momentum, eps, STATS_SOURCE, UPDATE_RUNNING)
    return _normalized_tile(params, tail_tensors, mean, invstd, rows, cols, row_mask, col_mask, stride_yr, stride_yc,
                            scale_value, SCALE_MODE, HAS_GAMMA, HAS_BETA, TAIL)


@triton.jit(do_not_specialize=["n_rows"])
def normalize_kernel(
    # pointers: input, parameters, output
    y_ptr, scale_ptr, gamma_ptr, beta_ptr, out_ptr,
    # pointers: the tail's tensor operands
    tail_tensor_0, tail_tensor_1, tail_tensor_2, tail_tensor_3,
    # pointers: statistics
    part_stats_ptr, running_mean_ptr, running_var_ptr,
    mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
    # sizes
    n_rows, n_cols, rows_per_part,
    # strides
    stride_yr, stride_yc, stride_or, stride_oc,
    # scalars
    scale_value, momentum, eps,
    # meta-parameters: normalize.OutputMeta's, and the tail program (pointwise.tail_program)
    META: tl.constexpr, TAIL: tl.constexpr,
):
    """out = tail((y * s1 - mean) * invstd * gamma + beta), stored in out's dtype."""
    params = (y_ptr, scale_ptr, gamma_ptr, beta_ptr)
    tail_tensors = (tail_tensor_0, tail_tensor_1, tail_tensor_2, tail_tensor_3)
    SCALE_MODE: tl.constexpr = META[0]
    HAS_GAMMA: tl.constexpr = META[1]
    HAS_BETA: tl.constexpr = META[2]
    STATS_SOURCE: tl.constexpr = META[3]
    UPDATE_RUNNING: tl.constexpr = META[4]
    BLOCK_R: tl.constexpr = META[5]
    BLOCK_C: tl.constexpr = META[6]
    stats = (part_stats_ptr, running_mean_ptr, running_var_ptr,
             mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr)
    pid_r = tl.program_id(0)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    u = _output_tile(params, tail_tensors, stats, rows, cols, row_mask, col_mask, pid_r, n_rows, n_cols,
                     rows_per_part, stride_yr, stride_yc, scale_value, momentum, eps,
                     SCALE_MODE, HAS_GAMMA, HAS_BETA, STATS_SOURCE, UPDATE_RUNNING, TAIL)
    tl.store(out_ptr + tile_offsets(rows, cols, stride_or, stride_oc),
             u.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["n_rows"])
def normalize_softmax_kernel(
    # pointers: input, parameters, output
    y_ptr, scale_ptr, gamma_ptr, beta_ptr, out_ptr,
    # pointers: the tail's tensor operands
    tail_tensor_0, tail_tensor_1, tail_tensor_2, tail_tensor_3,
    # pointers: statistics
    part_stats_ptr, running_mean_ptr, running_var_ptr,
    mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
    # sizes
    n_rows, n_cols, rows_per_part,
    # strides
    stride_yr, stride_yc, stride_or, stride_oc,
    # scalars
    scale_value, momentum, eps,
    # meta-parameters: normalize.OutputMeta's, and the tail program (pointwise.tail_program)
    META: tl.constexpr, TAIL: tl.constexpr,
):
    """out = softmax(tail(u), dim=-1) for BLOCK_R whole rows of any length: an online max/sum sweep over
    the columns, then a sweep that writes exp(u - max) / sum. fp32 throughout."""
    params = (y_ptr, scale_ptr, gamma_ptr, beta_ptr)
    tail_tensors = (tail_tensor_0, tail_tensor_1, tail_tensor_2, tail_tensor_3)
    SCALE_MODE: tl.constexpr = META[0]
    HAS_GAMMA: tl.constexpr = META[1]
    HAS_BETA: tl.constexpr = META[2]
    STATS_SOURCE: tl.constexpr = META[3]
    UPDATE_RUNNING: tl.constexpr = META[4]
    BLOCK_R: tl.constexpr = META[5]
    BLOCK_C: tl.constexpr = META[6]
    ACCURATE_EXP: tl.constexpr = META[7]
    stats = (part_stats_ptr, running_mean_ptr, running_var_ptr,
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
                         rows_per_part, stride_yr, stride_yc, scale_value, momentum, eps,
                         SCALE_MODE, HAS_GAMMA, HAS_BETA, STATS_SOURCE, UPDATE_RUNNING, TAIL)
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
                         rows_per_part, stride_yr, stride_yc, scale_value, momentum, eps,
                         SCALE_MODE, HAS_GAMMA, HAS_BETA, STATS_SOURCE, UPDATE_RUNNING, TAIL)
        u = tl.where(col_mask[None, :], u, float("-inf"))
        p = tl.math.div_rn(exp_accurate(u - shift[:, None], ACCURATE_EXP), row_sum[:, None])
        tl.store(out_ptr + tile_offsets(rows, cols, stride_or, stride_oc),
                 p.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
