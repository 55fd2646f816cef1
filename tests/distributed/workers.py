"""What each spawned rank runs in tests/test_ddp.py (a module of its own: spawned processes import it)."""

from __future__ import annotations

import copy
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.chains import Trio, assert_fused, make_input, randomize_batch_norm

# DDP's first gradient bucket holds 1 MiB: walking the graph backwards, the last Linear (1024 -> 255,
# 1045500 bytes) and the second batch norm's weight and bias (8192) fill it, so without fusepass's
# grouping DDPOptimizer cuts the second chain between its scale and its batch norm.
IN, HIDDEN, WIDE, OUT = 96, 128, 1024, 255


class TwoChainsAndALinear(nn.Module):
    """2 x [Linear -> * 0.5 -> BatchNorm1d -> ReLU], then a bare Linear."""

    def __init__(self):
        super().__init__()
        self.l1, self.bn1 = nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN)
        self.l2, self.bn2 = nn.Linear(HIDDEN, WIDE), nn.BatchNorm1d(WIDE)
        self.l3 = nn.Linear(WIDE, OUT)
        for bn in (self.bn1, self.bn2):
            randomize_batch_norm(bn)

    def forward(self, x):
        x = torch.relu(self.bn1(self.l1(x) * 0.5))
        x = torch.relu(self.bn2(self.l2(x) * 0.5))
        return self.l3(x)


def _init(rank: int, world_size: int, init_file: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def ddp_chains(rank: int, world_size: int, init_file: str, optimize_ddp: str) -> None:
    """DDP of TwoChainsAndALinear, eager / fusepass / float64, three training steps on each rank's own
    batch (33 rows, odd): outputs, gradients (averaged by DDP) and buffers by the float64 criterion, and
    fusepass's counts."""
    _init(rank, world_size, init_file)
    try:
        torch._dynamo.config.optimize_ddp = optimize_ddp
        torch.manual_seed(0)  # the same model on every rank (DDP also broadcasts rank 0's)
        model = TwoChainsAndALinear()
        wrap = lambda m: DDP(m, bucket_cap_mb=1)  # noqa: E731
        fused = wrap(copy.deepcopy(model))
        compiled_autograd = optimize_ddp == "python_reducer"  # its backward graph holds DDP's all-reduces
        fused_backward = nullcontext
        if compiled_autograd:
            fused_backward = lambda: torch._dynamo.compiled_autograd._enable(  # noqa: E731
                torch.compile(backend="fusepass"))
        trio = Trio(wrap(copy.deepcopy(model)), fused, wrap(copy.deepcopy(model).double()),
                    torch.compile(fused, backend="fusepass"), zero_grads=("module.l1.bias", "module.l2.bias"),
                    fused_backward=fused_backward)
        counters["fusepass"].clear()
        torch.manual_seed(100 + rank)  # each rank its own batches
        for _ in range(3):
            trio.step(make_input(33, IN))
        trio.finish()
        # DDPOptimizer cuts the graph in two (between the chains, not in one). Under python_reducer, one
        # forward graph and compiled autograd's backward graph (fusepass's backward ops and DDP's
        # all_reduce / wait_tensor, nothing to fuse), which it compiled in the first and second step alike
        graphs = {"ddp_optimizer": 2, "python_reducer": 3, "no_optimization": 1}[optimize_ddp]
        assert_fused(rewrites=2, graphs=graphs, linears=1)
    finally:
        dist.destroy_process_group()


def ddp_cut_without_grouping(rank: int, world_size: int, init_file: str) -> None:
    """The control for ddp_chains: a backend of another name, under DDPOptimizer, gets the second chain
    cut between its scale and its batch norm (so ddp_chains tests what it says)."""
    _init(rank, world_size, init_file)
    try:
        pieces = []

        def record(gm, example_inputs):
            pieces.append([getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                           if n.op == "call_function"])
            return gm.forward

        torch.manual_seed(0)
        model = torch.compile(DDP(TwoChainsAndALinear(), bucket_cap_mb=1), backend=record)
        model(make_input(33, IN)).sum().backward()
        assert len(pieces) == 2, pieces
        assert pieces[0][-2:] == ["linear", "mul"], pieces  # the second chain's linear and scale ...
        assert pieces[1][:2] == ["batch_norm", "relu"], pieces  # ... cut off from its batch norm
    finally:
        dist.destroy_process_group()
