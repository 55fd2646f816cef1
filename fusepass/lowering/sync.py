"""SyncBatchNorm's statistics across ranks: one collective in the forward, one in the backward.

Forward: each rank's per-feature (count, mean, M2) are all-gathered over the module's process group in
one collective and merged count-weighted with Chan's formula (never E[z^2] - E[z]^2), as
`batch_norm_gather_stats_with_counts` merges them in eager. Backward: one SUM all-reduce carries the
per-feature sums of g_hat and g_hat * x_hat with the rank's row count, as SyncBatchNorm's backward does.

The collectives are torch's functional collectives: traced into the compiled graph where the fused
op's body is traced, run eagerly where it is not. Ranks may hold different batch sizes, or no rows.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and narrower inputs, float64 for float64 (as eager's batch-norm statistics)."""
    return torch.promote_types(dtype, torch.float32)


def moments(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(count, mean, M2) per feature of an (N, F) tensor, in its accumulation dtype: count a (1,) tensor.
    A rank without rows contributes (0, 0, 0), which the count-weighted merge ignores (eager SyncBatchNorm
    drops such ranks' statistics)."""
    z = z.to(accumulation_dtype(z.dtype))
    mean = z.sum(0) / max(z.shape[0], 1)
    return z.new_full((1,), z.shape[0]), mean, ((z - mean) ** 2).sum(0)


def merge_strips(part_mean: Tensor, part_m2: Tensor, rows_per_part: int, n_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """(count, mean, M2) of the whole batch from its row strips' (mean, M2) (Partials, normalize.py)."""
    n_parts = part_mean.shape[0]
    if n_parts == 0:  # a rank without rows
        zeros = part_mean.new_zeros(part_mean.shape[1])
        return part_mean.new_zeros(1), zeros, zeros
    # Every strip holds rows_per_part rows but the last; from the row count as a tensor op, so that a
    # symbolic batch is not specialized.
    first_rows = torch.arange(n_parts, device=part_mean.device) * rows_per_part
    counts = (n_rows - first_rows).clamp(max=rows_per_part).to(part_mean.dtype)[:, None]
    return _chan(counts, part_mean, part_m2)


def merge_across_ranks(count: Tensor, mean: Tensor, m2: Tensor, group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    """Every rank's (count, mean, M2) merged into the global batch's (count, mean, biased variance): one
    all-gather of a (2F + 1,) vector per rank."""
    n_features = mean.shape[0]
    dtype = accumulation_dtype(mean.dtype)
    local = torch.cat([count.to(dtype), mean.to(dtype), m2.to(dtype)])
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(local, 0, group_name)).view(-1, 2 * n_features + 1)
    counts, means, m2s = gathered[:, :1], gathered[:, 1:n_features + 1], gathered[:, n_features + 1:]
    count, mean, m2 = _chan(counts, means, m2s)
    return count, mean, m2 / count


def _chan(counts: Tensor, means: Tensor, m2s: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Chan et al.'s parallel merge of k groups at once: M2 = sum M2_i + sum n_i (mean_i - mean)^2."""
    count = counts.sum(0)
    mean = (counts * means).sum(0) / count
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return count, mean, m2


def all_reduce_sums(sum_g: Tensor, sum_g_xhat: Tensor, n_rows: int, group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    """The backward's one collective: (sum g, sum g * x_hat, row count) summed over the ranks."""
    n_features = sum_g.shape[0]
    dtype = accumulation_dtype(sum_g.dtype)
    local = torch.cat([sum_g.to(dtype), sum_g_xhat.to(dtype), sum_g.new_full((1,), float(n_rows), dtype=dtype)])
    total = funcol.wait_tensor(funcol.all_reduce(local, "sum", group_name))
    return total[:n_features], total[n_features:2 * n_features], total[2 * n_features:]
