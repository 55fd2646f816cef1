"""Normalizing the GEMM's output, launched: a statistics pass after cuBLAS, an optional finalize launch,
and the output pass (normalize_kernels.py has the kernels and their STATS_SOURCE modes); the statistics
they work on, and how each is launched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
from torch import Tensor

from fusepass.lowering import pointwise, sync
from fusepass.lowering.launch import hint, launch, present_or_placeholder, unused_pointer
from fusepass.lowering.normalize_kernels import (STATS_MERGE, STATS_READ, STATS_RUNNING, finalize_stats_kernel,
                                            normalize_kernel, normalize_softmax_kernel, partial_stats_kernel)
from fusepass.lowering.reference import new_running_stat_shape, running_stats_dtype, updated_running_stats
from fusepass.lowering.schema import BatchNorm, ChainArgs, Scale, Tail
from fusepass.lowering.tiles import INTERPRETED

# --------------------------------------------------------------------------- launch configuration

# The statistics pass after a cuBLAS GEMM, in tiles of 128 rows: more loads in flight per program. H200,
# 4 warps, against 32-row tiles: 16384 x 4096 bf16 70 against 179 us, fp32 76 against 104; 4096 x 4096
# bf16 24 against 50; 1024 x 8192 fp32 17 against 20 (wider or taller tiles, 8 warps, 2 or 4 strips per
# SM: no faster at any of these).
STATS_BLOCK_R, STATS_BLOCK_C = 128, 64
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
    """Per strip of rows and per feature, the mean and M2 of z = y * s (strips of rows_per_part rows): one
    flat buffer, the n_parts x F means, then the n_parts x F M2s, row-major (the kernels take it as one
    pointer). Flat, because n_parts follows the batch: a (n_parts, F) tensor's contiguity check guards on
    n_parts == 1 (torch 2.11), and the graph recompiled when a batch first spanned two strips."""
    stats: Tensor
    n_parts: int
    rows_per_part: int

    @staticmethod
    def allocate(n_parts: int, rows_per_part: int, n_cols: int, device) -> "Partials":
        return Partials(torch.empty(2 * n_parts * n_cols, device=device, dtype=torch.float32), n_parts, rows_per_part)

    def mean_and_m2(self, n_cols: int) -> tuple[Tensor, Tensor]:
        """The means and the M2s, each (n_parts, F), views of the buffer."""
        means, m2s = self.stats.view(2, self.n_parts, n_cols).unbind(0)
        return means, m2s


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
        parts = self.parts or Partials(placeholder, 0, 1)
        bn = self.batch_norm
        return (parts.stats, present_or_placeholder(bn.running_mean, placeholder),
                present_or_placeholder(bn.running_var, placeholder), self.mean, self.invstd, self.new_mean,
                self.new_var)

    def rows_per_part(self) -> int:
        """The strips' height (the kernels count the strips from it and the rows)."""
        return self.parts.rows_per_part if self.parts else 1

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
    parts = Partials.allocate(n_parts, rows_per_part, n_cols, y.device)
    launch(partial_stats_kernel)[(n_parts, triton.cdiv(n_cols, STATS_BLOCK_C))](
        y, present_or_placeholder(scale.tensor, unused_pointer(y.device)), parts.stats,
        n_rows, n_cols, rows_per_part,
        y.stride(0), y.stride(1),
        scale.value,
        SCALE_MODE=scale.mode, BLOCK_R=STATS_BLOCK_R, BLOCK_C=STATS_BLOCK_C,
    )
    return parts


def finalize_statistics(stats: Statistics, parts: Optional[Partials], n_rows: int) -> None:
    """Fills stats' mean/invstd (and new running statistics) from the strips' statistics (training) or
    from the running statistics (eval, parts None), for an output pass that reads them."""
    stats.parts = parts
    n_cols = stats.mean.shape[0]
    launch(finalize_stats_kernel)[(triton.cdiv(n_cols, FINALIZE_BLOCK_C),)](
        *stats.pointers(), n_rows, n_cols, stats.rows_per_part(), *stats.scalars(),
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


class OutputMeta(NamedTuple):
    """The output kernels' meta-parameters but the tail program, passed as one constexpr tuple (META) in
    this order, which the kernels unpack by position: with each a parameter of its own they would take
    33 and 34 arguments. Scalars only (gemm.GemmMeta says why); `accurate_exp` is the softmax kernel's."""
    scale_mode: int
    has_gamma: bool
    has_beta: bool
    stats_source: int
    update_running: bool
    block_r: int
    block_c: int
    accurate_exp: bool = True


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
        n_rows, n_cols, stats.rows_per_part(),
        y.stride(0), y.stride(1), out.stride(0), out.stride(1),
        s1.value, *stats.scalars(),
    )
    meta = OutputMeta(scale_mode=s1.mode, has_gamma=bn.weight is not None, has_beta=bn.bias is not None,
                      stats_source=stats.source,
                      update_running=stats.source == STATS_MERGE.value and bn.updates_running_stats,
                      block_r=NORM_BLOCK_R, block_c=NORM_BLOCK_C)
    tail = pointwise.tail_program(args.tail.program, args.tail.tensors)
    if args.softmax:
        meta = meta._replace(block_r=softmax_launch.block_r, block_c=softmax_launch.block_c(n_cols),
                             accurate_exp=not INTERPRETED)
        launch(normalize_softmax_kernel)[(triton.cdiv(n_rows, softmax_launch.block_r),)](
            *kernel_args, META=tuple(meta), TAIL=tail, num_warps=softmax_launch.warps(n_cols))
    else:
        launch(normalize_kernel)[(triton.cdiv(n_rows, NORM_BLOCK_R), triton.cdiv(n_cols, NORM_BLOCK_C))](
            *kernel_args, META=tuple(meta), TAIL=tail)
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
    elif not args.softmax and merges_in_output_pass(n_rows, n_cols, parts.n_parts, y.element_size(), False):
        stats.parts, stats.source = parts, STATS_MERGE.value
    else:
        finalize_statistics(stats, parts, n_rows)
    return output_pass(y, args, stats, out)


def synced_statistics(stats: Statistics, parts: Partials, n_rows: int) -> None:
    """SyncBatchNorm: fills stats from every rank's batch. The strips' statistics are merged into the
    rank's (count, mean, M2), one all-gather merges the ranks' (sync.py); (F,)-sized torch ops, which
    Inductor fuses where the op's body is traced."""
    bn = stats.batch_norm
    n_cols = stats.mean.shape[0]
    strips = sync.merge_strips(*parts.mean_and_m2(n_cols), parts.rows_per_part, n_rows)
    count, mean, var = sync.merge_across_ranks(*strips, bn.group_name)
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
