"""Triton helpers shared by the fused operator's kernels (the GEMM epilogue and the passes after it),
so that every kernel computes the same expression, with the same rounding, for the same quantity."""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

# How a scale enters the kernels (SCALE_MODE): a Python number, a one-element tensor, or one value per
# feature. Constexpr globals, so kernels compare against the names; launchers pass `.value`.
SCALE_NUMBER = tl.constexpr(0)
SCALE_SINGLE = tl.constexpr(1)
SCALE_PER_FEATURE = tl.constexpr(2)
# Triton's interpreter (TRITON_INTERPRET=1, read when kernels are defined) has no libdevice.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def scale_mode(scale) -> int:
    """SCALE_MODE for a scale tensor (None: a Python number)."""
    if scale is None:
        return SCALE_NUMBER.value
    return (SCALE_PER_FEATURE if scale.numel() > 1 else SCALE_SINGLE).value


@triton.jit
def exp_accurate(x, ACCURATE_EXP: tl.constexpr):
    """exp(x) within ~1 ulp. tl.exp compiles to a fast approximation whose error grows with |x|
    (3x eager's softmax error at |x| ~ 200); eager's CUDA softmax uses libdevice's expf, and so do we.
    The interpreter's tl.exp is numpy's exp, accurate already."""
    if ACCURATE_EXP:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def load_scale(scale_ptr, scale_value, cols, col_mask, SCALE_MODE: tl.constexpr):
    """The scale as an fp32 vector over the columns, whatever form it came in."""
    if SCALE_MODE == SCALE_PER_FEATURE:
        s = tl.load(scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    elif SCALE_MODE == SCALE_SINGLE:
        s = tl.load(scale_ptr + cols * 0, mask=col_mask, other=0.0).to(tl.float32)
    else:
        s = tl.full(cols.shape, 1.0, tl.float32) * tl.cast(scale_value, tl.float32)
    return s


@triton.jit
def inverse_std(var, eps):
    """1 / sqrt(var + eps), both operations correctly rounded like eager's."""
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(var + tl.cast(eps, tl.float32)))


@triton.jit
def chan_merge(count, mean, m2, other_count, other_mean, other_m2):
    """Chan et al.'s merge of two (count, mean, M2) summaries: stable, unlike E[z^2] - E[z]^2."""
    total = count + other_count
    delta = other_mean - mean
    mean = mean + delta * (other_count / total)
    m2 = m2 + other_m2 + delta * delta * (count * other_count / total)
    return total, mean, m2


@triton.jit
def finite_or_zero(v):
    """v where finite, else 0."""
    return tl.where((v > float("-inf")) & (v < float("inf")), v, 0.0)


@triton.jit
def tile_column_stats(z, row_mask, count):
    """Per column of a tile, the mean and M2 of its valid rows (`count` of them).

    The mean in two passes: the sum's, then corrected by the mean of the values less it. Those are of
    the order of the column's spread, not of its mean, so that the correction's sum loses little to a mean
    far from 0, and a constant column gets exactly its value as mean (each difference is exact, as is
    their sum) and 0 as M2. 1000 rows of 1e4 + N(0, 1), 12 draws, interpreted: invstd 6e-6 to 2.5e-5 from
    exact, against 3e-5 to 1.4e-4 in one pass and 3e-6 to 1.3e-5 for eager's CPU batch norm (which
    accumulates in float64). Where the correction is not finite (a column holding an inf or NaN), it is
    dropped: the tile's mean is the one pass's, as before the correction."""
    rough_mean = tl.sum(tl.where(row_mask[:, None], z, 0.0), axis=0) / count
    deviation = tl.where(row_mask[:, None], z - rough_mean[None, :], 0.0)
    correction = finite_or_zero(tl.sum(deviation, axis=0) / count)
    centered = tl.where(row_mask[:, None], deviation - correction[None, :], 0.0)
    return rough_mean + correction, tl.sum(centered * centered, axis=0)


@triton.jit
def batch_norm_tile(y, s, mean, invstd, gamma_ptr, beta_ptr, cols, col_mask,
                    HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr):
    """u = (y * s1 - mean) * invstd * gamma + beta for an fp32 tile y, per-column vectors."""
    u = (y * s[None, :] - mean[None, :]) * invstd[None, :]
    if HAS_GAMMA:
        u = u * tl.load(gamma_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BETA:
        u = u + tl.load(beta_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return u


@triton.jit
def tile_offsets(rows, cols, stride_rows, stride_cols):
    """The element offsets of a tile of rows x cols, in int64: a tensor past 2**31 elements (a large batch
    of a wide layer) would wrap int32 offsets."""
    return rows.to(tl.int64)[:, None] * stride_rows + cols.to(tl.int64)[None, :] * stride_cols


@triton.jit
def grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile number `tile` in grouped order: GROUP_M row tiles share each
    W column tile while it is in L2."""
    group_size = GROUP_M * num_pid_n
    first_pid_m = (tile // group_size) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    return first_pid_m + (tile % group_size) % group_rows, (tile % group_size) // group_rows
