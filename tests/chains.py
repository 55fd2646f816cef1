"""Test models for the linear -> scale -> batch_norm family, and the float64 criterion.

"Numerically identical" means: fusepass is no further from a float64 copy of the model than eager
PyTorch is. Each comparison measures both against the float64 run on the same inputs.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])]

# fusepass's relative error to float64 may exceed eager's by this factor, plus a floor of a few units
# of fp32 roundoff (all reductions accumulate in fp32; two equally exact summation orders land a few
# ulps apart). The floor is far below eager's own error for bf16/fp16 results.
SLACK = 1.5
FLOOR = 4 * torch.finfo(torch.float32).eps


class ChainModel(nn.Module):
    """linear -> multiply by a scale -> BatchNorm1d, in the spellings users write."""

    def __init__(self, in_features=32, out_features=48, *, bias=True, scale="per_feature", scale_first=False,
                 torch_mul=False, affine=True, track_running_stats=True, momentum=0.1, eps=1e-5):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        if scale == "number":
            self.scale = 1.7
        else:
            shape = {"per_feature": (out_features,), "single": (1,), "zero_dim": ()}[scale]
            self.scale = nn.Parameter(torch.randn(shape) * 0.5 + 1.0)
        self.scale_first, self.torch_mul = scale_first, torch_mul
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum, affine=affine,
                                 track_running_stats=track_running_stats)
        randomize_batch_norm(self.bn)

    def forward(self, x):
        y = self.linear(x)
        a, b = (self.scale, y) if self.scale_first else (y, self.scale)
        return self.bn(torch.mul(a, b) if self.torch_mul else a * b)


def randomize_batch_norm(bn: nn.BatchNorm1d) -> None:
    """Non-trivial affine parameters and running statistics, so that none of them can hide a bug."""
    with torch.no_grad():
        if bn.affine:
            bn.weight.copy_(torch.randn_like(bn.weight) * 0.5 + 1.0)
            bn.bias.copy_(torch.randn_like(bn.bias))
        if bn.track_running_stats:
            bn.running_mean.copy_(torch.randn_like(bn.running_mean) * 0.1)
            bn.running_var.copy_(torch.rand_like(bn.running_var) + 0.5)


def rel_error(value: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((value.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_no_further_from_float64(what: str, fused: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> None:
    assert fused.shape == eager.shape and fused.dtype == eager.dtype, f"{what}: {fused.shape}/{fused.dtype} vs eager"
    assert torch.isfinite(ref).all(), f"{what}: float64 reference is not finite"
    fused_err, eager_err = rel_error(fused, ref), rel_error(eager, ref)
    assert fused_err <= SLACK * eager_err + FLOOR, (
        f"{what}: fusepass is {fused_err:.3g} from float64, eager {eager_err:.3g}")


@dataclass
class Trio:
    """The same model three times: eager, compiled with fusepass, and a float64 reference."""

    eager: nn.Module
    fused: nn.Module
    ref: nn.Module
    compiled: object

    @classmethod
    def of(cls, model: nn.Module, options: Optional[dict] = None, mode: Optional[str] = None) -> "Trio":
        fused = copy.deepcopy(model)
        compiled = torch.compile(fused, backend="fusepass", options=options, mode=mode)
        return cls(copy.deepcopy(model), fused, copy.deepcopy(model).double(), compiled)

    def train(self, mode: bool) -> None:
        for m in (self.eager, self.fused, self.ref):
            m.train(mode)

    def step(self, x: torch.Tensor, autocast_dtype: Optional[torch.dtype] = None) -> None:
        """One forward + backward of all three on x, then the float64 comparison of everything."""
        ctx = (lambda: torch.autocast(x.device.type, dtype=autocast_dtype)) if autocast_dtype else nullcontext
        model_dtype = next(self.eager.parameters()).dtype
        outs, inputs, projection = {}, {}, None
        for name, fn, dtype, run_ctx in (("eager", self.eager, model_dtype, ctx),
                                         ("fused", self.compiled, model_dtype, ctx),
                                         ("ref", self.ref, torch.float64, nullcontext)):
            # A copy per provider: each must get its own x.grad.
            inputs[name] = x.detach().to(dtype, copy=True).requires_grad_(torch.is_grad_enabled())
            with run_ctx():
                out = fn(inputs[name])
            if projection is None:  # a random upstream gradient, the same for all three
                projection = torch.randn(out.shape, device=x.device, dtype=torch.float64)
            if out.requires_grad:
                (out.double() * projection).sum().backward()
            outs[name] = out
        assert_no_further_from_float64("output", outs["fused"], outs["eager"], outs["ref"])
        assert len({id(t) for t in inputs.values()}) == 3
        if inputs["ref"].grad is not None:
            assert_no_further_from_float64("grad x", inputs["fused"].grad, inputs["eager"].grad, inputs["ref"].grad)
        self._compare_state()

    def _compare_state(self) -> None:
        named = zip(self.eager.named_parameters(), self.fused.named_parameters(), self.ref.named_parameters())
        for (name, p_eager), (_, p_fused), (_, p_ref) in named:
            if p_ref.grad is None:
                continue
            assert p_fused.grad is not None, f"no gradient for {name}"
            assert_no_further_from_float64(f"grad {name}", p_fused.grad, p_eager.grad, p_ref.grad)
        buffers = zip(self.eager.named_buffers(), self.fused.named_buffers(), self.ref.named_buffers())
        for (name, b_eager), (_, b_fused), (_, b_ref) in buffers:
            if b_eager.is_floating_point():
                assert_no_further_from_float64(f"buffer {name}", b_fused, b_eager, b_ref)
            else:
                assert torch.equal(b_fused, b_eager), f"buffer {name}: {b_fused} vs eager {b_eager}"
        for m in (self.eager, self.fused, self.ref):
            m.zero_grad(set_to_none=True)


def make_input(batch: int, in_features: int, device: str = "cpu") -> torch.Tensor:
    """Fresh random input with a non-zero mean, so batch statistics are not centred already."""
    return torch.randn(batch, in_features, device=device) * 2.0 + 0.5


def fusepass_stats() -> dict:
    return dict(counters["fusepass"])
