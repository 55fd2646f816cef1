"""The fused op's arguments and outputs, described once.

`ChainArgs` is the op's signature: one group per step of the chain
`linear -> [* scale_before] -> batch_norm -> [pointwise tail] -> [softmax]`, plus what the op returns
and how it runs. The op's registered schema, the fake, the reference, the implementations, the
autograd context and the graph rewrite all take their arguments from it, by name. Adding a step to the
chain means adding a group here: the schema follows.

The op itself takes the groups flattened, in field order (`flatten` / `unflatten`), named
`<group>_<field>` (`linear_x`, `scale_before_tensor`, ...): torch.library schemas hold no structures.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional

import torch
from torch import Tensor

from fusepass.lowering import pointwise
from fusepass.lowering.tiles import scale_mode

FP32_MATMUL = ("tf32x3", "ieee")
GEMM_CHOICES = ("auto", "triton", "cublas")
# The 16-bit float dtypes: autocast's, the ones the GEMMs multiply natively, and the ones whose products
# fusepass::linear can return in fp32.
FLOAT16_DTYPES = (torch.bfloat16, torch.float16)


def op_casts_weight(weight_dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
    """Whether the op takes the weight as the model holds it and casts it for its GEMM itself: an fp32
    weight under autocast. Its gradient then comes out of the GEMM's fp32 accumulators in fp32, instead of
    being rounded to the autocast dtype and cast back."""
    return weight_dtype == torch.float32 and compute_dtype in FLOAT16_DTYPES


@dataclass(frozen=True)
class Linear:
    x: Tensor  # (N, K), in the GEMM's dtype
    weight: Tensor  # (F, K), in x's dtype, or fp32 under autocast (casts_weight)
    bias: Optional[Tensor]  # (F,), in x's dtype

    @property
    def casts_weight(self) -> bool:
        """Whether the GEMM runs on a cast of the weight: an fp32 weight under autocast."""
        return self.weight.dtype != self.x.dtype

    def in_compute_dtype(self) -> "Linear":
        """The linear with its weight in x's dtype: itself, or with the autocast cast of the weight."""
        if not self.casts_weight:
            return self
        return dataclasses.replace(self, weight=self.weight.to(self.x.dtype))

    def compute_weight_like(self) -> Tensor:
        """The weight the GEMM reads, for limits.py to check: the weight itself, or for a cast (made later,
        in a buffer of its own) a meta tensor shaped, strided and typed like it."""
        if not self.casts_weight:
            return self.weight
        w = self.weight
        return torch.empty_strided(w.shape, w.stride(), dtype=self.x.dtype, device="meta")

    def validate(self) -> None:
        """Eager's dtype check, but for the fp32 weight that autocast casts."""
        x, weight, bias = self.x, self.weight, self.bias
        cast_weight = op_casts_weight(weight.dtype, x.dtype)
        if (weight.dtype != x.dtype and not cast_weight) or (bias is not None and bias.dtype != x.dtype):
            raise RuntimeError(f"mat1 and mat2 must have the same dtype, but got {x.dtype} and {weight.dtype}")


@dataclass(frozen=True)
class Scale:
    """A multiply step: by a tensor of shape (F,), (1,) or (), or by a Python number. An absent step is
    the number 1.0."""
    tensor: Optional[Tensor] = None
    value: float = 1.0

    @property
    def mode(self) -> int:
        """How the kernels read it (tiles.SCALE_NUMBER / SCALE_SINGLE / SCALE_PER_FEATURE)."""
        return scale_mode(self.tensor)

    def factor(self):
        """The scale as PyTorch math multiplies by it, in fp32."""
        return self.tensor.float() if self.tensor is not None else self.value


@dataclass(frozen=True)
class Tail:
    """The pointwise ops after batch norm (pointwise.py): the program's text ("" for none) and its tensor
    operands, numbered from 0 (t0..t3 in the text); each of shape (F,), (1,) or ()."""
    program: str = ""
    tensor_0: Optional[Tensor] = None
    tensor_1: Optional[Tensor] = None
    tensor_2: Optional[Tensor] = None
    tensor_3: Optional[Tensor] = None

    @property
    def tensors(self) -> tuple[Optional[Tensor], ...]:
        return (self.tensor_0, self.tensor_1, self.tensor_2, self.tensor_3)


@dataclass(frozen=True)
class BatchNorm:
    weight: Optional[Tensor]  # gamma
    bias: Optional[Tensor]  # beta
    running_mean: Optional[Tensor]
    running_var: Optional[Tensor]
    training: bool
    momentum: float
    eps: float
    # SyncBatchNorm: the process group (its name) whose ranks' batch statistics are merged in training;
    # "" for a batch norm of the rank's own batch
    group_name: str = ""

    @property
    def updates_running_stats(self) -> bool:
        return self.training and self.running_mean is not None

    @property
    def synced(self) -> bool:
        return self.training and bool(self.group_name)


@dataclass(frozen=True)
class KernelOptions:
    """How the CUDA implementation runs (the backend's options `fp32_matmul`, `gemm` and `operand_copies`, and
    its mode's CUDA graphs)."""
    fp32_matmul: str = "tf32x3"  # "tf32x3" (fp32-accurate on tensor cores) or "ieee" (plain fp32 FMA)
    gemm: str = "auto"  # "auto" (time the implementations), "triton" or "cublas"
    # Whether an fp32 GEMM may copy an operand to read it faster: split into tf32 halves, or made K-major
    # (the backward's transposed operands, which grow with the batch)
    operand_copies: bool = True
    # Whether the compiled graph replays its launches from CUDA graphs (Inductor's triton.cudagraphs, set by
    # the modes reduce-overhead and max-autotune): a kernel launched from Python costs no host time per step
    cuda_graphs: bool = False

    def validate(self) -> None:
        for key, value, valid in (("fp32_matmul", self.fp32_matmul, FP32_MATMUL), ("gemm", self.gemm, GEMM_CHOICES),
                                  ("operand_copies", self.operand_copies, (True, False)),
                                  ("cuda_graphs", self.cuda_graphs, (True, False))):
            if not isinstance(value, type(valid[0])) or value not in valid:
                raise ValueError(f"fusepass: {key} must be one of {valid}, got {value!r}")


@dataclass(frozen=True)
class ChainArgs:
    linear: Linear
    scale_before: Scale
    batch_norm: BatchNorm
    tail: Tail
    softmax: bool  # softmax over the features, max-subtracted, in fp32
    out_dtype: torch.dtype
    save_linear_out: bool  # also return the linear output: the backward needs it
    kernel: KernelOptions
    input_grad: bool = True  # the backward makes x's gradient (its dX GEMM reads the weight)

    def validate(self) -> None:
        """The checks eager makes (with eager's messages) and the kernel options'."""
        self.kernel.validate()
        self.linear.validate()
        if self.batch_norm.training and not self.batch_norm.synced and self.linear.x.shape[0] == 1:
            raise ValueError("Expected more than 1 value per channel when training, got input size "
                             f"{torch.Size((1, self.linear.weight.shape[0]))}")
        if not self.batch_norm.training and self.batch_norm.running_mean is None:
            raise ValueError("batch_norm in eval mode needs running statistics")
        if pointwise.tensor_count(self.tail.program) > sum(t is not None for t in self.tail.tensors):
            raise ValueError(f"fusepass: the tail {self.tail.program!r} reads a tensor operand it was not given")

    @property
    def n_features(self) -> int:
        return self.linear.weight.shape[0]

    @property
    def returns_compute_weight(self) -> bool:
        """Whether the op returns its cast of the weight: the backward's dX GEMM reads it (as eager's
        autocast keeps its cast for the backward), so no second cast runs."""
        return self.linear.casts_weight and self.save_linear_out and self.input_grad

    def in_compute_dtype(self) -> "ChainArgs":
        return dataclasses.replace(self, linear=self.linear.in_compute_dtype())

    def compute_weight_output(self, run: "ChainArgs") -> Tensor:
        """The op's compute_weight output, from the arguments it ran with (in_compute_dtype's, or its own
        where its GEMM cast the weight's tiles itself)."""
        if self.returns_compute_weight:
            return run.linear.in_compute_dtype().weight
        return run.linear.x.new_empty(0)


class ChainOutputs(NamedTuple):
    out: Tensor  # the chain's result, in out_dtype
    new_running_mean: Tensor  # empty unless the batch norm updates running statistics
    new_running_var: Tensor
    linear_out: Tensor  # empty unless save_linear_out
    mean: Tensor  # fp32 (F,): the statistics the output was normalized with
    invstd: Tensor
    compute_weight: Tensor  # the weight cast to x's dtype where returns_compute_weight, else empty


# --------------------------------------------------------------------------- flattening


@functools.cache
def _fields(cls) -> tuple[tuple[str, Any], ...]:
    """(name, type) of a dataclass's fields. Cached: get_type_hints evaluates the annotations' text, which
    took 0.2 ms per bind of the op's arguments (measured on a 2-core CPU; each opaque call binds them)."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def flat_fields(cls=ChainArgs, prefix: str = "") -> list[tuple[str, Any]]:
    """(op argument name, type) of every leaf of `cls`, in the op's order."""
    leaves = []
    for name, hint in _fields(cls):
        if dataclasses.is_dataclass(hint):
            leaves += flat_fields(hint, f"{prefix}{name}_")
        else:
            leaves.append((prefix + name, hint))
    return leaves


def flatten(args: ChainArgs) -> tuple:
    """The op's positional arguments for `args` (tensors, numbers, or FX nodes standing for them)."""
    values = []
    for name, group in _groups(type(args)):
        value = getattr(args, name)
        values += flatten(value) if group and dataclasses.is_dataclass(value) else [value]
    return tuple(values)


@functools.cache
def _groups(cls) -> tuple[tuple[str, bool], ...]:
    """(name, whether it is a group of fields) of each field of `cls`. Flatten runs at every opaque call,
    twice while choosing: asking each value instead took 11 us a flatten, against 3 (2-core CPU)."""
    return tuple((name, dataclasses.is_dataclass(hint)) for name, hint in _fields(cls))


def unflatten(values, cls=ChainArgs):
    """`cls` from the op's positional arguments (or anything else laid out the same way, such as
    autograd's needs_input_grad)."""
    return _unflatten(iter(values), cls)


def _unflatten(values: Iterator, cls):
    return cls(**{name: _unflatten(values, hint) if dataclasses.is_dataclass(hint) else next(values)
                  for name, hint in _fields(cls)})


FLAT_NAMES = tuple(name for name, _ in flat_fields())


def gradients_in_op_order(grads: dict[str, Optional[Tensor]]) -> tuple:
    """Autograd's tuple of input gradients from {op argument name: gradient}; None for the rest."""
    unknown = set(grads) - set(FLAT_NAMES)
    if unknown:
        raise KeyError(f"not arguments of the fused op: {sorted(unknown)}")
    return tuple(grads.get(name) for name in FLAT_NAMES)


def with_op_signature(fn):
    """Gives `fn(*args)` the op's signature, so that torch.library infers the schema from ChainArgs."""
    parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hint)
                  for name, hint in flat_fields()]
    fn.__signature__ = inspect.Signature(parameters, return_annotation=tuple[(Tensor,) * len(ChainOutputs._fields)])
    fn.__annotations__ = {**{name: hint for name, hint in flat_fields()}, "return": fn.__signature__.return_annotation}
    return fn


def bind(args: tuple, kwargs: dict) -> ChainArgs:
    """ChainArgs from a call of a function that has the op's signature."""
    if kwargs:
        positions = {name: i for i, name in enumerate(FLAT_NAMES)}
        values = list(args) + [None] * (len(FLAT_NAMES) - len(args))
        for name, value in kwargs.items():
            values[positions[name]] = value
        args = tuple(values)
    return unflatten(args)
