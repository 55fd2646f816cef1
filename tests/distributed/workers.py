"""What each spawned rank runs in tests/test_ddp.py (a module of its own: spawned processes import it)."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
import traceback
from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

from fusepass import explain
from fusepass.numerics import rel_error
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


@contextlib.contextmanager
def rank_group(rank: int, world_size: int, init_file: str, device: str = "cpu", join: bool = True):
    """A spawned rank's life: joins the group (gloo on CPU, NCCL on one GPU per rank; `join=False`: no
    group) and yields the rank's device. The rank then leaves with os._exit, from inside the worker,
    before anything it made is freed: freeing a DDP reducer destroys the gloo process group, whose
    destructor joins a worker thread that waits for the GIL the joining thread holds (a deadlock seen
    here with py-spy: ~ProcessGroupGloo in std::thread::join, its thread in gil_scoped_acquire). A
    failing check prints its traceback and exits 1, which torch.multiprocessing reports."""
    dev = _init(rank, world_size, init_file, device) if join else torch.device(device)
    try:
        yield dev
        if join:
            dist.barrier()  # every rank's collectives are done before any leaves
    except BaseException:
        traceback.print_exc()
        _leave(1)
    _leave(0)


@contextlib.contextmanager
def fresh_case(case: tuple):
    """One of the cases a spawn runs in turn (a spawn costs seconds of start-up): from a clean Dynamo and
    fusepass's counters at zero; a failing case is named in its traceback."""
    torch._dynamo.reset()
    counters["fusepass"].clear()
    try:
        yield
    except BaseException as exc:
        exc.add_note(f"in case {case}")
        raise


def _leave(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _init(rank: int, world_size: int, init_file: str, device: str = "cpu") -> torch.device:
    """Joins the group: gloo on CPU, NCCL on one GPU per rank. Returns the rank's device."""
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank))
        return torch.device("cuda", rank)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    return torch.device("cpu")


def ddp_chains(rank: int, world_size: int, init_file: str, device: str, modes: list) -> None:
    """DDP of TwoChainsAndALinear, eager / fusepass / float64, three training steps on each rank's own
    batch (odd sizes that change: the second step compiles a symbolic batch, which the third reuses):
    outputs, gradients (averaged by DDP) and buffers by the float64 criterion, and fusepass's counts;
    under each of Dynamo's `optimize_ddp` modes in turn."""
    with rank_group(rank, world_size, init_file, device) as dev:
        for optimize_ddp in modes:
            with fresh_case(optimize_ddp), torch._dynamo.config.patch(optimize_ddp=optimize_ddp):
                _ddp_chains(rank, dev, optimize_ddp)


def _ddp_chains(rank: int, dev: torch.device, optimize_ddp: str) -> None:
    torch.manual_seed(0)  # the same model on every rank (DDP also broadcasts rank 0's)
    model = TwoChainsAndALinear().to(dev)
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
    for rows in (33, 17, 41):
        trio.step(make_input(rows, IN, str(dev)))
    trio.finish()
    # Each piece twice, static then with a symbolic batch, each keeping its chains. DDPOptimizer cuts the
    # graph in two (between the chains, not in one). Under python_reducer, the forward graph twice and
    # compiled autograd's backward graph (fusepass's backward ops and DDP's all_reduce / wait_tensor,
    # nothing to fuse) three times: at each of the three sizes, after which it serves every size (five
    # sizes checked on CPU); Dynamo traces a backward twice (its first trace asks to start again,
    # TensorifyScalarRestartAnalysis), the backend compiles it once.
    # On two H200s compiled autograd's backward came to the backend as 22 graphs (graph breaks in it,
    # not investigated; the gradients are right): there the count is not pinned.
    graphs = {"ddp_optimizer": 4, "python_reducer": 5, "no_optimization": 2}[optimize_ddp]
    if compiled_autograd and dev.type == "cuda":
        graphs = None
    assert_fused(rewrites=4, graphs=graphs, linears=2)


def ddp_cut_without_grouping(rank: int, world_size: int, init_file: str) -> None:
    """The control for ddp_chains: a backend of another name, under DDPOptimizer, gets the second chain
    cut between its scale and its batch norm (so ddp_chains tests what it says)."""
    with rank_group(rank, world_size, init_file):
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


class SyncChains(nn.Module):
    """[Linear -> * s -> BatchNorm1d -> ReLU] -> [Linear -> BatchNorm1d -> GELU -> softmax] -> Linear, then
    BatchNorm1d -> SyncBatchNorm by the user's convert_sync_batchnorm."""

    BIASES_BEFORE_BATCH_NORM = ("l1.bias", "l2.bias")  # their training gradient is exactly 0

    def __init__(self):
        super().__init__()
        self.l1, self.bn1 = nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN)
        self.s = nn.Parameter(torch.rand(HIDDEN) + 0.5)
        self.l2, self.bn2 = nn.Linear(HIDDEN, 64), nn.BatchNorm1d(64)
        self.l3 = nn.Linear(64, 7)
        for bn in (self.bn1, self.bn2):
            randomize_batch_norm(bn)

    def forward(self, x):
        x = torch.relu(self.bn1(self.l1(x) * self.s))
        x = torch.softmax(F.gelu(self.bn2(self.l2(x))), dim=1)
        return self.l3(x)


ROWS_PER_RANK = (20, 13)  # uneven: ranks may hold different batch sizes


def sync_batch_norm_in_subgroups(rank: int, world_size: int, init_file: str) -> None:
    """convert_sync_batchnorm(process_group=...): four ranks in two groups of two, each group with its own
    global batch. Each rank's SyncBatchNorm chains synchronize within its group only: outputs, running
    statistics and gradients (summed over the group) against one process's float64 and fp32 models on
    that group's batch."""
    with rank_group(rank, world_size, init_file):
        groups = [dist.new_group(list(range(first, first + 2))) for first in range(0, world_size, 2)]
        mine, position = groups[rank // 2], rank % 2
        torch.manual_seed(0)
        model = SyncChains()
        eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
        fused = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), process_group=mine)
        compiled = torch.compile(fused, backend="fusepass")
        counters["fusepass"].clear()
        torch.manual_seed(10 + rank // 2)  # the group's batch and upstream gradient
        x = make_input(sum(ROWS_PER_RANK), IN)
        projection = torch.randn(x.shape[0], 7, dtype=torch.float64)
        first = sum(ROWS_PER_RANK[:position])
        rows = slice(first, first + ROWS_PER_RANK[position])
        outs = {}
        for name, fn, dtype, part in (("eager", eager, torch.float32, slice(None)),
                                      ("ref", ref, torch.float64, slice(None)),
                                      ("fused", compiled, torch.float32, rows)):
            outs[name] = fn(x[part].to(dtype))
            (outs[name].double() * projection[part]).sum().backward()
        assert_no_further_from_float64("output", outs["fused"], outs["eager"][rows], outs["ref"][rows])
        _compare_synced_state(fused, eager, ref, summed=True, world_size=2, group=mine,
                              cancelling=SyncChains.BIASES_BEFORE_BATCH_NORM)
        assert_fused(rewrites=2, graphs=1, linears=1)


def sync_batch_norm_without_peers(rank: int, world_size: int, init_file: str, joins_a_group: bool) -> None:
    """SyncBatchNorm chains where SyncBatchNorm is plain batch norm: in a group of one rank, or with no
    process group at all. fusepass fuses them as batch-norm chains, with no collective. Eager is eager
    SyncBatchNorm without a group; in a CPU group of one, where eager SyncBatchNorm refuses CPU input
    before it looks at the world size, it is the model before convert_sync_batchnorm (and so is the
    float64 model)."""
    with rank_group(rank, world_size, init_file, join=joins_a_group):
        assert dist.is_initialized() == joins_a_group
        torch.manual_seed(0)
        plain = SyncChains()
        model = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain))
        patterns = [m["pattern"] for m in explain(copy.deepcopy(model).train(), make_input(8, IN)).matches]
        assert patterns == ["linear_scale_batch_norm_relu", "linear_batch_norm_gelu_softmax", "linear"], patterns
        counters["fusepass"].clear()
        fused = copy.deepcopy(model)
        eager = plain if joins_a_group else model
        trio = Trio(copy.deepcopy(eager), fused, copy.deepcopy(eager).double(),
                    torch.compile(fused, backend="fusepass"), zero_grads=("l1.bias", "l2.bias"), float64_grads=("s",))
        for training, steps in ((True, 3), (False, 1)):
            trio.train(training)
            for _ in range(steps):
                trio.step(make_input(sum(ROWS_PER_RANK), IN))
        trio.finish()
        assert_fused(rewrites=4, graphs=2, linears=2)


def sync_batch_norm_chains(rank: int, world_size: int, init_file: str, device: str, cases: list) -> None:
    """SyncBatchNorm chains compiled with fusepass, against one process's BatchNorm1d model on the global
    batch (what SyncBatchNorm computes): each rank's rows of the output, the running statistics and the
    gradients, by the float64 criterion. On GPUs both run under DDP, eager is native SyncBatchNorm and the
    gradients are DDP's average (the global batch's over the world size). On CPU, where DDP and eager
    SyncBatchNorm refuse it, fusepass runs without DDP (its gradients summed over the ranks here) and
    eager is the single-process fp32 model. Three training steps, then an eval step (plain batch norm
    with the running statistics). Each case is (autocast, rows_per_rank). `autocast`: eager and fusepass
    under bf16 autocast, float64 without. `rows_per_rank`: each rank's share of the global batch (a rank
    may have none)."""
    with rank_group(rank, world_size, init_file, device) as dev:
        for case in cases:
            with fresh_case(case):
                _sync_batch_norm_chains(rank, world_size, dev, *case)


def _sync_batch_norm_chains(rank: int, world_size: int, dev: torch.device, autocast: bool,
                            rows_per_rank: tuple) -> None:
    torch.manual_seed(0)
    model = SyncChains().to(dev)
    ref = copy.deepcopy(model).double()  # single process, global batch
    fused = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    on_gpus = dev.type == "cuda"
    # Eager SyncBatchNorm fails where a rank has no rows under autocast (torch 2.11 on CUDA: "Expected mean
    # to have type Float but got BFloat16"): there, as on CPU, eager is one process's model, global batch.
    eager_synced = on_gpus and not (autocast and 0 in rows_per_rank)
    if on_gpus:
        fused = DDP(fused)
    eager = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))) if eager_synced else copy.deepcopy(model)
    compiled = torch.compile(fused, backend="fusepass")
    counters["fusepass"].clear()
    first = sum(rows_per_rank[:rank])
    rows = slice(first, first + rows_per_rank[rank])
    for step in range(4):
        training = step < 3
        for m in (eager, ref, fused):
            m.train(training)
        torch.manual_seed(1000 + step)  # the same global batch and upstream gradient on every rank
        x = make_input(sum(rows_per_rank), IN, str(dev))
        projection = torch.randn(x.shape[0], 7, dtype=torch.float64, device=dev)
        eager_rows = rows if eager_synced else slice(None)
        outs = {}
        for name, fn, dtype, part in (("eager", eager, torch.float32, eager_rows),
                                      ("ref", ref, torch.float64, slice(None)),
                                      ("fused", compiled, torch.float32, rows)):
            low = autocast and name != "ref"
            with torch.autocast(dev.type, dtype=torch.bfloat16) if low else nullcontext():
                out = fn(x[part].to(dtype))
            if training:
                (out.double() * projection[part]).sum().backward()
            outs[name] = out
        eager_out = outs["eager"] if eager_synced else outs["eager"][rows]
        assert_no_further_from_float64("output", outs["fused"], eager_out, outs["ref"][rows])
        if training:
            _compare_synced_state(_unwrap(fused), _unwrap(eager), ref, summed=not on_gpus, world_size=world_size,
                                  eager_averaged=eager_synced, cancelling=SyncChains.BIASES_BEFORE_BATCH_NORM)
    patterns = [m["pattern"] for m in explain(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model)).train(),
                                              x[rows]).matches]
    assert patterns == ["linear_scale_sync_batch_norm_relu", "linear_sync_batch_norm_gelu_softmax",
                        "linear"], patterns
    # two chains in a training graph and in an eval graph; the last Linear on fusepass's linear op in
    # fp32 only (under autocast a bare linear is Inductor's, options.py)
    assert_fused(rewrites=4, graphs=2, linears=0 if autocast else 2)


FLOAT64_EXACT = 1e-12  # relative: float64 roundoff, far below fp32's 6e-8


def _assert_close_to_float64(what: str, fused: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> None:
    """The project's criterion; for a float64 result also within FLOAT64_EXACT of float64, as the
    criterion's floor of a few fp32 ulps would pass fp32 math inside."""
    assert_no_further_from_float64(what, fused, eager, ref)
    if fused.dtype == torch.float64:
        error = rel_error(fused, ref)
        assert error <= FLOAT64_EXACT, f"{what}: {error:.3g} from the float64 model (fp32 math inside?)"


# A gradient whose exact value is 0 (below) may be this many times eager's rounding noise: measured 2.3x
# (a linear bias before a synced batch norm, fp32, 33 + 0 rows on two H100s; norms over 64 features).
NOISE_SLACK = 4.0


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def _compare_synced_state(fused: nn.Module, eager: nn.Module, ref: nn.Module, summed: bool, world_size: int,
                          group: Optional[dist.ProcessGroup] = None, eager_averaged: bool = False,
                          cancelling: tuple = ()) -> None:
    """Gradients against the global batch's: fusepass's summed over the ranks of `group` here, or DDP's
    averages scaled back; eager's are the global batch's, or DDP's averages (`eager_averaged`).
    `cancelling`: parameters whose gradient over the global batch is exactly 0 (a linear's bias before a
    synced batch norm, which removes any shift of all ranks' rows alike). Each rank returns its own rows'
    column sum, as eager does, so the sum over the ranks is rounding noise in both, and float64's is too:
    a relative error to it means nothing. They are judged by size: no larger than NOISE_SLACK times
    eager's noise."""
    for (name, p_fused), (_, p_eager), (_, p_ref) in zip(fused.named_parameters(), eager.named_parameters(),
                                                         ref.named_parameters()):
        if summed:
            dist.all_reduce(p_fused.grad, group=group)
            fused_grad = p_fused.grad
        else:
            fused_grad = p_fused.grad * world_size
        eager_grad = p_eager.grad * world_size if eager_averaged else p_eager.grad
        if name in cancelling:
            noise, eager_noise = fused_grad.double().norm().item(), eager_grad.double().norm().item()
            assert noise <= NOISE_SLACK * eager_noise, f"grad {name}: noise {noise:.3g}, eager's {eager_noise:.3g}"
            continue
        _assert_close_to_float64(f"grad {name}", fused_grad, eager_grad, p_ref.grad)
    for (name, b_fused), (_, b_eager), (_, b_ref) in zip(fused.named_buffers(), eager.named_buffers(),
                                                         ref.named_buffers()):
        if b_fused.is_floating_point():
            _assert_close_to_float64(f"buffer {name}", b_fused, b_eager, b_ref)
        else:
            assert torch.equal(b_fused, b_eager), f"buffer {name}"
    for m in (fused, eager, ref):
        m.zero_grad(set_to_none=True)


def lone_sync_batch_norm(rank: int, world_size: int, init_file: str, device: str, cases: list) -> None:
    """A SyncBatchNorm that heads no chain (its input is the model's): torch.ops.fusepass.sync_batch_norm,
    forward and backward (the input's gradient too), against BatchNorm1d on the global batch; and eager's
    error for input of the wrong dimension. A float64 model (no chain fuses float64) must be as exact
    as float64 BatchNorm1d: the project's criterion's floor of a few fp32 ulps would pass fp32 math.
    Each case is (dtype, rows_per_rank, spatial): `rows_per_rank` as for sync_batch_norm_chains,
    `spatial` (H, W): BatchNorm2d on (N, 12, H, W) input, statistics per channel over the batch and the
    space; () for BatchNorm1d."""
    with rank_group(rank, world_size, init_file, device) as dev:
        for case in cases:
            with fresh_case(case):
                _lone_sync_batch_norm(rank, world_size, dev, *case)


def _lone_sync_batch_norm(rank: int, world_size: int, dev: torch.device, dtype: torch.dtype, rows_per_rank: tuple,
                          spatial: tuple) -> None:
    torch.manual_seed(0)  # the same model on every rank
    norm = nn.BatchNorm2d(12) if spatial else nn.BatchNorm1d(12)
    model = nn.Sequential(norm, nn.Tanh()).to(dev, dtype)
    randomize_batch_norm(model[0])
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    fused = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    compiled = torch.compile(fused, backend="fusepass")
    first = sum(rows_per_rank[:rank])
    rows = slice(first, first + rows_per_rank[rank])
    torch.manual_seed(7)
    x = make_input(sum(rows_per_rank), 12 * math.prod(spatial), str(dev)).view(-1, 12, *spatial)
    projection = torch.randn(x.shape, dtype=torch.float64, device=dev)
    inputs, outs = {}, {}
    for name, fn, in_dtype, part in (("eager", eager, dtype, slice(None)),
                                     ("ref", ref, torch.float64, slice(None)), ("fused", compiled, dtype, rows)):
        inputs[name] = x[part].to(in_dtype).requires_grad_()
        outs[name] = fn(inputs[name])
        (outs[name].double() * projection[part]).sum().backward()
    _assert_close_to_float64("output", outs["fused"], outs["eager"][rows], outs["ref"][rows])
    _assert_close_to_float64("grad x", inputs["fused"].grad, inputs["eager"].grad[rows], inputs["ref"].grad[rows])
    _compare_synced_state(fused, eager, ref, summed=True, world_size=world_size)
    assert counters["fusepass"]["rewrites"] == 0  # no chain: the op of a lone SyncBatchNorm
    if dev.type == "cpu":  # another backend traces eager's SyncBatchNorm, which refuses CPU input
        other = torch.compile(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model)), backend="eager")
        try:
            other(x[rows])
        except ValueError as exc:
            assert "SyncBatchNorm expected input tensor to be on GPU" in str(exc), exc
        else:
            raise AssertionError("another backend must run eager's SyncBatchNorm")
    try:
        compiled(torch.randn(5, device=dev))
    except ValueError as exc:
        # eager's message: SyncBatchNorm's own check, any BatchNorm*d it replaced
        assert "expected at least 2D input (got 1D input)" in str(exc), exc
    else:
        raise AssertionError("a 1-D input must raise eager's ValueError")


def collective_counts(rank: int, world_size: int, init_file: str, device: str = "cpu") -> None:
    """One training step of SyncChains (two SyncBatchNorm chains, fused), profiled: exactly one
    all-gather per chain in the forward and one all-reduce per chain in the backward, counted as the
    functional collectives called and, on GPUs, as the NCCL kernels launched."""
    with rank_group(rank, world_size, init_file, device) as dev:
        torch.manual_seed(0)
        compiled = torch.compile(nn.SyncBatchNorm.convert_sync_batchnorm(SyncChains().to(dev)), backend="fusepass")
        x = make_input(ROWS_PER_RANK[rank], IN, str(dev))
        compiled(x).sum().backward()  # compiles
        activities = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            compiled(x).sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        events = prof.key_averages()
        # Inductor may call a collective's in-place or out= variant (all_reduce_, all_gather_into_tensor_out)
        calls = {name: sum(e.count for e in events if e.key.startswith(f"_c10d_functional::{name}"))
                 for name in ("all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "all_to_all_single")}
        assert calls == {"all_gather_into_tensor": 2, "all_reduce": 2, "reduce_scatter_tensor": 0,
                         "all_to_all_single": 0}, (calls, [(e.key, e.count) for e in events if "c10d" in e.key])
        if dev.type == "cuda":
            kernels = [e for e in events if e.key.startswith("ncclDevKernel") or e.key.startswith("ncclKernel")]
            gathers = sum(e.count for e in kernels if "AllGather" in e.key)
            reduces = sum(e.count for e in kernels if "AllReduce" in e.key)
            assert (gathers, reduces, sum(e.count for e in kernels)) == (2, 2, 4), [(e.key, e.count) for e in kernels]
        assert counters["fusepass"]["rewrites"] == 2
