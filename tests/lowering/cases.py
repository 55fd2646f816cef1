"""Arguments of the fused op for kernel tests, and the oracle they are judged by: the unfused chain in
eager PyTorch, run once at the arguments' precision ("eager") and once in float64 ("float64"). A fused
result passes when it is no further from float64 than eager's (tests/chains.py). The project's own
`reference` is never the oracle: a bug there would loosen the tests instead of failing them."""

from __future__ import annotations

from typing import NamedTuple, Optional

import pytest
import torch
import torch.nn.functional as F

from fusepass.lowering import normalize
from fusepass.lowering.schema import BatchNorm, ChainArgs, KernelOptions, Linear, Scale, Tail
from tests.chains import assert_no_further_from_float64, requires_cuda

# Where the Triton launchers run: natively on a GPU, else in Triton's interpreter on CPU tensors.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE_KINDS = ("per_feature", "single", "zero_dim", "number")
# Triton's interpreter rounds fp32 to bf16 by truncation and multiplies bf16 tiles as raw bit patterns
# (measured: errors of 4e10), so bf16 kernels are judged on a GPU only; fp16 takes their place on CPU.
HALF_DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=[pytest.mark.cuda, requires_cuda])]


# Tails for kernel tests: name -> (program, kinds of its tensors t0, t1, ..., the same tail in eager PyTorch
# on (u, [t0, t1, ...])). The eager form is written out here, independently of fusepass's op table.
TAILS = {
    "scale_per_feature": ("mul(v0,t0)", ("per_feature",), lambda u, t: u * t[0]),
    "scale_single": ("mul(v0,t0)", ("single",), lambda u, t: u * t[0]),
    "scale_zero_dim": ("mul(v0,t0)", ("zero_dim",), lambda u, t: u * t[0]),
    "scale_number": ("mul(v0,1.3)", (), lambda u, t: u * 1.3),
    "gelu_relu": ("gelu(v0);relu(v1)", (), lambda u, t: F.relu(F.gelu(u))),
    "relu_neg": ("relu(v0);neg(v1)", (), lambda u, t: -F.relu(u)),
    "bias_div_swish": ("add(v0,t0);div(v1,3.0);sigmoid(v2);mul(v2,v3)", ("single",),
                       lambda u, t: (lambda v: v * torch.sigmoid(v))((u + t[0]) / 3.0)),
    "gelu_tanh_leaky": ("gelu_tanh(v0);leaky_relu(v1|0.2)", (),
                        lambda u, t: F.leaky_relu(F.gelu(u, approximate="tanh"), 0.2)),
    "silu_tanh": ("silu(v0);tanh(v1)", (), lambda u, t: torch.tanh(F.silu(u))),
    "hardtanh_clamp": ("hardtanh(v0|-1.5,2.0);clamp(v1|-1.0,1.0);clamp_min(v2|-0.5);clamp_max(v3|0.75)", (),
                       lambda u, t: F.hardtanh(u, -1.5, 2.0).clamp(-1.0, 1.0).clamp_min(-0.5).clamp_max(0.75)),
    "elu_softplus": ("elu(v0|0.7);softplus(v1|2.0,3.0)", (), lambda u, t: F.softplus(F.elu(u, 0.7), 2.0, 3.0)),
    "hardswish_mish": ("hardswish(v0);mish(v1)", (), lambda u, t: F.mish(F.hardswish(u))),
    # The divisor -(t0 - u / 500 + 3) stays away from 0 (eval's u reaches ~100 here): near 0 the tail
    # would magnify the GEMM's rounding, and the comparison would say nothing about the tail.
    "rsub_rdiv_neg": ("mul(v0,0.002);rsub(v1,t0);add(v2,3.0);neg(v3);rdiv(v4,2.0);sub(v5,t1)",
                      ("per_feature", "zero_dim"), lambda u, t: (2.0 / -((t[0] - u * 0.002) + 3.0)) - t[1]),
    "values_dag": ("sigmoid(v0);mul(v0,v1);sub(v2,v0);add(v3,v1)", (),
                   lambda u, t: (lambda s: u * s - u + s)(torch.sigmoid(u))),
}
EAGER_TAILS = {program: fn for program, _, fn in TAILS.values()}


def make_args(n: int, k: int, f: int, *, scale: Optional[str] = "per_feature", scale_after: Optional[str] = None,
              tail: Optional[str] = None, softmax: bool = False, affine: bool = True, running: bool = True,
              training: bool = True,
              momentum: float = 0.1, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
              out_dtype: Optional[torch.dtype] = None, device: str = KERNEL_DEVICE, requires_grad: bool = False,
              save_linear_out: bool = False, kernel: KernelOptions = KernelOptions(), seed: int = 0) -> ChainArgs:
    """Random arguments: no parameter at a value (1, 0) that could hide a bug, batch statistics not
    centred already, running statistics away from their initial values. `tail` names one of TAILS;
    `scale_after` is the tail "scale_<kind>"."""
    g = torch.Generator().manual_seed(seed * 7919 + n * 1000 + f)

    def rand(*shape, shift=0.0, spread=1.0, grad=requires_grad):
        t = (torch.randn(shape, generator=g) * spread + shift).to(device, dtype)
        return t.requires_grad_(grad)

    def make_scale(kind):
        if kind is None:
            return Scale()
        if kind == "number":
            return Scale(value=1.3)
        shape = {"per_feature": (f,), "single": (1,), "zero_dim": ()}[kind]
        return Scale(tensor=rand(*shape, shift=1.0, spread=0.5))

    def make_tail(name):
        if name is None:
            return Tail()
        program, kinds, _ = TAILS[name]
        return Tail(program, *(make_scale(kind).tensor for kind in kinds))

    return ChainArgs(
        linear=Linear(x=rand(n, k, shift=0.5, spread=2.0), weight=rand(f, k), bias=rand(f)),
        scale_before=make_scale(scale),
        batch_norm=BatchNorm(
            weight=rand(f, shift=1.0, spread=0.5) if affine else None, bias=rand(f) if affine else None,
            running_mean=rand(f, spread=0.3, grad=False) if running else None,
            running_var=(torch.rand(f, generator=g) + 0.5).to(device, dtype) if running else None,
            training=training, momentum=momentum, eps=eps),
        tail=make_tail(tail or (scale_after and f"scale_{scale_after}")),
        softmax=softmax,
        out_dtype=out_dtype or dtype,
        save_linear_out=save_linear_out,
        kernel=kernel,
    )


class Unfused(NamedTuple):
    out: torch.Tensor
    new_running_mean: Optional[torch.Tensor]  # None without running statistics or in eval
    new_running_var: Optional[torch.Tensor]
    mean: torch.Tensor
    invstd: torch.Tensor


def unfused(args: ChainArgs, y: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None) -> Unfused:
    """The chain as eager computes it, from the linear output `y` (default: eager's linear), with every
    tensor converted to `dtype` (default: as given; float64 for the ground truth)."""
    def t(value):
        return value.detach().to(dtype) if isinstance(value, torch.Tensor) and dtype is not None else value

    lin, bn = args.linear, args.batch_norm
    if y is None:
        y = F.linear(t(lin.x), t(lin.weight), t(lin.bias))
    y = t(y)
    z = y * (t(args.scale_before.tensor) if args.scale_before.tensor is not None else args.scale_before.value)
    running = [t(r).clone() if r is not None else None for r in (bn.running_mean, bn.running_var)]
    u = F.batch_norm(z, *running, t(bn.weight), t(bn.bias), bn.training, bn.momentum, bn.eps)
    if args.tail.program:
        u = EAGER_TAILS[args.tail.program](u, [t(v) for v in args.tail.tensors if v is not None])
    out = torch.softmax(u, dim=-1) if args.softmax else u
    stats_z = z.float() if z.dtype != torch.float64 else z
    if bn.training:
        var, mean = torch.var_mean(stats_z, dim=0, correction=0)
    else:
        mean, var = running[0].to(stats_z.dtype), running[1].to(stats_z.dtype)
    updated = running if bn.updates_running_stats else [None, None]
    return Unfused(out.to(args.out_dtype) if dtype is None else out, *updated, mean, 1.0 / torch.sqrt(var + bn.eps))


def assert_like_eager(fused, args: ChainArgs, y: Optional[torch.Tensor] = None, *, out=True, stats=True,
                      running=True) -> None:
    """Each of the fused op's outputs (a ChainOutputs, or the passes' (out, Statistics)) no further from
    float64 than eager's, on the same inputs (and linear output y, if given)."""
    eager, exact = unfused(args, y), unfused(args, y, torch.float64)
    if out:
        assert fused.out.shape == eager.out.shape and fused.out.dtype == eager.out.dtype
        assert_no_further_from_float64("output", fused.out, eager.out, exact.out)
    if stats:
        assert_no_further_from_float64("mean", fused.mean, eager.mean, exact.mean)
        assert_no_further_from_float64("invstd", fused.invstd, eager.invstd, exact.invstd)
    if running:
        if eager.new_running_mean is None:
            assert fused.new_running_mean.numel() == fused.new_running_var.numel() == 0
        else:
            assert fused.new_running_mean.dtype == eager.new_running_mean.dtype
            assert_no_further_from_float64("new running mean", fused.new_running_mean, eager.new_running_mean,
                                           exact.new_running_mean)
            assert_no_further_from_float64("new running var", fused.new_running_var, eager.new_running_var,
                                           exact.new_running_var)


PASS_KERNELS = ("partial_stats_kernel", "finalize_stats_kernel", "normalize_kernel", "normalize_softmax_kernel")


def record_launches(monkeypatch) -> list[str]:
    """Records, in order, the names of the pass kernels launched from here on."""
    launched = []
    for name in PASS_KERNELS:
        monkeypatch.setattr(normalize, name, _Recording(getattr(normalize, name), name, launched))
    return launched


class _Recording:
    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]
