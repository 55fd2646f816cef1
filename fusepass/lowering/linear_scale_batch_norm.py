"""The fused operator ``torch.ops.fusepass.linear_scale_batch_norm``: the whole chain family
``linear -> [* s1] -> batch_norm -> [* s2] -> [softmax over features]`` on 2-D input, exactly as eager:

    y   = linear(x, W, b)                        # in x's dtype, like eager
    z   = y * s1                                 # s1: per-feature, (1,), 0-d tensor or a Python number
    u   = ((z - mean) * invstd * gamma + beta) * s2   # batch statistics (training) or running ones (eval)
    out = softmax(u, dim=-1)  or  u              # max-subtracted, fp32

An absent scale is the number 1.0. In training the op also returns the updated running statistics
(momentum update, unbiased variance); the rewritten graph copies them into the module's buffers,
because an op that mutates its inputs cannot carry an autograd formula.

Two CUDA implementations, chosen per problem by timing (tuning.py, cached on disk): the Triton GEMM of
gemm.py with the statistics (training) or the whole normalization (eval) in its epilogue, followed by
the passes below; or cuBLAS's GEMM followed by a statistics pass and the same passes. The fp32 GEMM is
3xTF32 (fp32-accurate) unless torch allows TF32 (then TF32, as eager) or the op is asked for IEEE FMA.

The op is a triton_op: on CUDA with static shapes torch.compile traces its body (the implementation is
chosen then, timed on stand-in inputs) and Inductor launches the kernels. Otherwise it calls an opaque
custom op that chooses and launches at run time (and on CPU runs the reference).

Contents, in order: the plain-PyTorch reference (also the CPU implementation), the Triton passes, the
launchers, the choice between implementations, the op registrations (traced and opaque, the latter
with its fake), the autograd formula.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from fusepass.lowering import gemm
from fusepass.lowering.launch import launch, real_tensors, tracing, unused_pointer
from fusepass.lowering.tiles import (INTERPRETED, batch_norm_tile, chan_merge, exp_accurate, inverse_std,
                                     load_scale, scale_mode, tile_column_stats)
from fusepass.lowering.tuning import TUNER, capturing

OP_NAME = "fusepass::linear_scale_batch_norm"
# Set (to anything) to keep the op opaque to torch.compile on CUDA too (see linear_scale_batch_norm).
OPAQUE_ENV = "FUSEPASS_OPAQUE"


def check_batch_size(training: bool, x: Tensor) -> None:
    """Eager's check: batch statistics over a single row are undefined."""
    if training and x.shape[0] == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {torch.Size((1, *x.shape[1:]))}"
        )


def _new_running_stat_shape(training: bool, running: Optional[Tensor]) -> tuple[int, ...]:
    return tuple(running.shape) if training and running is not None else (0,)


# --------------------------------------------------------------------------- reference / CPU


def reference(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    scale: Optional[Tensor],
    scale_value: float,
    bn_weight: Optional[Tensor],
    bn_bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    training: bool,
    momentum: float,
    eps: float,
    out_dtype: torch.dtype,
    keep_linear: bool,
    scale_after: Optional[Tensor] = None,
    scale_after_value: float = 1.0,
    softmax: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The op's math in plain PyTorch, fp32 throughout. Returns the op's six outputs."""
    check_batch_size(training, x)
    y = F.linear(x, weight, bias)
    z = y.float() * _as_factor(scale, scale_value)
    if training:
        var, mean = torch.var_mean(z, dim=0, correction=0)
    else:
        # Copies: an op's outputs must not alias its inputs.
        mean, var = running_mean.to(torch.float32, copy=True), running_var.to(torch.float32, copy=True)
    invstd = 1.0 / torch.sqrt(var + eps)
    out = _affine((z - mean) * invstd, bn_weight, bn_bias) * _as_factor(scale_after, scale_after_value)
    if softmax:
        out = torch.softmax(out, dim=-1)
    new_mean, new_var = _updated_running_stats(z.shape[0], mean, var, running_mean, running_var, training, momentum)
    linear_out = y if keep_linear else y.new_empty(0)
    return out.to(out_dtype), new_mean, new_var, linear_out, mean, invstd


def _as_factor(scale: Optional[Tensor], value: float):
    return scale.float() if scale is not None else value


def _affine(x_hat: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    if weight is not None:
        x_hat = x_hat * weight.float()
    if bias is not None:
        x_hat = x_hat + bias.float()
    return x_hat


def _updated_running_stats(n, mean, var, running_mean, running_var, training, momentum):
    if not training or running_mean is None:
        dtype = running_mean.dtype if running_mean is not None else torch.float32  # as the fake says
        return mean.new_empty(0, dtype=dtype), mean.new_empty(0, dtype=dtype)
    unbiased_var = var * (n / (n - 1))
    new_mean = momentum * mean + (1.0 - momentum) * running_mean.float()
    new_var = momentum * unbiased_var + (1.0 - momentum) * running_var.float()
    return new_mean.to(running_mean.dtype), new_var.to(running_var.dtype)


# --------------------------------------------------------------------------- Triton kernels
# (The GEMM with the statistics/normalize epilogue is in gemm.py; these are the passes after a GEMM.)


@triton.jit
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
    """Per column, the mean and M2 of z = y * s over one strip of rows (Chan-merged tile by tile).
    Used after a cuBLAS GEMM; the Triton GEMM writes these in its epilogue instead."""
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
def _store_statistics(
    mean, var, count, cols, mask,
    mean_ptr, invstd_ptr, running_mean_ptr, running_var_ptr, new_running_mean_ptr, new_running_var_ptr,
    momentum, eps, UPDATE_RUNNING: tl.constexpr,
):
    """Stores mean and invstd, and (training with running statistics) the momentum update of the
    running statistics with the unbiased variance. Returns invstd."""
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
def _finalize_stats_kernel(
    # pointers
    part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
    mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
    # sizes
    n_rows, n_cols, n_parts, rows_per_part,
    # scalars
    momentum, eps,
    # meta-parameters
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per column: merge the strips' statistics (training) or read the running ones (eval); emit
    mean/invstd and update the running statistics. The same work an output pass does itself when it
    computes its statistics (_column_statistics), here done once, before the pass."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    _column_statistics(part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
                       mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
                       cols, cols < n_cols, 0, n_rows, n_cols, n_parts, rows_per_part, momentum, eps,
                       STATS_SOURCE, UPDATE_RUNNING)


@triton.jit
def _column_statistics(
    part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
    mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
    cols, col_mask, row_program, n_rows, n_cols, n_parts, rows_per_part, momentum, eps,
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr,
):
    """(mean, invstd) of some columns for an output pass, by STATS_SOURCE: READ them from mean/invstd
    (filled before the pass), or compute them here, saving a finalize launch, by MERGE-ing the strips'
    statistics (training) or from the RUNNING statistics (eval). When computed here, row program 0
    writes mean/invstd and the running-statistics update, as the finalize kernel would (a nonzero
    row_program writes nothing)."""
    if STATS_SOURCE == 0:
        mean = tl.load(mean_ptr + cols, mask=col_mask, other=0.0)
        invstd = tl.load(invstd_ptr + cols, mask=col_mask, other=0.0)
    else:
        if STATS_SOURCE == 1:
            count, mean, var = _merged_statistics(part_mean_ptr, part_m2_ptr, cols, col_mask, n_rows, n_cols,
                                                  n_parts, rows_per_part)
        else:
            count = tl.zeros(cols.shape, dtype=tl.float32)
            mean = tl.load(running_mean_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            var = tl.load(running_var_ptr + cols, mask=col_mask, other=1.0).to(tl.float32)
        # A vector comparison: Triton's interpreter rejects a mask and-ed with a scalar condition.
        store_mask = col_mask & ((cols * 0 + row_program) == 0)
        invstd = _store_statistics(mean, var, count, cols, store_mask, mean_ptr, invstd_ptr,
                                   running_mean_ptr, running_var_ptr, new_running_mean_ptr, new_running_var_ptr,
                                   momentum, eps, UPDATE_RUNNING)
    return mean, invstd


@triton.jit
def _normalized_tile(
    y_ptr, scale_ptr, gamma_ptr, beta_ptr, scale_after_ptr, mean, invstd,
    rows, cols, row_mask, col_mask, stride_yr, stride_yc, scale_value, scale_after_value,
    SCALE_MODE: tl.constexpr, SCALE_AFTER_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
):
    """u = ((y * s1 - mean) * invstd * gamma + beta) * s2 for one tile, in fp32."""
    mask = row_mask[:, None] & col_mask[None, :]
    s = load_scale(scale_ptr, scale_value, cols, col_mask, SCALE_MODE)
    y = tl.load(y_ptr + rows[:, None] * stride_yr + cols[None, :] * stride_yc, mask=mask, other=0.0)
    s2 = load_scale(scale_after_ptr, scale_after_value, cols, col_mask, SCALE_AFTER_MODE)
    return batch_norm_tile(y.to(tl.float32), s, mean, invstd, gamma_ptr, beta_ptr, s2, cols, col_mask,
                           HAS_GAMMA, HAS_BETA)


@triton.jit
def _normalize_kernel(
    # pointers: input, parameters, output
    y_ptr, scale_ptr, gamma_ptr, beta_ptr, scale_after_ptr, out_ptr,
    # pointers: statistics (see _column_statistics)
    part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
    mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
    # sizes
    n_rows, n_cols, n_parts, rows_per_part,
    # strides
    stride_yr, stride_yc, stride_or, stride_oc,
    # scalars
    scale_value, scale_after_value, momentum, eps,
    # meta-parameters
    SCALE_MODE: tl.constexpr, SCALE_AFTER_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out = ((y * s1 - mean) * invstd * gamma + beta) * s2, stored in out's dtype."""
    pid_r = tl.program_id(0)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mean, invstd = _column_statistics(
        part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
        mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
        cols, col_mask, pid_r, n_rows, n_cols, n_parts, rows_per_part, momentum, eps, STATS_SOURCE, UPDATE_RUNNING)
    u = _normalized_tile(y_ptr, scale_ptr, gamma_ptr, beta_ptr, scale_after_ptr, mean, invstd,
                         rows, cols, row_mask, col_mask, stride_yr, stride_yc, scale_value, scale_after_value,
                         SCALE_MODE, SCALE_AFTER_MODE, HAS_GAMMA, HAS_BETA)
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :] * stride_oc,
             u.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _softmax_logits(
    y_ptr, scale_ptr, gamma_ptr, beta_ptr, scale_after_ptr,
    part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
    mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
    rows, c0, row_mask, row_program, n_rows, n_cols, n_parts, rows_per_part,
    stride_yr, stride_yc, scale_value, scale_after_value, momentum, eps,
    SCALE_MODE: tl.constexpr, SCALE_AFTER_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One column block of the logits, -inf past the last column. Both softmax sweeps call this one
    function, so the compiler builds the same expression (and rounding) for u in each: had one sweep
    let `u - max` contract into an FMA and the other not, numerators and sum would disagree by up to
    |u| ulps."""
    cols = c0 + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    mean, invstd = _column_statistics(
        part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
        mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
        cols, col_mask, row_program, n_rows, n_cols, n_parts, rows_per_part, momentum, eps, STATS_SOURCE, UPDATE_RUNNING)
    u = _normalized_tile(y_ptr, scale_ptr, gamma_ptr, beta_ptr, scale_after_ptr, mean, invstd,
                         rows, cols, row_mask, col_mask, stride_yr, stride_yc, scale_value, scale_after_value,
                         SCALE_MODE, SCALE_AFTER_MODE, HAS_GAMMA, HAS_BETA)
    return tl.where(col_mask[None, :], u, float("-inf")), cols, col_mask


@triton.jit
def _normalize_softmax_kernel(
    # pointers: input, parameters, output
    y_ptr, scale_ptr, gamma_ptr, beta_ptr, scale_after_ptr, out_ptr,
    # pointers: statistics (see _column_statistics)
    part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
    mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
    # sizes
    n_rows, n_cols, n_parts, rows_per_part,
    # strides
    stride_yr, stride_yc, stride_or, stride_oc,
    # scalars
    scale_value, scale_after_value, momentum, eps,
    # meta-parameters
    SCALE_MODE: tl.constexpr, SCALE_AFTER_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
    STATS_SOURCE: tl.constexpr, UPDATE_RUNNING: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
):
    """out = softmax(u, dim=-1) for BLOCK_R whole rows of any length: an online max/sum sweep over
    the columns, then a sweep that writes exp(u - max) / sum. fp32 throughout."""
    pid_r = tl.program_id(0)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    row_max = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_C):
        u, cols, col_mask = _softmax_logits(
            y_ptr, scale_ptr, gamma_ptr, beta_ptr, scale_after_ptr,
            part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
            mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
            rows, c0, row_mask, pid_r, n_rows, n_cols, n_parts, rows_per_part,
            stride_yr, stride_yc, scale_value, scale_after_value, momentum, eps,
            SCALE_MODE, SCALE_AFTER_MODE, HAS_GAMMA, HAS_BETA, STATS_SOURCE, UPDATE_RUNNING, BLOCK_C)
        new_max = tl.maximum(row_max, tl.max(u, axis=1))
        # While a row has seen only -inf, subtract 0 instead of -inf so that no -inf - -inf NaN appears
        # (a row that is -inf throughout still ends 0 / 0 = NaN, as in eager).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * exp_accurate(row_max - shift, ACCURATE_EXP) + tl.sum(exp_accurate(u - shift[:, None], ACCURATE_EXP), axis=1)
        row_max = new_max
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    for c0 in range(0, n_cols, BLOCK_C):
        u, cols, col_mask = _softmax_logits(
            y_ptr, scale_ptr, gamma_ptr, beta_ptr, scale_after_ptr,
            part_mean_ptr, part_m2_ptr, running_mean_ptr, running_var_ptr,
            mean_ptr, invstd_ptr, new_running_mean_ptr, new_running_var_ptr,
            rows, c0, row_mask, 1, n_rows, n_cols, n_parts, rows_per_part,
            stride_yr, stride_yc, scale_value, scale_after_value, momentum, eps,
            SCALE_MODE, SCALE_AFTER_MODE, HAS_GAMMA, HAS_BETA, STATS_SOURCE, UPDATE_RUNNING, BLOCK_C)
        p = tl.math.div_rn(exp_accurate(u - shift[:, None], ACCURATE_EXP), row_sum[:, None])
        tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :] * stride_oc,
                 p.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# --------------------------------------------------------------------------- launchers

STATS_BLOCK_R, STATS_BLOCK_C = 32, 64
NORM_BLOCK_R, NORM_BLOCK_C = 32, 64
# Measured on an H200 for 1024 x 8192 (tools/tune_softmax.py): 2 rows x 2048 columns with 16 warps ran
# in 0.035 ms against 0.058 ms for 4 x 1024 with 4 warps; the floor is 0.024 ms.
SOFTMAX_BLOCK_R, SOFTMAX_MAX_BLOCK_C = 2, 2048
FINALIZE_BLOCK_C = 64
# Rows each statistics program covers: enough strips to fill a GPU, few enough to keep partials small.
TARGET_ROW_STRIPS = 64
# The output pass merges the strips' statistics itself (no finalize launch) while that costs it at most
# this many bytes of (L2-resident) partials read per byte of y it reads anyway, or at most a few MB in
# all: reading those from L2 costs less than a launch.
MERGE_READS_PER_Y_READ = 1.0
MERGE_BYTES_ALWAYS_CHEAP = 4 * 2**20


# Where an output pass gets mean and invstd (_column_statistics).
READ, MERGE_PARTS, RUNNING = 0, 1, 2


class Partials(NamedTuple):
    """Per strip of rows and per feature, the mean and M2 of z = y * s (strips of rows_per_part rows)."""
    mean: Tensor
    m2: Tensor
    rows_per_part: int


@dataclass
class Statistics:
    """The per-feature statistics an output pass normalizes with. mean/invstd (and the new running
    statistics) are filled before the pass (finalize kernel, GEMM epilogue: source READ), or by the
    pass itself: from the strips' statistics `parts` (MERGE_PARTS) or the running ones (RUNNING)."""
    mean: Tensor
    invstd: Tensor
    new_mean: Tensor
    new_var: Tensor
    running_mean: Optional[Tensor] = None
    running_var: Optional[Tensor] = None
    momentum: float = 0.0
    eps: float = 0.0
    parts: Optional[Partials] = None
    update_running: bool = False
    source: int = READ

    @classmethod
    def allocate(cls, n_cols: int, device, training: bool, running_mean, running_var, momentum: float = 0.0,
                 eps: float = 0.0) -> "Statistics":
        new_mean, new_var = _new_running_stats(training, running_mean, running_var, device)
        return cls(_fp32_vector(n_cols, device), _fp32_vector(n_cols, device), new_mean, new_var,
                   running_mean, running_var, momentum, eps,
                   update_running=training and running_mean is not None)

    def kernel_args(self) -> tuple:
        """Pointers (part_mean, part_m2, running_mean, running_var, mean, invstd, new running mean/var),
        then (n_parts, rows_per_part), then (momentum, eps), as the kernels take them."""
        placeholder = unused_pointer(self.mean.device)  # for absent optional tensors
        parts = self.parts or Partials(placeholder, placeholder, 1)
        pointers = (parts.mean, parts.m2, _or(self.running_mean, placeholder), _or(self.running_var, placeholder),
                    self.mean, self.invstd, self.new_mean, self.new_var)
        return pointers, (parts.mean.shape[0] if self.parts else 0, parts.rows_per_part), (self.momentum, self.eps)


def _or(t: Optional[Tensor], placeholder: Tensor) -> Tensor:
    return t if t is not None else placeholder


def _fp32_vector(n: int, device) -> Tensor:
    return torch.empty(n, device=device, dtype=torch.float32)


def _new_running_stats(training: bool, running_mean, running_var, device) -> tuple[Tensor, Tensor]:
    def like(running):
        return torch.empty(_new_running_stat_shape(training, running), device=device,
                           dtype=running.dtype if running is not None else torch.float32)
    return like(running_mean), like(running_var)


def partial_statistics(y: Tensor, scale: Optional[Tensor], scale_value: float) -> Partials:
    """Per strip of rows and column, mean and M2 of y * s."""
    n_rows, n_cols = y.shape
    rows_per_part = STATS_BLOCK_R * max(1, triton.cdiv(n_rows, STATS_BLOCK_R * TARGET_ROW_STRIPS))
    n_parts = triton.cdiv(n_rows, rows_per_part)
    part_mean = torch.empty((n_parts, n_cols), device=y.device, dtype=torch.float32)
    part_m2 = torch.empty_like(part_mean)
    launch(_partial_stats_kernel)[(n_parts, triton.cdiv(n_cols, STATS_BLOCK_C))](
        y, scale if scale is not None else part_mean, part_mean, part_m2,
        n_rows, n_cols, rows_per_part,
        y.stride(0), y.stride(1),
        scale_value,
        SCALE_MODE=scale_mode(scale), BLOCK_R=STATS_BLOCK_R, BLOCK_C=STATS_BLOCK_C,
    )
    return Partials(part_mean, part_m2, rows_per_part)


def finalize_statistics(stats: Statistics, parts: Optional[Partials], n_rows: int) -> None:
    """Fills stats' mean/invstd (and new running statistics) from the strips' statistics (training) or
    from the running statistics (eval, parts None), for an output pass that reads them."""
    stats.parts = parts
    pointers, sizes, scalars = stats.kernel_args()
    n_cols = stats.mean.shape[0]
    launch(_finalize_stats_kernel)[(triton.cdiv(n_cols, FINALIZE_BLOCK_C),)](
        *pointers, n_rows, n_cols, *sizes, *scalars,
        STATS_SOURCE=MERGE_PARTS if parts is not None else RUNNING, UPDATE_RUNNING=stats.update_running,
        BLOCK_C=FINALIZE_BLOCK_C,
    )


def merges_in_output_pass(n_rows: int, n_cols: int, n_parts: int, y_element_size: int, softmax: bool) -> bool:
    """Whether the output pass should compute the statistics itself: every program of it merges its
    columns' partials (twice for the softmax, once per sweep), which is cheap only while the partials
    are few against the rows it normalizes. In eval, pass n_parts=1 (the running mean and variance
    are one partial's worth of reads)."""
    row_programs = triton.cdiv(n_rows, SOFTMAX_BLOCK_R if softmax else NORM_BLOCK_R)
    merge_bytes = (2 if softmax else 1) * row_programs * n_parts * n_cols * 8
    return merge_bytes <= max(MERGE_READS_PER_Y_READ * n_rows * n_cols * y_element_size, MERGE_BYTES_ALWAYS_CHEAP)


def normalize_training(y: Tensor, parts: Partials, stats: Statistics, scale, scale_value, bn_weight, bn_bias,
                       scale_after, scale_after_value, softmax: bool, out: Tensor) -> Tensor:
    """Training: out from y and the strips' statistics, filling stats. Merges the statistics in the
    output pass when that is cheap (one launch), else in a finalize kernel first (two)."""
    n_rows, n_cols = y.shape
    if merges_in_output_pass(n_rows, n_cols, parts.mean.shape[0], y.element_size(), softmax):
        stats.parts, stats.source = parts, MERGE_PARTS
    else:
        finalize_statistics(stats, parts, n_rows)
    return output_pass(y, scale, scale_value, stats, bn_weight, bn_bias, scale_after, scale_after_value,
                       softmax, out)


def output_pass(y: Tensor, scale, scale_value, stats: Statistics, bn_weight, bn_bias, scale_after,
                scale_after_value, softmax: bool, out: Tensor) -> Tensor:
    """Writes out = [softmax](((y * s1 - mean) * invstd * gamma + beta) * s2). `out` may be y itself:
    every program reads a tile (or a row) before it writes it, and nothing else reads it."""
    n_rows, n_cols = y.shape
    pointers, sizes, scalars = stats.kernel_args()
    placeholder = unused_pointer(y.device)  # for absent optional tensors
    args = (
        y, _or(scale, placeholder), _or(bn_weight, placeholder), _or(bn_bias, placeholder),
        _or(scale_after, placeholder), out,
        *pointers,
        n_rows, n_cols, *sizes,
        y.stride(0), y.stride(1), out.stride(0), out.stride(1),
        scale_value, scale_after_value, *scalars,
    )
    meta = dict(SCALE_MODE=scale_mode(scale), SCALE_AFTER_MODE=scale_mode(scale_after),
                HAS_GAMMA=bn_weight is not None, HAS_BETA=bn_bias is not None,
                STATS_SOURCE=stats.source, UPDATE_RUNNING=stats.source == MERGE_PARTS and stats.update_running)
    if softmax:
        block_c = min(SOFTMAX_MAX_BLOCK_C, triton.next_power_of_2(n_cols))
        launch(_normalize_softmax_kernel)[(triton.cdiv(n_rows, SOFTMAX_BLOCK_R),)](
            *args, **meta, BLOCK_R=SOFTMAX_BLOCK_R, BLOCK_C=block_c, ACCURATE_EXP=not INTERPRETED,
            num_warps=max(4, min(16, block_c // 128)))
    else:
        launch(_normalize_kernel)[(triton.cdiv(n_rows, NORM_BLOCK_R), triton.cdiv(n_cols, NORM_BLOCK_C))](
            *args, **meta, BLOCK_R=NORM_BLOCK_R, BLOCK_C=NORM_BLOCK_C)
    return out


def _output_buffer(y: Tensor, out_dtype: torch.dtype, keep_linear: bool) -> Tensor:
    """Where the output goes: over y when y is not returned (saves an (N, F) buffer), else a new tensor.
    Not over y while traced: Inductor then copied y into a new buffer for the pass to write (seen in
    its generated code: one more launch and a copy of y, no memory saved)."""
    if not keep_linear and y.dtype == out_dtype and y.is_contiguous() and not tracing():
        return y
    return torch.empty(y.shape, device=y.device, dtype=out_dtype)


def scale_batch_norm(
    y: Tensor,
    scale: Optional[Tensor],
    scale_value: float,
    bn_weight: Optional[Tensor],
    bn_bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    training: bool,
    momentum: float,
    eps: float,
    out_dtype: torch.dtype,
    scale_after: Optional[Tensor] = None,
    scale_after_value: float = 1.0,
    softmax: bool = False,
    out: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The passes after a GEMM that did not compute statistics (cuBLAS), on its output y of shape (N, F).

    Returns (out, new_running_mean, new_running_var, mean, invstd). Training: one statistics pass over
    y, then the output pass (elementwise, or row-wise with the softmax), with a merge over F-sized
    vectors in between unless the output pass merges. Eval: the output pass, which turns the running
    variance into invstd itself, or (when that would cost it many reads) after a tiny kernel that does.
    """
    n_rows, n_cols = y.shape
    if not training and running_mean is None:
        raise ValueError("batch_norm in eval mode needs running statistics")
    check_batch_size(training, y)
    stats = Statistics.allocate(n_cols, y.device, training, running_mean, running_var, momentum, eps)
    if out is None:
        out = torch.empty((n_rows, n_cols), device=y.device, dtype=out_dtype)
    norm = (scale, scale_value, bn_weight, bn_bias, scale_after, scale_after_value, softmax, out)
    if training:
        normalize_training(y, partial_statistics(y, scale, scale_value), stats, *norm)
    else:
        if merges_in_output_pass(n_rows, n_cols, 1, y.element_size(), softmax):
            stats.source = RUNNING
        else:
            finalize_statistics(stats, None, n_rows)
        output_pass(y, scale, scale_value, stats, *norm[2:])
    return out, stats.new_mean, stats.new_var, stats.mean, stats.invstd


def gemm_batch_norm(x, weight, bias, scale, scale_value, bn_weight, bn_bias, running_mean, running_var,
                    training, momentum, eps, out_dtype, keep_linear, scale_after, scale_after_value, softmax,
                    precision: str, config: gemm.GemmConfig):
    """The op on the Triton GEMM: statistics (training) or the whole eval-mode normalization (without
    softmax) in its epilogue. Training: GEMM and output pass (with a finalize launch between them when
    the row tiles are many). Eval: the GEMM alone, or GEMM and the softmax pass. Returns the op's six
    outputs."""
    if not training and running_mean is None:
        raise ValueError("batch_norm in eval mode needs running statistics")
    n_cols = weight.shape[0]
    scales = dict(scale=scale, scale_value=scale_value)
    norm = (bn_weight, bn_bias, scale_after, scale_after_value, softmax)
    stats = Statistics.allocate(n_cols, x.device, training, running_mean, running_var, momentum, eps)
    if training:
        g = gemm.linear_epilogue(x, weight, bias, precision, config, epilogue=gemm.STATISTICS, **scales)
        y, out = g.y, _output_buffer(g.y, out_dtype, keep_linear)
        normalize_training(y, Partials(g.part_mean, g.part_m2, g.rows_per_part), stats, scale, scale_value,
                           *norm, out)
    else:
        eval_stats = dict(running_mean=running_mean, running_var=running_var, eps=eps, mean=stats.mean,
                          invstd=stats.invstd)
        if softmax:
            g = gemm.linear_epilogue(x, weight, bias, precision, config, epilogue=gemm.LINEAR, **scales,
                                     **eval_stats)
            y = g.y
            out = output_pass(y, scale, scale_value, stats, *norm, _output_buffer(y, out_dtype, keep_linear))
        else:
            g = gemm.linear_epilogue(
                x, weight, bias, precision, config, epilogue=gemm.NORMALIZE, store_y=keep_linear, **scales,
                **eval_stats, bn_weight=bn_weight, bn_bias=bn_bias, scale_after=scale_after,
                scale_after_value=scale_after_value, out_dtype=out_dtype)
            y, out = g.y, g.out
    return out, stats.new_mean, stats.new_var, y if keep_linear else y.new_empty(0), stats.mean, stats.invstd


def cublas_batch_norm(x, weight, bias, scale, scale_value, bn_weight, bn_bias, running_mean, running_var,
                      training, momentum, eps, out_dtype, keep_linear, scale_after, scale_after_value, softmax,
                      precision: str):
    """The op on cuBLAS's GEMM (F.linear, as eager) followed by the Triton passes."""
    with _cublas_precision(precision):
        y = F.linear(x, weight, bias)
    out, new_mean, new_var, mean, invstd = scale_batch_norm(
        y, scale, scale_value, bn_weight, bn_bias, running_mean, running_var, training, momentum, eps, out_dtype,
        scale_after, scale_after_value, softmax, out=_output_buffer(y, out_dtype, keep_linear))
    return out, new_mean, new_var, y if keep_linear else y.new_empty(0), mean, invstd


@contextlib.contextmanager
def _cublas_precision(precision: str):
    """cuBLAS follows torch's global TF32 flag; the op's fp32 precision was resolved already."""
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow


# --------------------------------------------------------------------------- choosing an implementation

FP32_MATMUL = ("tf32x3", "ieee")
GEMM_CHOICES = ("auto", "triton", "cublas")


def matmul_precision(dtype: torch.dtype, fp32_matmul: str) -> str:
    """The GEMM precision for this call: bf16/fp16 natively; fp32 as the user allows it (TF32 when
    torch allows TF32, as eager), else fp32-accurate 3xTF32, or IEEE FMA when asked for."""
    if dtype != torch.float32:
        return "native"
    if fp32_matmul == "ieee":
        return "ieee"
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "tf32x3"


def implementations(x: Tensor, weight: Tensor, precision: str, gemm_choice: str,
                    traced: bool = False) -> dict[str, Callable[..., tuple]]:
    """Every way to run the op for operands like x and weight, by name, first the default; each takes
    the op's 17 leading arguments. Plain fp32 FMA ("ieee") is cuBLAS's alone, whatever gemm_choice
    says, and so are problems too large for the GEMM kernel's 32-bit offsets. TMA tile configs are
    offered where the operands allow descriptors. `traced`: only those that can run inside Inductor's
    graph (may be none; see _cublas_traceable)."""
    candidates = {}
    if gemm_choice in ("auto", "triton") and precision != "ieee" and _fits_int32_offsets(x, weight.shape[0]):
        precisions = [precision] + ([_pre_split_precision(x, weight)] if precision == "tf32x3" else [])
        # Traced, no TMA configs: torch does not capture TMA descriptors when it traces a wrap_triton
        # launch outside Dynamo ("not yet supported", torch 2.13's triton_kernel_wrap.py), and the
        # operands' addresses (so their alignment) are not known yet.
        tma = not traced and gemm.tma_usable(x, weight)
        for p in precisions:
            for config in gemm.gemm_configs(p, x.dtype):
                if tma or not config.tma:
                    candidates[f"triton {p} {config.describe()}"] = functools.partial(
                        gemm_batch_norm, precision=p, config=config)
    if (gemm_choice in ("auto", "cublas") or not candidates) and (not traced or _cublas_traceable(precision)):
        candidates["cublas"] = functools.partial(cublas_batch_norm, precision=precision)
    return candidates


def _pre_split_precision(x: Tensor, weight: Tensor) -> str:
    """3xTF32 with the smaller operand split into tf32 hi + lo in memory, once per call (splitting the
    other, larger one cost up to 13% of the GEMM: 0.20 ms for W at 1024 x 8192 -> 8192 on an H200)."""
    return "split_x" if x.numel() < weight.numel() else "split_w"


def _cublas_traceable(precision: str) -> bool:
    """A traced F.linear becomes Inductor's matmul, which follows torch's global TF32 flag when it runs:
    right only where that flag already gives the precision asked for."""
    return precision == "native" or torch.backends.cuda.matmul.allow_tf32 == (precision == "tf32")


def _fits_int32_offsets(x: Tensor, n_features: int) -> bool:
    """The GEMM kernel computes element offsets in int32."""
    limit = 2**31 - 1
    return x.numel() <= limit and x.shape[0] * n_features <= limit and x.shape[1] * n_features <= limit


def choose_implementation(args: tuple, precision: str, gemm_choice: str,
                          traced: bool = False) -> Optional[Callable[..., tuple]]:
    """The implementation for these arguments: from a per-process table (this runs on every call),
    else from the tuner (timing, or its disk cache). `traced`: args are fake (the op is being traced
    for Inductor); candidates are timed on random stand-ins of the same shapes, and there may be none."""
    problem = Problem.of(args, precision, gemm_choice, traced)
    chosen = _CHOSEN.get(problem, _NOT_CHOSEN)
    if chosen is not _NOT_CHOSEN:
        return chosen
    x, weight = args[0], args[1]
    candidates = implementations(x, weight, precision, gemm_choice, traced)
    chosen = None
    if candidates:
        # Traced, the candidates run for real, on stand-ins made once (only if one must be timed).
        make_args = functools.cache(lambda: _stand_ins(args)) if traced else (lambda: args)
        with real_tensors() if traced else contextlib.nullcontext():
            name = TUNER.choose(problem.describe(), x.device,
                                {name: functools.partial(_call_on, run, make_args) for name, run in candidates.items()})
        chosen = candidates[name]
    if not capturing(x.device):  # a choice made during a CUDA graph capture was not timed
        _CHOSEN[problem] = chosen
    return chosen


def _call_on(run: Callable[..., tuple], make_args: Callable[[], tuple]) -> tuple:
    return run(*make_args())


# Argument positions whose stand-ins need particular values.
RUNNING_VAR = 8


def _stand_ins(args: tuple) -> tuple:
    """Real tensors shaped like args' (fake) ones, with values of the kind they hold, for timing."""
    def real(position: int, value):
        if not isinstance(value, Tensor):
            return value
        t = torch.randn(tuple(value.shape), dtype=value.dtype, device=value.device)
        return t.abs() + 0.5 if position == RUNNING_VAR else t
    return tuple(real(i, a) for i, a in enumerate(args))


def _static_shapes(args: tuple) -> bool:
    return all(isinstance(size, int) for a in args if isinstance(a, Tensor) for size in a.shape)


class Problem(NamedTuple):
    """What the choice of implementation depends on: the per-process table's key, and (described)
    the tuner's."""
    n: int
    k: int
    f: int
    dtype: torch.dtype
    device: torch.device
    precision: str
    gemm_choice: str
    training: bool
    softmax: bool
    keep_linear: bool
    out_dtype: torch.dtype
    has_bias: bool
    scale_modes: tuple[int, int]
    affine: tuple[bool, bool]
    running: bool
    traced: bool

    @classmethod
    def of(cls, args: tuple, precision: str, gemm_choice: str, traced: bool = False) -> "Problem":
        (x, weight, bias, scale, _sv, bn_weight, bn_bias, running_mean, _rv, training, _m, _e, out_dtype,
         keep_linear, scale_after, _sav, softmax) = args
        return cls(x.shape[0], x.shape[1], weight.shape[0], x.dtype, x.device, precision, gemm_choice, training,
                   softmax, keep_linear, out_dtype, bias is not None, (scale_mode(scale), scale_mode(scale_after)),
                   (bn_weight is not None, bn_bias is not None), running_mean is not None, traced)

    def describe(self) -> str:
        """The tuner's key (the device is in the tuner's own part of it)."""
        return (f"{OP_NAME} {self.n}x{self.k}->{self.f} {self.dtype} {self.precision} gemm={self.gemm_choice} "
                f"train={self.training} softmax={self.softmax} keep={self.keep_linear} out={self.out_dtype} "
                f"bias={self.has_bias} scale={self.scale_modes[0]},{self.scale_modes[1]} "
                f"affine={self.affine[0]},{self.affine[1]} running={self.running}" + (" traced" if self.traced else ""))


_CHOSEN: dict[Problem, Optional[Callable[..., tuple]]] = {}
_NOT_CHOSEN = object()


# --------------------------------------------------------------------------- op registration


@torch.library.triton_op(OP_NAME, mutates_args=())
def linear_scale_batch_norm(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    scale: Optional[Tensor],
    scale_value: float,
    bn_weight: Optional[Tensor],
    bn_bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    training: bool,
    momentum: float,
    eps: float,
    out_dtype: torch.dtype,
    keep_linear: bool,
    scale_after: Optional[Tensor],
    scale_after_value: float,
    softmax: bool,
    fp32_matmul: str,
    gemm_choice: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (out, new_running_mean, new_running_var, linear_out, mean, invstd).

    new_running_* are empty unless training with running statistics; linear_out (kept for the
    backward) is empty unless keep_linear. fp32_matmul: "tf32x3" or "ieee" (see matmul_precision);
    gemm_choice: "auto" (time both), "triton" or "cublas". Both only steer the CUDA implementation.

    A triton_op: torch.compile traces this body, so Inductor launches its kernels from the compiled
    graph. Where that cannot be done (not CUDA, symbolic shapes, no traceable implementation) the body
    calls the opaque op, which chooses and launches at run time.
    """
    _check_choices(fp32_matmul, gemm_choice)
    args = (x, weight, bias, scale, scale_value, bn_weight, bn_bias, running_mean, running_var,
            training, momentum, eps, out_dtype, keep_linear, scale_after, scale_after_value, softmax)
    run = None
    if x.device.type == "cuda" and not os.environ.get(OPAQUE_ENV):
        check_batch_size(training, x)
        traced = is_fake(x)
        if not traced or _static_shapes(args):
            run = choose_implementation(args, *_cuda_choices(x, weight, fp32_matmul, gemm_choice), traced=traced)
    if run is None:
        return torch.ops.fusepass.linear_scale_batch_norm_opaque(*args, fp32_matmul, gemm_choice)
    return run(*args)


def _check_choices(fp32_matmul: str, gemm_choice: str) -> None:
    if fp32_matmul not in FP32_MATMUL:
        raise ValueError(f"fp32_matmul must be one of {FP32_MATMUL}, got {fp32_matmul!r}")
    if gemm_choice not in GEMM_CHOICES:
        raise ValueError(f"gemm must be one of {GEMM_CHOICES}, got {gemm_choice!r}")


TRITON_GEMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cuda_choices(x: Tensor, weight: Tensor, fp32_matmul: str, gemm_choice: str) -> tuple[str, str]:
    """(GEMM precision, gemm choice) for a CUDA call: dtypes the Triton GEMM lacks go to cuBLAS."""
    if x.dtype not in TRITON_GEMM_DTYPES or weight.dtype != x.dtype:
        gemm_choice = "cublas"
    return matmul_precision(x.dtype, fp32_matmul), gemm_choice


def _opaque_default(*op_args) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The op as one call that torch.compile does not look into: the plain-PyTorch reference on CPU
    (and other devices); on CUDA, the implementation chosen for the real arguments when it runs."""
    *args, fp32_matmul, gemm_choice = op_args
    _check_choices(fp32_matmul, gemm_choice)
    return reference(*args)


# The same arguments as the traced op, under its own name.
_opaque = torch.library.custom_op(
    OP_NAME + "_opaque", _opaque_default, mutates_args=(),
    schema=str(linear_scale_batch_norm._opoverload._schema).removeprefix(OP_NAME))


@_opaque.register_kernel("cuda")
def _opaque_cuda(x, weight, bias, scale, scale_value, bn_weight, bn_bias, running_mean, running_var,
                 training, momentum, eps, out_dtype, keep_linear, scale_after, scale_after_value, softmax,
                 fp32_matmul, gemm_choice):
    _check_choices(fp32_matmul, gemm_choice)
    check_batch_size(training, x)
    args = (x, weight, bias, scale, scale_value, bn_weight, bn_bias, running_mean, running_var,
            training, momentum, eps, out_dtype, keep_linear, scale_after, scale_after_value, softmax)
    return choose_implementation(args, *_cuda_choices(x, weight, fp32_matmul, gemm_choice))(*args)


@_opaque.register_fake
def _fake(x, weight, bias, scale, scale_value, bn_weight, bn_bias, running_mean, running_var,
          training, momentum, eps, out_dtype, keep_linear, scale_after, scale_after_value, softmax,
          fp32_matmul, gemm_choice):
    _check_choices(fp32_matmul, gemm_choice)
    check_batch_size(training, x)
    n, f = x.shape[0], weight.shape[0]
    stats_dtype = running_mean.dtype if running_mean is not None else torch.float32
    return (
        x.new_empty((n, f), dtype=out_dtype),
        x.new_empty(_new_running_stat_shape(training, running_mean), dtype=stats_dtype),
        x.new_empty(_new_running_stat_shape(training, running_var), dtype=stats_dtype),
        x.new_empty((n, f) if keep_linear else (0,)),
        x.new_empty((f,), dtype=torch.float32),
        x.new_empty((f,), dtype=torch.float32),
    )


# --------------------------------------------------------------------------- autograd
# Argument positions, for ctx.needs_input_grad.
X, WEIGHT, BIAS, SCALE, BN_WEIGHT, BN_BIAS, SCALE_AFTER = 0, 1, 2, 3, 5, 6, 14


def _setup_context(ctx, inputs, output):
    (x, weight, bias, scale, scale_value, bn_weight, bn_bias, _rm, _rv,
     training, _momentum, eps, _out_dtype, keep_linear, scale_after, scale_after_value, softmax,
     _fp32_matmul, _gemm_choice) = inputs
    out, new_mean, new_var, linear_out, mean, invstd = output
    ctx.mark_non_differentiable(new_mean, new_var, linear_out, mean, invstd)
    ctx.save_for_backward(x, weight, scale, bn_weight, bn_bias, scale_after, linear_out, mean, invstd,
                          out if softmax else None)
    ctx.training, ctx.eps, ctx.keep_linear, ctx.softmax = training, eps, keep_linear, softmax
    ctx.scale_value, ctx.scale_after_value = scale_value, scale_after_value
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, grad_out, *_grads_of_non_differentiable_outputs):
    x, weight, scale, bn_weight, bn_bias, scale_after, linear_out, mean, invstd, out = ctx.saved_tensors
    if not ctx.keep_linear:
        raise RuntimeError("fusepass.linear_scale_batch_norm was called with keep_linear=False; no backward")
    need = ctx.needs_input_grad
    y = linear_out.float()
    s1 = _as_factor(scale, ctx.scale_value)
    x_hat = (y * s1 - mean) * invstd
    g = grad_out.float()
    if ctx.softmax:  # through softmax: p * (g - sum(g * p))
        p = out.float()
        g = p * (g - (g * p).sum(1, keepdim=True))
    grad_scale_after = None
    if need[SCALE_AFTER] and scale_after is not None:
        bn_out = _affine(x_hat, bn_weight, bn_bias)
        if ctx.softmax and scale_after.numel() == 1:
            # Each row of the softmax gradient sums to exactly 0, so a one-element scale's gradient is a
            # covariance under p: centring bn_out per row removes the rounding of that 0 from the sum.
            bn_out = bn_out - (p * bn_out).sum(1, keepdim=True)
        grad_scale_after = _reduce_to(g * bn_out, scale_after)
    g = g * _as_factor(scale_after, ctx.scale_after_value)  # now the gradient w.r.t. the batch_norm output

    g_hat = g * bn_weight.float() if bn_weight is not None else g
    sum_g_xhat = (g_hat * x_hat).sum(0)
    if ctx.training:  # batch statistics depend on z: project out the mean and the x_hat component
        grad_z = (g_hat - g_hat.mean(0) - x_hat * (sum_g_xhat / g.shape[0])) * invstd
    else:
        grad_z = g_hat * invstd
    grad_y = (grad_z * s1).to(linear_out.dtype)

    grad_x = grad_y @ weight if need[X] else None
    grad_w = grad_y.t() @ x if need[WEIGHT] else None
    grad_b = _linear_bias_grad(ctx, grad_y) if need[BIAS] else None
    grad_scale = _scale_grad(ctx, scale, s1, grad_z, y, g_hat, sum_g_xhat, invstd) if need[SCALE] else None
    grad_gamma = (g * x_hat).sum(0).to(bn_weight.dtype) if need[BN_WEIGHT] else None
    grad_beta = g.sum(0).to(bn_bias.dtype) if need[BN_BIAS] else None
    return (grad_x, grad_w, grad_b, grad_scale, None, grad_gamma, grad_beta,
            None, None, None, None, None, None, None, grad_scale_after, None, None, None, None)


def _linear_bias_grad(ctx, grad_y):
    if ctx.training:
        # Batch normalization subtracts the batch mean, so a bias shift has no effect at all: the
        # gradient is exactly zero (eager's column sum of grad_y returns only rounding noise).
        return grad_y.new_zeros(grad_y.shape[1], dtype=ctx.bias_dtype)
    return grad_y.float().sum(0).to(ctx.bias_dtype)


def _scale_grad(ctx, scale, s, grad_z, y, g_hat, sum_g_xhat, invstd):
    if not ctx.training:
        return _reduce_to((grad_z * y).sum(0), scale)
    # Scaling a feature changes its normalized value only through eps, so the direct sum(grad_z * y)
    # cancels almost completely. Its exact value, sum(g_hat * x_hat) * eps * invstd^2 / s, does not
    # (derivation: sum(grad_z) = sum(x_hat) = 0 and mean(x_hat^2) = var * invstd^2).
    closed_form = sum_g_xhat * ctx.eps * invstd * invstd / s
    # At s == 0, x_hat is 0 and the gradient is invstd * sum((g_hat - mean(g_hat)) * y): the co-moment of
    # g_hat and y. It is taken from column sums of the same kind as sum_g_xhat, which the compiled
    # backward makes in the same reduction (the direct form needs a second pass over an (N, F) grad_z):
    # in float64, where products of fp32 values are exact, and shifted by the first row, so that a
    # constant g_hat gives exactly 0.
    g64, y64 = g_hat.double(), y.double()
    dg, dy = g64 - g64[:1], y64 - y64[:1]
    co_moment = ((dg * dy).sum(0) - dg.sum(0) * (dy.sum(0) / y.shape[0])).float()
    return _reduce_to(torch.where(s != 0, closed_form, invstd * co_moment), scale)


def _reduce_to(grad: Tensor, scale: Tensor) -> Tensor:
    """Sums a broadcast gradient down to the scale's shape. A one-element scale sums everything:
    that single reduction accumulates in float64, cheaply and as exactly as it can."""
    if scale.numel() == 1:
        return grad.double().sum().reshape(scale.shape).to(scale.dtype)
    return grad.sum_to_size(scale.shape).to(scale.dtype)


linear_scale_batch_norm.register_autograd(_backward, setup_context=_setup_context)
