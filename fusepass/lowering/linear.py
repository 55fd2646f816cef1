"""`torch.ops.fusepass.linear(x, weight, bias, kernel_fp32_matmul, kernel_gemm)`: x @ weight^T + bias for
2-D operands of any strides, on fusepass's Triton GEMM (gemm.py, no epilogue) or on cuBLAS, whichever
is fastest for the problem at the call's precision (timed once per problem, cached like the fused op's
choice). Its autograd formula calls it again: dX = linear(g, W^T), dW = linear(g^T, x^T).

Two users: the fused chain's backward (its dX and dW GEMMs), and the bare-linear family (a linear
outside any chain). In fp32 at the default precision that puts every GEMM of a training step on
3xTF32 tensor-core math, whose error to float64 is below eager's fp32; cuBLAS at the same precision
(IEEE fp32 there: eager's own) is always a candidate, so the op is never slower than cuBLAS.

As the fused op: a triton_op whose body torch.compile traces on CUDA with static shapes; an opaque
twin chooses when it runs; on CPU the twin is F.linear, eager's own.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from fusepass.lowering import gemm, limits, tuning
from fusepass.lowering.choice import (cublas_traceable, gemm_option, matmul_precision, pre_split_precision,
                                      remember, triton_configs, tune)
from fusepass.lowering.implementations import cublas_precision
from fusepass.lowering.launch import OPAQUE_ENV
from fusepass.lowering.schema import Kernel, Linear

OP_NAME = "fusepass::linear"


@dataclass(frozen=True)
class LinearImplementation:
    """The Triton GEMM in `precision` with tile `config` (on K-major copies of the operands where
    `k_major_copies`), or cuBLAS at that precision (config None)."""
    precision: str
    config: Optional[gemm.GemmConfig] = None
    k_major_copies: bool = False

    @property
    def name(self) -> str:
        if self.config is None:
            return "cublas"
        copies = " on K-major copies" if self.k_major_copies else ""
        return f"triton {self.precision} {self.config.describe()}{copies}"

    def __call__(self, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        if self.config is None:
            return _on_cublas(x, weight, bias, self.precision)
        if self.k_major_copies:
            x, weight = _k_major_copy(x), _k_major_copy(weight)
        return gemm.run_gemm(Linear(x, weight, bias), self.precision, self.config).y

    def unlaunchable(self, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Optional[str]:
        """Why this call cannot run on the Triton GEMM (limits.py), or None; cuBLAS always runs."""
        if self.config is None:
            return None
        return limits.first(limits.off_device(x.device, (weight, bias)),
                            gemm.unlaunchable(x, weight, self.precision, self.config))


def _traced_body(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel_fp32_matmul: str,
                 kernel_gemm: str) -> Tensor:
    kernel = Kernel(kernel_fp32_matmul, kernel_gemm)
    run = None
    if x.device.type == "cuda" and not os.environ.get(OPAQUE_ENV):
        _validate(x, weight, bias, kernel)
        traced = is_fake(x)
        if not traced or _static(x, weight, bias):
            run = choose(x, weight, bias, kernel, traced=traced)
    if run is None:
        return torch.ops.fusepass.linear_opaque(x, weight, bias, kernel_fp32_matmul, kernel_gemm)
    return _launch_checked(run, x, weight, bias)


def _launch_checked(run: LinearImplementation, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """`run` where its kernels can launch for this call (checked on every call), else cuBLAS at its
    precision (limits.py)."""
    why = run.unlaunchable(x, weight, bias)
    if why is None:
        return run(x, weight, bias)
    limits.record_unlaunchable(OP_NAME, why)
    return LinearImplementation(run.precision)(x, weight, bias)


linear = torch.library.triton_op(OP_NAME, _traced_body, mutates_args=())


def _opaque_default(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel_fp32_matmul: str,
                    kernel_gemm: str) -> Tensor:
    """CPU (and other devices): eager's linear."""
    return F.linear(x, weight, bias)


_opaque = torch.library.custom_op(OP_NAME + "_opaque", _opaque_default, mutates_args=())


@_opaque.register_kernel("cuda")
def _opaque_cuda(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel_fp32_matmul: str,
                 kernel_gemm: str) -> Tensor:
    kernel = Kernel(kernel_fp32_matmul, kernel_gemm)
    _validate(x, weight, bias, kernel)
    return _launch_checked(choose(x, weight, bias, kernel), x, weight, bias)


@_opaque.register_fake
def _fake(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel_fp32_matmul: str, kernel_gemm: str) -> Tensor:
    _validate(x, weight, bias, Kernel(kernel_fp32_matmul, kernel_gemm))
    return x.new_empty((x.shape[0], weight.shape[0]))


def _validate(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel: Kernel) -> None:
    kernel.validate()
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise RuntimeError(f"fusepass.linear: mat1 and mat2 shapes cannot be multiplied "
                           f"({x.shape[0]}x{x.shape[1]} and {weight.shape[1]}x{weight.shape[0]})")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise RuntimeError("fusepass.linear: x, weight and bias must have the same dtype")


def _static(*tensors: Optional[Tensor]) -> bool:
    return all(isinstance(s, int) for t in tensors if t is not None for s in (*t.shape, *t.stride()))


def call(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel: Kernel) -> Tensor:
    return torch.ops.fusepass.linear(x, weight, bias, kernel.fp32_matmul, kernel.gemm)


# --------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs: tuple, output: Tensor) -> None:
    x, weight, bias, fp32_matmul, gemm_choice = inputs
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
    ctx.kernel = Kernel(fp32_matmul, gemm_choice)
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, grad: Tensor) -> tuple:
    x, weight = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_x = call(grad, weight.t(), None, ctx.kernel) if need_x else None
    grad_weight = call(grad.t(), x.t(), None, ctx.kernel) if need_weight else None
    grad_bias = grad.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if need_bias else None
    return grad_x, grad_weight, grad_bias, None, None


linear.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- choice


class LinearKey(NamedTuple):
    """What the choice depends on: shapes, strides' order (which dimension is contiguous), dtypes,
    precision and options."""
    shapes: tuple
    k_major: tuple  # per operand: is K its contiguous dimension
    dtype: torch.dtype
    has_bias: bool
    device: torch.device
    precision: str
    gemm: str
    traced: bool

    def describe(self) -> str:
        (m, k), (n, _) = self.shapes
        layout = "".join("k" if major else "m" for major in self.k_major)
        return (f"{OP_NAME} {m}x{k}@{n}x{k}^T layout={layout} dtype={str(self.dtype).removeprefix('torch.')} "
                f"bias={self.has_bias} precision={self.precision} gemm={self.gemm}" + (" traced" if self.traced else ""))


_CHOSEN: dict[LinearKey, LinearImplementation] = {}


def choose(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel: Kernel,
           traced: bool = False) -> Optional[LinearImplementation]:
    """The fastest implementation for this problem: from the per-process table, else the tuner."""
    precision = matmul_precision(x.dtype, kernel.fp32_matmul)
    gemm_choice = gemm_option(x, weight, kernel.gemm)
    key = LinearKey((tuple(x.shape), tuple(weight.shape)), (_k_major(x), _k_major(weight)), x.dtype,
                    bias is not None, x.device, precision, gemm_choice, traced)
    chosen = _CHOSEN.get(key)
    if chosen is not None:
        return chosen
    candidates = implementations(x, weight, precision, gemm_choice, traced)
    if not candidates:  # traced, none runs inside Inductor's graph: the opaque op chooses when it runs
        return None
    inputs = functools.cache(lambda: _stand_ins(x, weight, bias)) if traced else (lambda: (x, weight, bias))
    name = tune(key.describe(), x.device, {name: _timed(run, inputs) for name, run in candidates.items()}, traced)
    remember(_CHOSEN, key, candidates[name], x.device)
    return candidates[name]


def implementations(x: Tensor, weight: Tensor, precision: str, gemm_choice: str,
                    traced: bool) -> dict[str, LinearImplementation]:
    """Every way to run this linear that the tuner's search times (tuning.search), the default first: the
    Triton GEMM in the call's precision (in fp32 3xTF32 also with the smaller operand split in memory),
    where it can launch for these operands (limits.py), and cuBLAS at the same precision where it can
    run traced. Never empty: cuBLAS untraced always runs.

    Operands whose K is not contiguous (a backward's transposed views) start with the pre-split 3xTF32,
    which reads the split operand K-major from memory: 88-102 TFLOP/s on an H100 where 3xTF32 split in
    registers made 39 (tools/tune_linear.py at 1024 x 8192 -> 8192 and 16384 x 4096 -> 4096). The full
    search also times that, and the GEMM on K-major copies of the operands."""
    candidates: list[LinearImplementation] = []
    search = tuning.search()
    if gemm_choice in ("auto", "triton") and precision != "ieee":
        k_major = _k_major(x) and _k_major(weight)
        precisions = [precision]
        if precision == "tf32x3":
            pre_split = pre_split_precision(x, weight)
            precisions = [precision, pre_split] if k_major else [pre_split] + ([precision] if search == "full" else [])
        candidates += [LinearImplementation(p, config) for p, config in
                       triton_configs(precisions, x, weight.shape[0], tma=not traced)]
        if not k_major and search == "full":
            candidates.append(LinearImplementation(precision, gemm.gemm_configs(precision, x.dtype)[0], True))
        candidates = [c for c in candidates if c.unlaunchable(x, weight, None) is None]
    if gemm_choice in ("auto", "cublas") or not candidates:
        if not traced or cublas_traceable(precision):
            candidates.append(LinearImplementation(precision))
    return {c.name: c for c in candidates}


def _on_cublas(x: Tensor, weight: Tensor, bias: Optional[Tensor], precision: str) -> Tensor:
    with cublas_precision(precision):
        return F.linear(x, weight, bias)


def _k_major(t: Tensor) -> bool:
    return t.stride(1) == 1 or t.shape[1] == 1


def _k_major_copy(t: Tensor) -> Tensor:
    return t if _k_major(t) else t.contiguous()


def _timed(run: LinearImplementation, inputs: Callable[[], tuple]) -> Callable[[], Tensor]:
    return lambda: run(*inputs())


def _stand_ins(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple:
    """Real tensors with the fake ones' shapes, strides and dtypes, for timing while traced."""
    def real(t):
        if t is None:
            return None
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device).normal_()
    return real(x), real(weight), real(bias)
