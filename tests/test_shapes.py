"""Batch sizes that change: every size matches eager by the float64 criterion, and a size whose bucket is
known costs no recompile, no tuning and no Triton compile (read from the counters, never timed)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import fusepass
from fusepass.lowering import forget_choices, gemm, normalize, tf32_split, tuning
from tests.chains import DEVICES, ChainModel, Trio, assert_fused, make_input, requires_cuda

# 300 rows span three of the GEMM's row tiles (128) and ten statistics strips (32): a symbolic count of
# tiles must not guard the graph. 2 rows: the fewest batch norm trains on.
TRAIN_SIZES = (24, 24, 17, 24, 40, 9, 300, 2)
EVAL_SIZES = (1, 8, 33, 64, 5, 8)


def _loop(trio: Trio, sizes, training: bool) -> None:
    trio.train(training)
    for batch in sizes:
        trio.step(make_input(batch, 32, trio.fused_device))
    trio.finish()


@pytest.fixture
def fused_chain():
    """A chain with a tail, its Trio on each device."""
    def make(device, **compile_kwargs):
        torch.manual_seed(21)
        model = torch.nn.Sequential(ChainModel(32, 48, scale="single"), torch.nn.GELU()).to(device)
        trio = Trio.of(model, zero_grads=("0.linear.bias",), float64_grads=("0.scale",), **compile_kwargs)
        trio.fused_device = device
        return trio
    return make


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_batch_sizes_change_without_recompiles(fused_chain, device):
    """Training, then eval, over changing sizes: the first size compiles static, the second a graph with a
    symbolic batch (Dynamo's automatic dynamic shapes), and no later size compiles again; the fused op
    stays in both graphs, with no fallback."""
    trio = fused_chain(device)
    _loop(trio, TRAIN_SIZES, training=True)
    assert_fused(rewrites=2, graphs=2)
    _loop(trio, EVAL_SIZES, training=False)
    assert_fused(rewrites=4, graphs=4)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_true_keeps_every_rewrite(fused_chain, device):
    """torch.compile(dynamic=True): symbolic from the first call, the chain fused. Training compiles one
    graph; eval two, as Dynamo keeps a batch of 1 apart (its 0/1 specialization) even then."""
    trio = fused_chain(device, dynamic=True)
    _loop(trio, TRAIN_SIZES[:4], training=True)
    assert_fused(rewrites=1, graphs=1)
    _loop(trio, EVAL_SIZES[:3], training=False)
    assert_fused(rewrites=3, graphs=3)


def test_warmup_compiles_each_size_and_leaves_the_model_and_dynamo_alone():
    torch.manual_seed(22)
    model = ChainModel(32, 48)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    done = fusepass.warmup(model, [make_input(16, 32)], batch_sizes=[4, 16, 100])
    assert done["batch_sizes"] == [4, 16, 100] and done["graphs"] == 3  # one static graph per size
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert all(p.grad is None for p in model.parameters())
    torch.compile(model, backend="fusepass")(make_input(16, 32))  # a fresh compile: warmup left nothing
    assert counters["fusepass"]["graphs"] == 4


# --------------------------------------------------------------------------- GPU: tuning and compiles


def jit_variants(*kernels) -> int:
    """Kernels compiled by Triton's launcher so far, over every specialization (the opaque path)."""
    return sum(len(entry[0]) for kernel in kernels for entry in getattr(kernel, "device_caches", {}).values())


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    """Tuning on, as a user's run has it, with a cache directory of the test's own. Inductor's graph caches
    off: a graph an earlier run left there is loaded without tracing the op, so nothing would be tuned
    (the counts below then failed on a second run of the test on one machine)."""
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path))
    return tmp_path


@requires_cuda
@pytest.mark.cuda
def test_a_known_bucket_tunes_nothing_and_compiles_nothing(fused_chain, tuned):
    """Tuning on: the sizes after the symbolic graph's compile bring no tuning and no new graph."""
    trio = fused_chain("cuda")
    _loop(trio, TRAIN_SIZES[:4], training=True)  # static 24, then symbolic from 17
    after_compiles = dict(counters["fusepass"])
    assert after_compiles["tunings"] > 0
    _loop(trio, (40, 9, 2, 24, 17), training=True)
    assert counters["fusepass"]["tunings"] == after_compiles["tunings"]
    assert_fused(rewrites=2, graphs=2)


@requires_cuda
@pytest.mark.cuda
def test_opaque_op_runs_any_row_count_on_one_compile(fused_chain, tuned, monkeypatch):
    """FUSEPASS_OPAQUE=1: the op chooses when it runs, one lookup per call. Row counts of one bucket (64:
    64, 37, 48, 50 rows, divisible by 16 or not) tune once and compile each kernel once, the row count
    never specialized; but for the GEMM's weight gradient, whose K (the batch) is a whole number of
    blocks or not (gemm.k_may_end_partial): after a batch of each, nothing compiles."""
    monkeypatch.setenv("FUSEPASS_OPAQUE", "1")
    kernels = (gemm._gemm_kernel, tf32_split._tf32_split_kernel, normalize.normalize_kernel,
               normalize.finalize_stats_kernel)
    trio = fused_chain("cuda")
    trio.train(True)
    trio.step(make_input(64, 32, "cuda"))
    tunings = counters["fusepass"]["tunings"]
    trio.step(make_input(37, 32, "cuda"))
    compiled = jit_variants(*kernels)
    for batch in (48, 64, 50):
        trio.step(make_input(batch, 32, "cuda"))
    trio.finish()
    assert jit_variants(*kernels) == compiled and counters["fusepass"]["tunings"] == tunings


SECOND_PROCESS = """
import json, torch, fusepass
from torch._dynamo.utils import counters
from tests.chains import ChainModel, make_input
torch.manual_seed(0)
model = ChainModel(32, 48).cuda()
compiled = torch.compile(model, backend="fusepass")
for batch in (64, 40, 64, 100):
    compiled(make_input(batch, 32, "cuda")).sum().backward()
print(json.dumps(dict(counters["fusepass"])))
"""


@requires_cuda
@pytest.mark.cuda
@pytest.mark.slow
def test_a_second_process_tunes_nothing(tuned):
    env = {**os.environ, tuning.TUNE_ENV: "1", tuning.CACHE_DIR_ENV: str(tuned)}
    root = os.path.dirname(os.path.dirname(__file__))
    runs = [json.loads(subprocess.run([sys.executable, "-c", SECOND_PROCESS], env=env, capture_output=True, text=True,
                                      check=True, cwd=root).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0]["tunings"] > 0 and runs[1].get("tunings", 0) == 0, runs
    assert runs[0]["rewrites"] == runs[1]["rewrites"] == 2 and "fallbacks" not in runs[1]


@requires_cuda
@pytest.mark.cuda
def test_warmup_fills_the_cache_for_every_bucket(tuned):
    """After warmup, a process that meets the same sizes (static, then symbolic) times nothing and
    borrows nothing: every bucket's choice is on disk."""
    torch.manual_seed(23)
    model = ChainModel(32, 48).cuda()
    sizes = [8, 40, 100]
    done = fusepass.warmup(model, [make_input(16, 32, "cuda")], batch_sizes=sizes)
    assert done["tunings"] > 0
    forget_choices()
    counters["fusepass"].clear()
    compiled = torch.compile(model, backend="fusepass")
    for batch in sizes:
        compiled(make_input(batch, 32, "cuda")).sum().backward()
    assert counters["fusepass"]["tunings"] == 0 and counters["fusepass"]["borrowed"] == 0
