"""torch.distributed: DDP and SyncBatchNorm chains, each test two processes (tests/distributed/workers.py
runs each rank): on CPU with gloo, and on two GPUs with NCCL where the machine has them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed import workers

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                              reason="needs 2 GPUs and NCCL")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, TWO_GPUS])]


def spawn(fn, tmp_path, *args, world_size: int = 2) -> None:
    mp.spawn(fn, args=(world_size, str(tmp_path / "init"), *args), nprocs=world_size)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_ddp_fuses_every_chain(device, tmp_path):
    """Under DDPOptimizer a bucket cut would fall inside the second chain; fusepass keeps it whole. Also
    under compiled autograd (python_reducer) and without DDP's graph splitting; one spawn runs all three."""
    spawn(workers.ddp_chains, tmp_path, device, ["ddp_optimizer", "python_reducer", "no_optimization"])


def test_without_fusepass_the_bucket_cut_falls_inside_a_chain(tmp_path):
    spawn(workers.ddp_cut_without_grouping, tmp_path)


# Ranks' batch sizes: uneven, and one rank without rows (its statistics must not enter the merge)
ROWS_PER_RANK = [(20, 13), (33, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_sync_batch_norm_chains_fuse_and_match_batch_norm_over_the_global_batch(device, tmp_path):
    """In fp32 and under bf16 autocast, for each split of the batch (one spawn runs every case)."""
    cases = [(autocast, rows) for autocast in (False, True) for rows in ROWS_PER_RANK]
    spawn(workers.sync_batch_norm_chains, tmp_path, device, cases)


@pytest.mark.slow
def test_sync_batch_norm_synchronizes_within_its_process_group(tmp_path):
    spawn(workers.sync_batch_norm_in_subgroups, tmp_path, world_size=4)


@pytest.mark.parametrize("joins_a_group", [True, False], ids=["world-size-1", "no-process-group"])
def test_sync_batch_norm_without_peers_is_a_batch_norm_chain(joins_a_group, tmp_path):
    spawn(workers.sync_batch_norm_without_peers, tmp_path, joins_a_group, world_size=1)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_lone_sync_batch_norm_runs_its_own_op_and_keeps_eagers_errors(device, tmp_path):
    """fp32 and float64, for each split of the batch; BatchNorm2d input (statistics per channel over the
    batch and the space). One spawn runs every case."""
    cases = [(dtype, rows, ()) for dtype in (torch.float32, torch.float64) for rows in ROWS_PER_RANK]
    spawn(workers.lone_sync_batch_norm, tmp_path, device, cases + [(torch.float32, (20, 13), (5, 6))])


@pytest.mark.parametrize("device", DEVICES)
def test_one_collective_per_sync_batch_norm_chain_each_way(device, tmp_path):
    spawn(workers.collective_counts, tmp_path, device)
