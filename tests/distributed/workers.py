"""What each spawned rank runs in tests/test_ddp.py (a module of its own: spawned processes import it)."""

from __future__ import annotations

import copy
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.chains import Trio, assert_fused, assert_no_further_from_float64, make_input, randomize_batch_norm

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


class SyncChains(nn.Module):
    """[Linear -> * s -> BatchNorm1d -> ReLU] -> [Linear -> BatchNorm1d -> GELU -> softmax] -> Linear, then
    BatchNorm1d -> SyncBatchNorm by the user's convert_sync_batchnorm."""

    def __init__(self):
        super().__init__()
        self.l1, self.bn1, self.s = nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Parameter(torch.rand(HIDDEN) + 0.5)
        self.l2, self.bn2 = nn.Linear(HIDDEN, 64), nn.BatchNorm1d(64)
        self.l3 = nn.Linear(64, 7)
        for bn in (self.bn1, self.bn2):
            randomize_batch_norm(bn)

    def forward(self, x):
        x = torch.relu(self.bn1(self.l1(x) * self.s))
        x = torch.softmax(F.gelu(self.bn2(self.l2(x))), dim=1)
        return self.l3(x)


ROWS_PER_RANK = (20, 13)  # uneven: ranks may hold different batch sizes


def sync_batch_norm_chains(rank: int, world_size: int, init_file: str) -> None:
    """SyncBatchNorm chains compiled with fusepass, against one process's BatchNorm1d model on the global
    batch (what SyncBatchNorm computes): each rank's rows of the output, the running statistics and the
    gradients (summed over the ranks here: DDP refuses SyncBatchNorm on CPU, and its average is this sum
    over the world size), by the float64 criterion with the single-process fp32 model as eager. Three
    training steps, then an eval step (plain batch norm with the running statistics)."""
    _init(rank, world_size, init_file)
    try:
        torch.manual_seed(0)
        model = SyncChains()
        eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()  # single process, global batch
        fused = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
        compiled = torch.compile(fused, backend="fusepass")
        counters["fusepass"].clear()
        first = sum(ROWS_PER_RANK[:rank])
        rows = slice(first, first + ROWS_PER_RANK[rank])
        for step in range(4):
            training = step < 3
            for m in (eager, ref, fused):
                m.train(training)
            torch.manual_seed(1000 + step)  # the same global batch and upstream gradient on every rank
            x = make_input(sum(ROWS_PER_RANK), IN)
            projection = torch.randn(x.shape[0], 7, dtype=torch.float64)
            outs = {}
            for name, fn, dtype, x_in in (("eager", eager, torch.float32, x), ("ref", ref, torch.float64, x),
                                          ("fused", compiled, torch.float32, x[rows])):
                out = fn(x_in.to(dtype))
                if training:
                    (out.double() * projection[rows if name == "fused" else slice(None)]).sum().backward()
                outs[name] = out
            assert_no_further_from_float64("output", outs["fused"], outs["eager"][rows], outs["ref"][rows])
            if training:
                _compare_synced_state(fused, eager, ref)
        assert_fused(rewrites=4, graphs=2, linears=2)  # two chains in a training graph and in an eval graph
    finally:
        dist.destroy_process_group()


def _compare_synced_state(fused: nn.Module, eager: nn.Module, ref: nn.Module) -> None:
    for (name, p_fused), (_, p_eager), (_, p_ref) in zip(fused.named_parameters(), eager.named_parameters(),
                                                         ref.named_parameters()):
        dist.all_reduce(p_fused.grad)
        assert_no_further_from_float64(f"grad {name}", p_fused.grad, p_eager.grad, p_ref.grad)
    for (name, b_fused), (_, b_eager), (_, b_ref) in zip(fused.named_buffers(), eager.named_buffers(),
                                                         ref.named_buffers()):
        if b_fused.is_floating_point():
            assert_no_further_from_float64(f"buffer {name}", b_fused, b_eager, b_ref)
        else:
            assert torch.equal(b_fused, b_eager), f"buffer {name}"
    for m in (fused, eager, ref):
        m.zero_grad(set_to_none=True)


def lone_sync_batch_norm(rank: int, world_size: int, init_file: str) -> None:
    """A SyncBatchNorm that heads no chain (its input is the model's): torch.ops.fusepass.sync_batch_norm,
    forward and backward (the input's gradient too), against BatchNorm1d on the global batch; and eager's
    error for input of the wrong dimension."""
    _init(rank, world_size, init_file)
    try:
        torch.manual_seed(0)  # the same model on every rank
        model = nn.Sequential(nn.BatchNorm1d(12), nn.Tanh())
        randomize_batch_norm(model[0])
        eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
        fused = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
        compiled = torch.compile(fused, backend="fusepass")
        first = sum(ROWS_PER_RANK[:rank])
        rows = slice(first, first + ROWS_PER_RANK[rank])
        torch.manual_seed(7)
        x = make_input(sum(ROWS_PER_RANK), 12)
        projection = torch.randn(x.shape[0], 12, dtype=torch.float64)
        inputs, outs = {}, {}
        for name, fn, dtype, part in (("eager", eager, torch.float32, slice(None)),
                                      ("ref", ref, torch.float64, slice(None)), ("fused", compiled, torch.float32, rows)):
            inputs[name] = x[part].to(dtype).requires_grad_()
            outs[name] = fn(inputs[name])
            (outs[name].double() * projection[part]).sum().backward()
        assert_no_further_from_float64("output", outs["fused"], outs["eager"][rows], outs["ref"][rows])
        assert_no_further_from_float64("grad x", inputs["fused"].grad, inputs["eager"].grad[rows],
                                       inputs["ref"].grad[rows])
        _compare_synced_state(fused, eager, ref)
        assert counters["fusepass"]["rewrites"] == 0  # no chain: the op of a lone SyncBatchNorm
        try:
            compiled(torch.randn(5))
        except ValueError as exc:
            assert "expected at least 2D input (got 1D input)" in str(exc), exc  # eager's message
        else:
            raise AssertionError("a 1-D input must raise eager's ValueError")
    finally:
        dist.destroy_process_group()
