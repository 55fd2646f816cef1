"""The bare-linear family end to end: fp32 linears outside any chain run on `fusepass::linear`, with the
float64 criterion on outputs, buffers and every gradient; what is left alone, and why."""

import re

import pytest
import torch
import torch.nn as nn
from torch._inductor.utils import run_fw_bw_and_get_code

import fusepass
from fusepass.families import bare_linear
from fusepass.lowering import linear
from fusepass.lowering.schema import KernelOptions
from tests.chains import DEVICES, MLP, ChainModel, Trio, assert_fused, make_input
from tests.test_backend import run_train_then_eval
from tests.test_pattern import rewrite, single_graph


def test_kernel_options_reach_the_linear_op():
    """Every option the op takes, CUDA graphs among them (they change what its tuner offers)."""
    gm = single_graph(nn.Sequential(nn.Linear(16, 8)), make_input(4, 16))
    kernel = KernelOptions(fp32_matmul="ieee", gemm="cublas", operand_copies=False, cuda_graphs=True)
    rewrite(gm, kernel, (bare_linear.FAMILY,))
    [op] = [n for n in gm.graph.nodes if n.target is bare_linear.FUSED_OP]
    arguments = dict(zip([a.name for a in bare_linear.FUSED_OP._schema.arguments], op.args))
    assert (arguments["kernel_fp32_matmul"], arguments["kernel_gemm"], arguments["kernel_operand_copies"],
            arguments["kernel_cuda_graphs"]) == ("ieee", "cublas", False, True)


def _mlp_steps(device, *, steps=3, batch=48, autocast_dtype=None, options=None, mode=None):
    torch.manual_seed(21)
    model = MLP(40, [72, 56, 24]).to(device)  # no size a multiple of a tile
    trio = Trio.of(model, options=options, mode=mode)
    for training in (True, False):
        trio.train(training)
        for _ in range(steps if training else 1):
            trio.step(make_input(batch, 40, device), autocast_dtype=autocast_dtype)
    trio.finish()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_mlp_last_layer_is_rewritten_and_matches_eager_by_float64_criterion(device):
    _mlp_steps(device)
    assert_fused(rewrites=2 * 2, graphs=2, linears=2)  # per graph (train, eval): two chains, the last linear


@pytest.mark.parametrize("device", DEVICES)
def test_option_turns_the_family_off(device):
    _mlp_steps(device, steps=1, options={"bare_linear": False})
    assert_fused(rewrites=2 * 2, graphs=2, linears=0)


@pytest.mark.parametrize("device", DEVICES)
def test_ieee_fp32_leaves_bare_linears_alone(device):
    _mlp_steps(device, steps=1, options={"fp32_matmul": "ieee"})
    assert_fused(rewrites=2 * 2, graphs=2, linears=0)


def test_bad_option_value_is_rejected():
    with pytest.raises(Exception, match="bare_linear"):
        torch.compile(nn.Linear(3, 4), backend="fusepass", options={"bare_linear": "yes"})(torch.randn(2, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_non_fp32_linears_are_left_alone_with_a_reason(dtype):
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3)).to(dtype)
    x = torch.randn(5, 8, dtype=dtype)
    report = fusepass.explain(model, x)
    assert report.matches == []
    assert len(report.misses) == 2 and all("dtype" in m["reason"] or "left to Inductor" in m["reason"]
                                           for m in report.misses)
    out = torch.compile(model, backend="fusepass")(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert_fused(rewrites=0, linears=0)


def test_autocast_linear_is_left_alone():
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = fusepass.explain(model, torch.randn(5, 8))
    assert report.matches == [] and len(report.misses) == 2
    assert all("bfloat16 linear" in m["reason"] for m in report.misses)


def test_tf32_allowed_leaves_fp32_linears_alone():
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        report = fusepass.explain(nn.Linear(8, 6), torch.randn(5, 8))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert report.matches == [] and "TF32 is allowed" in report.misses[0]["reason"]


def test_explain_lists_chains_before_the_bare_linears_they_leave():
    model = MLP(16, [24, 8])
    report = fusepass.explain(model, torch.randn(10, 16))
    assert [m["pattern"] for m in report.matches] == ["linear_batch_norm_relu_dropout", "linear"]
    assert report.matches[1]["shapes"] == {"x": (10, 24), "weight": (8, 24), "out": (10, 8)}
    assert report.misses == []
    last_row = next(line for line in str(report).splitlines() if line.split()[:2] == ["0", "linear"])
    assert re.search(r"float32\s+-\s+-\s+fused: not timed", last_row)  # no train/eval mode, no tail


def test_linear_feeding_a_chain_and_fed_by_one_is_rewritten_once_each():
    """A bare linear between two chains: its input is a chain's output, its output another chain's input."""
    class Sandwich(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.mid, self.b = ChainModel(32, 24), nn.Linear(24, 20), ChainModel(20, 12)

        def forward(self, x):
            return self.b(self.mid(self.a(x)))

    torch.manual_seed(5)
    model = Sandwich()
    run_train_then_eval(model, "cpu", steps=2, make_x=lambda: make_input(16, 32),
                        zero_grads=("a.linear.bias", "b.linear.bias"), float64_grads=("a.scale", "b.scale"))
    assert_fused(rewrites=2 * 2, graphs=2, linears=2)


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_batch_past_the_split_copy_limit_trains_its_weight_gradients_on_cublas(monkeypatch):
    """A symbolic batch: the weight gradients' split copies (a few hundred bytes per row here) stay under
    a 64 KiB limit at 48 and 64 rows and pass it at 600. That batch's graph (compiled again, on a guard)
    runs those GEMMs on GEMMs that copy nothing: cuBLAS, or on Hopper the warp-specialized GEMM splitting
    in the kernel; every step stays exact."""
    monkeypatch.setattr(linear, "SPLIT_COPY_LIMIT", 64 << 10)
    torch.manual_seed(23)
    trio = Trio.of(MLP(40, [72, 56, 24]).cuda())
    for batch in (48, 64, 600, 64):
        trio.step(make_input(batch, 40, "cuda"))
    trio.finish()
    weight_gradients = {problem.sizes[0]: impl.name for (problem, _), impl in linear.LINEAR._chosen.items()
                        if "layout=mm" in problem.family}
    past_the_limit = weight_gradients[1024]
    assert past_the_limit == "cublas" or past_the_limit.endswith("split in kernel"), past_the_limit
    assert all(name.startswith("triton split") for batch, name in weight_gradients.items() if batch <= 64)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_mlp_training_on_cuda_with_tuning(mode, monkeypatch):
    """Every candidate GEMM timed and chosen for real; in reduce-overhead mode the training steps
    (forward, backward, running statistics) replay from CUDA graphs."""
    monkeypatch.setenv("FUSEPASS_TUNE", "1")
    _mlp_steps("cuda", steps=4, batch=96, mode=mode)
    assert_fused(rewrites=2 * 2, graphs=2, linears=2)


@pytest.mark.parametrize("device", DEVICES)
def test_forbidden_operand_copies_reach_every_linear_op_and_keep_the_results(device):
    """operand_copies=False: the training steps still meet the float64 criterion (on CUDA without any GEMM
    that copies an operand), and the linear ops (forward, dX, dW) carry it (seen on CPU, where the compiled
    code calls them; on CUDA their traced kernels are inlined)."""
    _mlp_steps(device, steps=2, options={"operand_copies": False})
    assert_fused(rewrites=2 * 2, graphs=2, linears=2)
    if device != "cpu":
        return
    torch._dynamo.reset()
    model = torch.compile(MLP(40, [72, 56, 24]).to(device), backend="fusepass", options={"operand_copies": False})
    x = make_input(48, 40, device)
    _, codes = run_fw_bw_and_get_code(lambda: model(x).sum())
    calls = re.findall(r"torch\.ops\.fusepass\.linear\w*\.default\(([^\n]*)\)", "\n".join(codes))
    assert calls and all("False" in call for call in calls), calls
