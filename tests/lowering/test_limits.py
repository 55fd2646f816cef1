"""What a launch needs of its call (limits.py), checked on every call: each invariant alone, then the op's
and the linear op's fallback to the unfused math when one fails, under Triton's interpreter on CPU."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fusepass.lowering import gemm_configs, limits, linear, op
from fusepass.lowering.implementations import Implementation
from fusepass.lowering.reference import reference
from fusepass.lowering.schema import ChainOutputs, Linear, Scale
from tests.chains import requires_cuda
from tests.lowering.cases import KERNEL_DEVICE, assert_like_eager, make_args

SMALL = gemm_configs.GemmConfig(16, 32, 16, group_m=2, num_warps=4, num_stages=2)


def test_grid_second_dimension():
    assert limits.column_grid(65535 * 64) is None
    assert "65535" in limits.column_grid(65535 * 64 + 1)


def test_tma_needs_aligned_rows_and_base():
    x = torch.randn(8, 17)
    assert limits.tma_layout(torch.randn(8, 16)) is None
    assert "16-byte" in limits.tma_layout(x[:, 1:])  # base 4 bytes in, rows of 17 floats
    assert "contiguous last dimension" in limits.tma_layout(torch.randn(16, 8).t())


def test_devices_and_rows():
    assert limits.off_device(torch.device("cpu"), [torch.ones(2), None]) is None
    assert "is on meta" in limits.off_device(torch.device("cpu"), [torch.ones(2), torch.ones((), device="meta")])
    assert limits.some_rows(0) == "no rows" and limits.some_rows(1) is None


def test_chain_implementation_checks_its_kernels_and_the_passes():
    args = make_args(12, 16, 8)
    triton, cublas = Implementation("tf32x3", SMALL), Implementation("tf32x3")
    assert triton.unlaunchable(args) is None and cublas.unlaunchable(args) is None
    assert triton.name.startswith("triton tf32x3 16x32x16") and cublas.name == "cublas"
    no_rows = dataclasses.replace(args, linear=dataclasses.replace(args.linear, x=args.linear.x[:0]))
    assert triton.unlaunchable(no_rows) == cublas.unlaunchable(no_rows) == "no rows"
    elsewhere = dataclasses.replace(args, scale_before=Scale(tensor=torch.ones((), device="meta")))
    assert "on meta" in cublas.unlaunchable(elsewhere)
    misaligned = dataclasses.replace(args, linear=Linear(torch.randn(12, 17, device=KERNEL_DEVICE)[:, 1:],
                                                         args.linear.weight, None))
    assert "16-byte" in Implementation("tf32x3", SMALL.with_tma()).unlaunchable(misaligned)
    assert triton.unlaunchable(misaligned) is None  # the pointer-based kernel reads any strides


@pytest.fixture
def no_column_grid(monkeypatch):
    """A grid's second dimension takes no column blocks: every chain, and every split GEMM, is past it."""
    monkeypatch.setattr(limits, "MAX_GRID_Y", 0)
    counters["fusepass"].clear()


@pytest.mark.parametrize("training", [True, False])
def test_a_call_past_the_limits_runs_the_unfused_math(no_column_grid, training):
    args = make_args(12, 16, 8, training=training, save_linear_out=True)
    out = op.CHAIN.launch_checked(Implementation("tf32x3", SMALL), args)
    assert counters["fusepass"]["unlaunchable"] == 1
    expected = reference(args)
    for name, value in out._asdict().items():
        assert torch.equal(value, getattr(expected, name)), name
    assert_like_eager(ChainOutputs(*out), args)


def test_a_call_within_the_limits_runs_its_kernels(monkeypatch):
    args = make_args(12, 16, 8, save_linear_out=True)
    launched = []
    monkeypatch.setattr(Implementation, "__call__", lambda self, a: launched.append(self) or reference(a))
    op.CHAIN.launch_checked(Implementation("tf32x3", SMALL), args)
    assert launched == [Implementation("tf32x3", SMALL)] and counters["fusepass"]["unlaunchable"] == 0


def test_linear_op_past_the_limits_runs_cublas(no_column_grid):
    x, w = torch.randn(12, 16, device=KERNEL_DEVICE), torch.randn(8, 16, device=KERNEL_DEVICE)
    out = linear.LINEAR.launch_checked(linear.LinearImplementation("split_x", SMALL),
                                       linear.LinearCall(x, w, None, "tf32x3", "auto"))
    assert counters["fusepass"]["unlaunchable"] == 1 and torch.equal(out, F.linear(x, w))


def test_linear_op_with_a_tma_choice_and_a_misaligned_call_runs_cublas():
    """A choice made for aligned operands serves a later call of the same shape whose x starts 4 bytes in."""
    counters["fusepass"].clear()
    x, w = torch.randn(12, 17, device=KERNEL_DEVICE)[:, 1:], torch.randn(8, 16, device=KERNEL_DEVICE)
    out = linear.LINEAR.launch_checked(linear.LinearImplementation("tf32x3", SMALL.with_tma()),
                                       linear.LinearCall(x, w, None, "tf32x3", "auto"))
    assert counters["fusepass"]["unlaunchable"] == 1 and torch.equal(out, F.linear(x, w))


# --------------------------------------------------------------------------- on a GPU, end to end


class CpuScalar(torch.nn.Module):
    """Linear -> * a 0-d CPU tensor (eager lets it into a CUDA op) -> BatchNorm1d -> - a 0-d CPU tensor."""

    def __init__(self):
        super().__init__()
        self.linear, self.bn = torch.nn.Linear(32, 48), torch.nn.BatchNorm1d(48)
        self.scale, self.shift = torch.tensor(1.7), torch.tensor(0.3)  # plain attributes: .cuda() leaves them

    def forward(self, x):
        return self.bn(self.linear(x) * self.scale) - self.shift


@requires_cuda
@pytest.mark.cuda
def test_cpu_scalars_in_a_cuda_chain_are_fused_on_the_device():
    from tests.chains import Trio, assert_fused, make_input
    torch.manual_seed(3)
    trio = Trio.of(CpuScalar().cuda(), zero_grads=("linear.bias",))
    for training in (True, False):
        trio.train(training)
        trio.step(make_input(40, 32, "cuda"))
    assert_fused(rewrites=2, graphs=2)
    assert counters["fusepass"]["unlaunchable"] == 0


@requires_cuda
@pytest.mark.cuda
def test_opaque_op_with_a_tma_choice_takes_a_misaligned_call(monkeypatch):
    """The op chooses for the first call (TMA, aligned operands) and meets the same shape again with x
    starting 4 bytes into its storage: that call runs the unfused math instead of failing."""
    first = gemm_configs.candidates("tf32x3", torch.float32)[0]
    monkeypatch.setattr(gemm_configs, "candidates", lambda precision, dtype: [first.with_tma(), first])
    monkeypatch.setattr(op.CHAIN, "_chosen", {})
    counters["fusepass"].clear()
    args = make_args(64, 32, 48, device="cuda", save_linear_out=True)
    aligned = op.call(args)
    assert counters["fusepass"]["unlaunchable"] == 0
    assert_like_eager(aligned, args)
    x = torch.empty(64 * 33 + 1, device="cuda")[1:].view(64, 33)[:, :32]
    x.copy_(args.linear.x)
    misaligned = dataclasses.replace(args, linear=Linear(x, args.linear.weight, args.linear.bias))
    assert_like_eager(op.call(misaligned), misaligned)
    assert counters["fusepass"]["unlaunchable"] == 1


@requires_cuda
@pytest.mark.cuda
def test_compiled_chain_past_the_limits_runs_the_unfused_math(no_column_grid):
    from tests.chains import ChainModel, Trio, assert_fused, make_input
    torch.manual_seed(4)
    trio = Trio.of(ChainModel(16, 24).cuda())
    trio.step(make_input(10, 16, "cuda"))
    assert_fused(rewrites=1, graphs=1)
    assert counters["fusepass"]["unlaunchable"] >= 1  # counted when the op's body was traced


@requires_cuda
@pytest.mark.cuda
def test_kernels_address_tensors_past_2_31_elements_on_cuda():
    """A training batch whose (N, F) output has more than 2**31 elements (int32 offsets would wrap): the
    chain on the Triton GEMM (a program per tile, and persistent) and its passes, and the linear op's dX
    and dW over that batch, agree with cuBLAS and PyTorch on the last rows and on every feature's
    statistics."""
    n, f = 2**31 // 2048 + 3, 2048
    args = make_args(n, 16, f, dtype=torch.bfloat16, device="cuda", save_linear_out=True)
    lin, bn, last = args.linear, args.batch_norm, slice(n - 64, n)
    expected_y = F.linear(lin.x[last], lin.weight, lin.bias).float()
    var, mean = torch.var_mean(F.linear(lin.x, lin.weight, lin.bias).float() * args.scale_before.factor(), dim=0,
                               correction=0)
    configs = gemm_configs.candidates("native", torch.bfloat16)
    for config in (configs[0], next(c for c in configs if c.persistent)):
        out = Implementation("native", config)(args)
        torch.testing.assert_close(out.linear_out[last].float(), expected_y, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(out.mean, mean, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(out.invstd, torch.rsqrt(var + bn.eps), rtol=1e-3, atol=1e-3)
        u = (out.linear_out[last].float() * args.scale_before.factor() - out.mean) * out.invstd * bn.weight + bn.bias
        torch.testing.assert_close(out.out[last].float(), u, rtol=1e-2, atol=1e-2)
    g, x = out.out, lin.x
    del out, args
    native = linear.LinearImplementation("native", configs[0])
    grad_x = native(linear.LinearCall(g, lin.weight.t(), None, "tf32x3", "auto"))
    torch.testing.assert_close(grad_x[last], g[last] @ lin.weight, rtol=1e-2, atol=1e-2)
    grad_w = native(linear.LinearCall(g.t(), x.t(), None, "tf32x3", "auto"))
    expected_w = (g.t() @ x).float()  # sums of a million products, rounded to bf16: a few ulps of its largest
    torch.testing.assert_close(grad_w.float(), expected_w, rtol=0, atol=0.02 * expected_w.abs().max().item())
