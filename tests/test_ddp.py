"""DistributedDataParallel on CPU: two processes on gloo (tests/distributed/workers.py runs each rank)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed import workers

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def spawn(fn, tmp_path, *args, world_size: int = 2) -> None:
    mp.spawn(fn, args=(world_size, str(tmp_path / "init"), *args), nprocs=world_size)


@pytest.mark.parametrize("optimize_ddp", ["ddp_optimizer", "python_reducer", "no_optimization"])
def test_ddp_fuses_every_chain(optimize_ddp, tmp_path):
    """Under DDPOptimizer a bucket cut would fall inside the second chain; fusepass keeps it whole."""
    spawn(workers.ddp_chains, tmp_path, optimize_ddp)


def test_without_fusepass_the_bucket_cut_falls_inside_a_chain(tmp_path):
    spawn(workers.ddp_cut_without_grouping, tmp_path)


def test_sync_batch_norm_chains_fuse_and_match_batch_norm_over_the_global_batch(tmp_path):
    spawn(workers.sync_batch_norm_chains, tmp_path)


def test_lone_sync_batch_norm_runs_its_own_op_and_keeps_eagers_errors(tmp_path):
    spawn(workers.lone_sync_batch_norm, tmp_path)
