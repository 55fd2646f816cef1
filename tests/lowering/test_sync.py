"""SyncBatchNorm's statistics math (lowering/sync.py) on one process: the strip merge that turns a GEMM
epilogue's per-strip (mean, M2) into the rank's (count, mean, M2), and the moments of a rank's rows."""

import pytest
import torch

from fusepass.lowering import sync


@pytest.mark.parametrize("n_rows, rows_per_part", [(37, 8), (32, 8), (5, 16)],
                         ids=["uneven-last-strip", "even", "one-strip"])
def test_strips_merge_to_the_batch_statistics(n_rows, rows_per_part):
    z = torch.randn(n_rows, 19, dtype=torch.float64) * 3 + 5
    strips = z.split(rows_per_part)
    part_mean = torch.stack([s.mean(0) for s in strips])
    part_m2 = torch.stack([((s - s.mean(0)) ** 2).sum(0) for s in strips])
    count, mean, m2 = sync.merge_strips(part_mean.float(), part_m2.float(), rows_per_part, n_rows)
    assert count.item() == n_rows
    torch.testing.assert_close(mean.double(), z.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m2.double(), ((z - z.mean(0)) ** 2).sum(0), rtol=1e-5, atol=1e-5)


def test_a_rank_without_rows_contributes_nothing():
    """No strips (a GEMM over 0 rows) and no rows both give (0, 0, 0), which the count-weighted merge
    ignores: eager SyncBatchNorm drops an empty rank's statistics."""
    empty = torch.empty(0, 6)
    for count, mean, m2 in (sync.merge_strips(empty, empty, 64, 0), sync.moments(empty)):
        assert count.item() == 0 and torch.count_nonzero(mean) == 0 and torch.count_nonzero(m2) == 0
    z = torch.randn(11, 6)
    own = sync.moments(z)
    merged = sync._chan(*(torch.stack([a, b]) for a, b in zip(own, sync.moments(empty))))
    for got, want in zip(merged, own):  # (11 * mean) / 11 may round: not bit-exact
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_moments_accumulate_in_fp32_at_least_and_keep_float64():
    for dtype, acc in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.float64, torch.float64)):
        count, mean, m2 = sync.moments(torch.randn(9, 4).to(dtype))
        assert (count.dtype, mean.dtype, m2.dtype) == (acc, acc, acc)
