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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimize_ddp", ["ddp_optimizer", "python_reducer", "no_optimization"])
def test_ddp_fuses_every_chain(optimize_ddp, device, tmp_path):
    """Under DDPOptimizer a bucket cut would fall inside the second chain; fusepass keeps it whole."""
    spawn(workers.ddp_chains, tmp_path, optimize_ddp, device)


def test_without_fusepass_the_bucket_cut_falls_inside_a_chain(tmp_path):
    spawn(workers.ddp_cut_without_grouping, tmp_path)


# Ranks' batch sizes: uneven, and one rank without rows (its statistics must not enter the merge)
ROWS = pytest.mark.parametrize("rows_per_rank", [(20, 13), (33, 0)], ids=["uneven", "a-rank-without-rows"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@ROWS
def test_sync_batch_norm_chains_fuse_and_match_batch_norm_over_the_global_batch(rows_per_rank, autocast, device,
                                                                                 tmp_path):
    spawn(workers.sync_batch_norm_chains, tmp_path, device, autocast, rows_per_rank)


def test_sync_batch_norm_synchronizes_within_its_process_group(tmp_path):
    spawn(workers.sync_batch_norm_in_subgroups, tmp_path, world_size=4)


@pytest.mark.parametrize("joins_a_group", [True, False], ids=["world-size-1", "no-process-group"])
def test_sync_batch_norm_without_peers_is_a_batch_norm_chain(joins_a_group, tmp_path):
    spawn(workers.sync_batch_norm_without_peers, tmp_path, joins_a_group, world_size=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@ROWS
def test_lone_sync_batch_norm_runs_its_own_op_and_keeps_eagers_errors(rows_per_rank, dtype, device, tmp_path):
    spawn(workers.lone_sync_batch_norm, tmp_path, device, dtype, rows_per_rank)


@pytest.mark.parametrize("device", DEVICES)
def test_lone_sync_batch_norm_of_n_d_input_normalizes_each_channel_over_batch_and_space(device, tmp_path):
    spawn(workers.lone_sync_batch_norm, tmp_path, device, torch.float32, (20, 13), (5, 6))


@pytest.mark.parametrize("device", DEVICES)
def test_one_collective_per_sync_batch_norm_chain_each_way(device, tmp_path):
    spawn(workers.collective_counts, tmp_path, device)
