"""Test models for the linear -> [scale] -> batch_norm -> [scale] -> [softmax] family, and the float64
criterion.

"Numerically identical" means: fusepass is no further from a float64 copy of the model than eager
PyTorch is. Each comparison measures both against the float64 run on the same inputs. A one-element
quantity (the gradient of a (1,) or 0-d scale) is a single sample of rounding noise per step, so for
those the criterion is applied to their values over all steps of a run, taken as one vector
(Trio.finish): the same norm-wise relative error as for any tensor, where a step whose exact value is
near 0 does not blow up the way a per-step relative error does. Training steps and eval steps are
pooled apart: their values differ in size, and the larger would hide the other. Measured on an H200 for
the post-batch-norm scale of a softmax chain: over 24 steps fusepass and eager each won 12, and
single-step errors of both ranged over two orders of magnitude.

Where eager's own result is rounding noise, "no further than eager" says nothing, and two training
gradients are judged without eager (see Trio):

- the linear bias's: 0 in exact arithmetic, because batch norm subtracts the batch mean. The fused op
  returns exactly 0, and must.
- a scale before batch norm: it acts only through eps, so its gradient is small, and eager's sum
  cancels to mostly noise (in a bf16 model its error is many times the value). The fused op has a closed
  form; it must be within a relative FLOAT64_ONLY_RTOL of float64 each step, with float64's sign.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fusepass.numerics import no_further_than_eager, rel_error

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])]

SOFTMAX_SPELLINGS = {
    "module": lambda t: nn.Softmax(dim=1)(t),
    "functional": lambda t: F.softmax(t, dim=-1),
    "torch": lambda t: torch.softmax(t, 1),
    "method": lambda t: t.softmax(-1),
    "dtype": lambda t: F.softmax(t, dim=1, dtype=torch.float32),
    "dim0": lambda t: F.softmax(t, dim=0),  # not the feature dim: must not be fused
}


class ChainModel(nn.Module):
    """linear -> [* scale] -> BatchNorm1d -> [* scale_after] -> [softmax], in the spellings users write.

    A scale is None (absent), "per_feature", "single" (shape (1,)), "zero_dim" or "number"."""

    def __init__(self, in_features=32, out_features=48, *, bias=True, scale="per_feature", scale_first=False,
                 torch_mul=False, affine=True, track_running_stats=True, momentum=0.1, eps=1e-5,
                 scale_after=None, softmax=None):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.scale = _make_scale(scale, out_features)
        self.scale_after = _make_scale(scale_after, out_features)
        self.scale_first, self.torch_mul, self.softmax = scale_first, torch_mul, softmax
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum, affine=affine,
                                 track_running_stats=track_running_stats)
        randomize_batch_norm(self.bn)

    def exact_training_grads(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(parameters whose training gradient is exactly 0, parameters judged against float64 alone),
        as the fused op computes them (Trio)."""
        zero = ("linear.bias",) if self.linear.bias is not None else ()
        return zero, ("scale",) if isinstance(self.scale, nn.Parameter) else ()

    def _mul(self, t, s):
        a, b = (s, t) if self.scale_first else (t, s)
        return torch.mul(a, b) if self.torch_mul else a * b

    def forward(self, x):
        y = self.linear(x)
        if self.scale is not None:
            y = self._mul(y, self.scale)
        y = self.bn(y)
        if self.scale_after is not None:
            y = self._mul(y, self.scale_after)
        return SOFTMAX_SPELLINGS[self.softmax](y) if self.softmax else y


def _make_scale(kind, out_features):
    if kind is None or kind == "number":
        return None if kind is None else 1.7
    shape = {"per_feature": (out_features,), "single": (1,), "zero_dim": ()}[kind]
    return nn.Parameter(torch.randn(shape) * 0.5 + 1.0)


# --------------------------------------------------------------------------- models around the family


class TwoChains(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = ChainModel(), ChainModel(48, 16)

    def forward(self, x):
        return self.b(self.a(x))


class SecondUser(nn.Module):
    """The linear output (or the scaled one) is also used elsewhere: fusing would lose it."""

    def __init__(self, reuse):
        super().__init__()
        self.linear, self.bn, self.reuse = nn.Linear(32, 48), nn.BatchNorm1d(48), reuse
        self.scale = nn.Parameter(torch.randn(48))

    def forward(self, x):
        y = self.linear(x)
        z = y * self.scale
        return self.bn(z) + (y if self.reuse == "linear" else z)


class Between(nn.Module):
    """Something other than a scale between linear and batch_norm."""

    def __init__(self, op):
        super().__init__()
        # "add": batch norm would cancel the biases of both linears, and their gradients would be rounding
        # noise; without them the comparison with eager means something.
        bias = op != "add"
        self.linear, self.bn, self.op = nn.Linear(32, 48, bias=bias), nn.BatchNorm1d(48), op
        self.other = nn.Linear(32, 48, bias=False) if op == "add" else None

    def forward(self, x):
        y = self.linear(x)
        if self.op == "relu":
            return self.bn(torch.relu(y) * 2.0)
        if self.op == "add":
            return self.bn(y + self.other(x))
        return self.bn(y * torch.ones_like(y))  # "full_tensor_scale"


class ThreeD(nn.Module):
    """Linear on a 3-D input (N, C, 32) -> (N, C, 6), batch norm over C."""

    def __init__(self):
        super().__init__()
        self.linear, self.bn = nn.Linear(32, 6), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.linear(x) * 2.0)


def randomize_batch_norm(bn: nn.BatchNorm1d) -> None:
    """Non-trivial affine parameters and running statistics, so that none of them can hide a bug."""
    with torch.no_grad():
        if bn.affine:
            bn.weight.copy_(torch.randn_like(bn.weight) * 0.5 + 1.0)
            bn.bias.copy_(torch.randn_like(bn.bias))
        if bn.track_running_stats:
            bn.running_mean.copy_(torch.randn_like(bn.running_mean) * 0.1)
            bn.running_var.copy_(torch.rand_like(bn.running_var) + 0.5)


# Relative error to float64 allowed for a gradient judged against float64 alone: where the linear runs in
# fp32, and where it rounds to fewer bits (bf16, fp16, TF32). Where it rounds, float64 is not the exact
# value of the model that ran (its linear output is not rounded), so the bound only tells a right gradient
# from a zeroed one (error exactly 1) or one of the wrong sign (error >= 1). Measured for pre-batch-norm
# scales: fp32 <= 6.1e-6 (CPU); a bf16/fp16 linear output <= 0.054 on CPU and 0.38 on an H200 (bf16
# autocast, per-feature scale).
FLOAT64_ONLY_RTOL = {"fp32": 1e-3, "rounded": 0.75}
# Below this, a float64 value counts as 0: the relative and sign checks then become |fused| <= this.
FLOAT64_ZERO = 1e-12


def assert_fused(rewrites: int, graphs: Optional[int] = None, linears: Optional[int] = None) -> None:
    """fusepass's counters since the test began: exactly `rewrites` fused chains in use, no graph fell
    back, and, if given, exactly `graphs` graphs compiled and `linears` bare linears on fusepass's op."""
    stats = counters["fusepass"]
    assert stats["fallbacks"] == 0, f"{stats['fallbacks']} graph(s) fell back: {dict(stats)}"
    assert stats["rewrites"] == rewrites, f"expected {rewrites} rewrite(s): {dict(stats)}"
    if linears is not None:
        assert stats["linears"] == linears, f"expected {linears} bare linear(s): {dict(stats)}"
    if graphs is not None:
        assert stats["graphs"] == graphs, f"expected {graphs} graph(s): {dict(stats)}"


def assert_no_further_from_float64(what: str, fused: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> None:
    _check_errors(what, *_errors(what, fused, eager, ref))


def _check_comparable(what, fused, eager, ref) -> None:
    assert fused.shape == eager.shape and fused.dtype == eager.dtype, f"{what}: {fused.shape}/{fused.dtype} vs eager"
    assert torch.isfinite(ref).all(), f"{what}: float64 reference is not finite"


def _errors(what, fused, eager, ref) -> tuple[float, float]:
    _check_comparable(what, fused, eager, ref)
    return rel_error(fused, ref), rel_error(eager, ref)


def _check_errors(what: str, fused_err: float, eager_err: float) -> None:
    assert no_further_than_eager(fused_err, eager_err), (
        f"{what}: fusepass is {fused_err:.3g} from float64, eager {eager_err:.3g}")


@dataclass
class Trio:
    """The same model three times: eager, compiled with fusepass, and a float64 reference.

    In training, the gradients of `zero_grads` must be exactly 0 and those of `float64_grads` within
    FLOAT64_ONLY_RTOL of float64 (tests/chains.py's docstring says why); these describe the fused op, so
    a model whose chains are not fused passes empty ones. Trio.of takes them from the model
    (ChainModel.exact_training_grads) or else assumes each nn.Linear feeds a fused batch norm (its bias's
    training gradient is exactly 0). `dynamic_batch` marks the fused model's input batch dim dynamic."""

    eager: nn.Module
    fused: nn.Module
    ref: nn.Module
    compiled: object
    zero_grads: tuple = ()
    float64_grads: tuple = ()
    dynamic_batch: bool = False
    # Around the fused model's backward (e.g. compiled autograd's context); the others' run eagerly.
    fused_backward: Callable[[], Any] = nullcontext
    # (what, "train" or "eval") -> [(fused, eager, float64 value)] per step
    scalar_values: dict = field(default_factory=dict)
    _phase: str = field(default="train", init=False)  # of the current step
    _float64_rtol: float = field(default=FLOAT64_ONLY_RTOL["fp32"], init=False)

    @classmethod
    def of(cls, model: nn.Module, options: Optional[dict] = None, mode: Optional[str] = None, *,
           zero_grads: Optional[tuple] = None, float64_grads: Optional[tuple] = None,
           dynamic_batch: bool = False, dynamic: Optional[bool] = None) -> "Trio":
        default_zero, default_float64 = exact_training_grads(model)
        zero_grads = tuple(default_zero if zero_grads is None else zero_grads)
        float64_grads = tuple(default_float64 if float64_grads is None else float64_grads)
        names = dict(model.named_parameters())
        assert all(name in names for name in zero_grads + float64_grads), (zero_grads, float64_grads)
        fused = copy.deepcopy(model)
        compiled = torch.compile(fused, backend="fusepass", options=options, mode=mode, dynamic=dynamic)
        return cls(copy.deepcopy(model), fused, copy.deepcopy(model).double(), compiled,
                   zero_grads=zero_grads, float64_grads=float64_grads, dynamic_batch=dynamic_batch)

    def compare(self, what: str, fused: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> None:
        errors = _errors(what, fused, eager, ref)
        if fused.numel() == 1:
            values = self.scalar_values.setdefault((what, self._phase), [])
            values.append(tuple(t.double().item() for t in (fused, eager, ref)))
        else:
            _check_errors(what, *errors)

    def finish(self) -> None:
        """The criterion for one-element quantities, on their values over the steps run so far, training
        steps and eval steps apart."""
        for (what, phase), values in self.scalar_values.items():
            fused, eager, ref = (torch.tensor(v, dtype=torch.float64) for v in zip(*values))
            _check_errors(f"{what} ({phase}, over {len(values)} steps)", rel_error(fused, ref), rel_error(eager, ref))

    def train(self, mode: bool) -> None:
        for m in (self.eager, self.fused, self.ref):
            m.train(mode)

    def step(self, x: torch.Tensor, autocast_dtype: Optional[torch.dtype] = None) -> None:
        """One forward + backward of all three on x, then the float64 comparison of everything."""
        ctx = (lambda: torch.autocast(x.device.type, dtype=autocast_dtype)) if autocast_dtype else nullcontext
        model_dtype = next(self.eager.parameters()).dtype
        self._phase = "train" if self.fused.training else "eval"
        linear_dtype = autocast_dtype or model_dtype
        tf32 = x.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
        exact = linear_dtype == torch.float64 or (linear_dtype == torch.float32 and not tf32)
        self._float64_rtol = FLOAT64_ONLY_RTOL["fp32" if exact else "rounded"]
        outs, inputs, projection = {}, {}, None
        for name, fn, dtype, run_ctx in (("eager", self.eager, model_dtype, ctx),
                                         ("fused", self.compiled, model_dtype, ctx),
                                         ("ref", self.ref, torch.float64, nullcontext)):
            # A copy per provider: each must get its own x.grad.
            inputs[name] = x.detach().to(dtype, copy=True).requires_grad_(torch.is_grad_enabled())
            if name == "fused" and self.dynamic_batch:
                torch._dynamo.mark_dynamic(inputs[name], 0)
            with run_ctx():
                out = fn(inputs[name])
            if projection is None:  # a random upstream gradient, the same for all three
                projection = torch.randn(out.shape, device=x.device, dtype=torch.float64)
            if out.requires_grad:
                with (self.fused_backward if name == "fused" else nullcontext)():
                    (out.double() * projection).sum().backward()
            outs[name] = out
        self.compare("output", outs["fused"], outs["eager"], outs["ref"])
        assert len({id(t) for t in inputs.values()}) == 3
        if inputs["ref"].grad is not None:
            self.compare("grad x", inputs["fused"].grad, inputs["eager"].grad, inputs["ref"].grad)
        self._compare_state()

    def _compare_state(self) -> None:
        named = zip(self.eager.named_parameters(), self.fused.named_parameters(), self.ref.named_parameters())
        for (name, p_eager), (_, p_fused), (_, p_ref) in named:
            if p_ref.grad is None:
                continue
            assert p_fused.grad is not None, f"no gradient for {name}"
            if self._phase == "train" and name in self.zero_grads:
                _check_exactly_zero(f"grad {name}", p_fused.grad, p_eager.grad, p_ref.grad)
                continue  # "no further than eager" would compare rounding noise of an exact 0
            if self._phase == "train" and name in self.float64_grads:
                _check_against_float64(f"grad {name}", p_fused.grad, p_ref.grad, self._float64_rtol)
            self.compare(f"grad {name}", p_fused.grad, p_eager.grad, p_ref.grad)
        buffers = zip(self.eager.named_buffers(), self.fused.named_buffers(), self.ref.named_buffers())
        for (name, b_eager), (_, b_fused), (_, b_ref) in buffers:
            if b_eager.is_floating_point():
                self.compare(f"buffer {name}", b_fused, b_eager, b_ref)
            else:
                assert torch.equal(b_fused, b_eager), f"buffer {name}: {b_fused} vs eager {b_eager}"
        for m in (self.eager, self.fused, self.ref):
            m.zero_grad(set_to_none=True)


def exact_training_grads(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Trio's default (zero_grads, float64_grads) for `model`."""
    if isinstance(model, (ChainModel, MLP)):
        return model.exact_training_grads()
    linear_biases = tuple(f"{name}.bias" for name, m in model.named_modules()
                          if isinstance(m, nn.Linear) and m.bias is not None)
    return linear_biases, ()


def _check_exactly_zero(what: str, fused: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> None:
    # That the value is 0 in exact arithmetic: float64's rounding noise is far below eager's.
    assert ref.double().norm() <= 1e-6 * eager.double().norm(), (
        f"{what}: float64 {ref.double().norm():.3g} vs eager {eager.double().norm():.3g} - not 0 in exact "
        "arithmetic, so not a gradient to expect exactly 0")
    assert fused.shape == ref.shape and fused.dtype == eager.dtype, f"{what}: {fused.shape}/{fused.dtype}"
    assert torch.count_nonzero(fused) == 0, (
        f"{what}: must be exactly 0, fusepass has max |value| {fused.abs().max():.3g}")


def _check_against_float64(what: str, fused: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    """One step's value within `rtol` of float64, and of the same sign where one-element."""
    fused, ref = fused.double(), ref.double()
    assert fused.shape == ref.shape, f"{what}: {fused.shape} vs float64 {ref.shape}"
    error, size = (fused - ref).norm().item(), ref.norm().item()
    assert error <= rtol * size + FLOAT64_ZERO, (
        f"{what}: fusepass {fused.flatten()[:4].tolist()} vs float64 {ref.flatten()[:4].tolist()}: relative "
        f"error {error / max(size, 1e-300):.3g} > {rtol:g}")
    if ref.numel() == 1 and size > FLOAT64_ZERO:
        assert torch.sign(fused) == torch.sign(ref), f"{what}: fusepass {fused.item():.6g}, float64 {ref.item():.6g}"


def make_input(batch: int, in_features: int, device: str = "cpu") -> torch.Tensor:
    """Fresh random input with a non-zero mean, so batch statistics are not centred already."""
    return torch.randn(batch, in_features, device=device) * 2.0 + 0.5


def fusepass_stats() -> dict:
    return dict(counters["fusepass"])


def fusepass_counts() -> dict:
    """All three of fusepass's counters, 0 where not counted yet."""
    return {key: counters["fusepass"][key] for key in ("graphs", "rewrites", "fallbacks")}


class MLP(nn.Sequential):
    """torchvision.ops.MLP(in, hidden, norm_layer=nn.BatchNorm1d) as torchvision builds it: per hidden
    layer Linear -> BatchNorm1d -> ReLU -> Dropout(0.0), the last layer a bare Linear -> Dropout(0.0)."""

    def __init__(self, in_features: int, hidden: list[int]):
        layers = []
        for out_features in hidden[:-1]:
            bn = nn.BatchNorm1d(out_features)
            randomize_batch_norm(bn)
            layers += [nn.Linear(in_features, out_features), bn, nn.ReLU(), nn.Dropout(0.0)]
            in_features = out_features
        super().__init__(*layers, nn.Linear(in_features, hidden[-1]), nn.Dropout(0.0))

    def exact_training_grads(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The hidden linears' biases (each feeds a batch norm); not the last one's."""
        return tuple(f"{i}.bias" for i, m in enumerate(self) if isinstance(m, nn.Linear))[:-1], ()
