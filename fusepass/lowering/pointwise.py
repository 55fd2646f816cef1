"""The pointwise tail after batch norm: its ops and the program that strings them together.

Each op is one entry of OPS: its opcode, its forward in PyTorch (eager's own function: the CPU
reference, and what the backward recomputes), its derivative (eager's own backward formula), and its
forward in Triton (a branch of `_pointwise`, next to the entry). Adding an op is one entry, one branch
and its tests.

A tail is a straight-line program over values: v0 is the batch norm's output, instruction i computes
v(i+1) from one earlier value and, for a binary op, a second operand (another earlier value, one of the
tail's tensors, or a Python number), and the last value is the tail's result. Its text form, the op's
`tail_program` argument, is `;`-separated instructions such as `sigmoid(v0);mul(v1,v0);add(v2,t0)`,
with an op's constant parameters after a `|`: `hardtanh(v0|-1.0,1.0)`. A binary op whose value operand
is on the right (`1 - x`, `c / x`) has its own opcode (rsub, rdiv), so the value operand always comes
first. Everything runs in fp32.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from fusepass.lowering.tiles import INTERPRETED, exp_accurate, load_scale, scale_mode

aten = torch.ops.aten
MAX_TAIL_TENSORS = 4  # tensor operands of one tail (each is a pointer argument of the kernels)
MAX_TAIL_OPS = 8

# Opcodes (the first tuple of the kernels' TAIL).
NEG, ADD, SUB, RSUB, MUL, DIV, RDIV = (tl.constexpr(i) for i in range(1, 8))
RELU, LEAKY_RELU, GELU, GELU_TANH, SILU, SIGMOID, TANH = (tl.constexpr(i) for i in range(8, 15))
HARDTANH, CLAMP, CLAMP_MIN, CLAMP_MAX, ELU, SOFTPLUS, HARDSWISH, MISH = (tl.constexpr(i) for i in range(15, 23))

# Native libdevice functions, except in Triton's interpreter (which has none): a constexpr for the kernels.
NATIVE_MATH = tl.constexpr(not INTERPRETED)


# --------------------------------------------------------------------------- Triton forwards


@triton.jit
def _tanh(x):
    """tanh within an ulp or two (libdevice); the interpreter has no libdevice, so there it is a formula
    of exp, accurate to a few fp32 roundoffs, for CPU tests only."""
    if NATIVE_MATH:
        return libdevice.tanh(x)
    else:
        return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _log1p(x):
    if NATIVE_MATH:
        return libdevice.log1p(x)
    else:
        return tl.log(1.0 + x)


@triton.jit
def _expm1(x):
    if NATIVE_MATH:
        return libdevice.expm1(x)
    else:
        return tl.exp(x) - 1.0


@triton.jit
def _clamp(x, low, high):
    """min(max(x, low), high) as eager's clamp: NaN stays NaN (comparisons with it are false), and
    low > high gives high."""
    r = tl.where(x < low, low, x)
    return tl.where(r > high, high, r)


@triton.jit
def _pointwise(x, other, OP: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    """One op on fp32 x (and `other`, for a binary op), written as eager's CUDA kernel computes it."""
    if OP == NEG:
        r = -x
    elif OP == ADD:
        r = x + other
    elif OP == SUB:
        r = x - other
    elif OP == RSUB:
        r = other - x
    elif OP == MUL:
        r = x * other
    elif OP == DIV:
        r = tl.math.div_rn(x, other)
    elif OP == RDIV:
        r = tl.math.div_rn(other, x)
    elif OP == RELU:
        r = tl.where(x < 0.0, 0.0, x)  # NaN stays NaN, as in eager
    elif OP == LEAKY_RELU:
        r = tl.where(x > 0.0, x, x * A)
    elif OP == GELU:
        r = x * 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
    elif OP == GELU_TANH:
        inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
        r = 0.5 * x * (1.0 + _tanh(inner))
    elif OP == SILU:
        r = tl.math.div_rn(x, 1.0 + exp_accurate(-x, NATIVE_MATH))
    elif OP == SIGMOID:
        r = tl.math.div_rn(1.0, 1.0 + exp_accurate(-x, NATIVE_MATH))
    elif OP == TANH:
        r = _tanh(x)
    elif OP == HARDTANH:
        r = _clamp(x, A, B)
    elif OP == CLAMP:
        r = _clamp(x, A, B)
    elif OP == CLAMP_MIN:
        r = tl.where(x < A, A, x)
    elif OP == CLAMP_MAX:
        r = tl.where(x > A, A, x)
    elif OP == ELU:
        r = tl.where(x > 0.0, x, _expm1(x) * A)
    elif OP == SOFTPLUS:
        r = tl.where(x * A > B, x, tl.math.div_rn(_log1p(exp_accurate(x * A, NATIVE_MATH)), A))
    elif OP == HARDSWISH:
        r = tl.math.div_rn(x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0), 6.0)
    elif OP == MISH:
        r = x * _tanh(_log1p(exp_accurate(x, NATIVE_MATH)))
    else:
        r = x
    return r


@triton.jit
def apply_tail(u, cols, col_mask, tensors, TAIL: tl.constexpr):
    """The tail program on an fp32 tile u (the batch norm's output). `tensors` holds the tail's tensor
    pointers; TAIL is the program (tail_program)."""
    # Indexed into constexprs, not unpacked: triton 3.6 cannot unpack a constexpr tuple.
    ops: tl.constexpr = TAIL[0]
    inputs: tl.constexpr = TAIL[1]
    others: tl.constexpr = TAIL[2]
    tensor_index: tl.constexpr = TAIL[3]
    param_a: tl.constexpr = TAIL[4]
    param_b: tl.constexpr = TAIL[5]
    tensor_modes: tl.constexpr = TAIL[6]
    values = (u,)
    for i in tl.static_range(len(ops)):
        x = values[inputs[i]]
        if others[i] >= 0:
            other = values[others[i]]
        elif tensor_index[i] >= 0:
            other = load_scale(tensors[tensor_index[i]], 0.0, cols, col_mask, tensor_modes[tensor_index[i]])[None, :]
        else:
            other = tl.full(u.shape, param_a[i], tl.float32)  # a number operand, rounded to fp32 as eager does
        values = values + (_pointwise(x, other, ops[i], param_a[i], param_b[i]),)
    return values[len(values) - 1]


# --------------------------------------------------------------------------- the ops


@dataclass(frozen=True)
class PointwiseOp:
    name: str  # in the program text and in pattern names
    code: int  # the kernels' opcode
    forward: Callable  # (x, other, a, b) -> eager's result, for fp32 tensors
    derivative: Callable  # (g, x, out, other, a, b) -> (grad of x, grad of other or None): eager's formulas
    binary: bool = False
    n_params: int = 0


def _op(name, code, forward, derivative, **kw) -> PointwiseOp:
    return PointwiseOp(name, code.value, forward, derivative, **kw)


def _where_passes(g: Tensor, condition: Tensor) -> Tensor:
    return torch.where(condition, g, torch.zeros_like(g))


OPS = {op.name: op for op in (
    _op("neg", NEG, lambda x, o, a, b: -x, lambda g, x, out, o, a, b: (-g, None)),
    _op("add", ADD, lambda x, o, a, b: x + o, lambda g, x, out, o, a, b: (g, g), binary=True),
    _op("sub", SUB, lambda x, o, a, b: x - o, lambda g, x, out, o, a, b: (g, -g), binary=True),
    _op("rsub", RSUB, lambda x, o, a, b: o - x, lambda g, x, out, o, a, b: (-g, g), binary=True),
    _op("mul", MUL, lambda x, o, a, b: x * o, lambda g, x, out, o, a, b: (g * o, g * x), binary=True),
    _op("div", DIV, lambda x, o, a, b: x / o, lambda g, x, out, o, a, b: (g / o, -g * x / (o * o)), binary=True),
    _op("rdiv", RDIV, lambda x, o, a, b: o / x, lambda g, x, out, o, a, b: (-g * o / (x * x), g / x), binary=True),
    _op("relu", RELU, lambda x, o, a, b: F.relu(x),
        lambda g, x, out, o, a, b: (aten.threshold_backward(g, out, 0), None)),
    _op("leaky_relu", LEAKY_RELU, lambda x, o, a, b: F.leaky_relu(x, a),
        lambda g, x, out, o, a, b: (aten.leaky_relu_backward(g, x, a, False), None), n_params=1),
    _op("gelu", GELU, lambda x, o, a, b: F.gelu(x),
        lambda g, x, out, o, a, b: (aten.gelu_backward(g, x, approximate="none"), None)),
    _op("gelu_tanh", GELU_TANH, lambda x, o, a, b: F.gelu(x, approximate="tanh"),
        lambda g, x, out, o, a, b: (aten.gelu_backward(g, x, approximate="tanh"), None)),
    _op("silu", SILU, lambda x, o, a, b: F.silu(x), lambda g, x, out, o, a, b: (aten.silu_backward(g, x), None)),
    _op("sigmoid", SIGMOID, lambda x, o, a, b: torch.sigmoid(x),
        lambda g, x, out, o, a, b: (aten.sigmoid_backward(g, out), None)),
    _op("tanh", TANH, lambda x, o, a, b: torch.tanh(x),
        lambda g, x, out, o, a, b: (aten.tanh_backward(g, out), None)),
    # hardtanh and clamp differ at the bounds: hardtanh's gradient is 0 there, clamp's passes.
    _op("hardtanh", HARDTANH, lambda x, o, a, b: F.hardtanh(x, a, b),
        lambda g, x, out, o, a, b: (aten.hardtanh_backward(g, x, a, b), None), n_params=2),
    _op("clamp", CLAMP, lambda x, o, a, b: torch.clamp(x, a, b),
        lambda g, x, out, o, a, b: (_where_passes(g, (x >= a) & (x <= b)), None), n_params=2),
    _op("clamp_min", CLAMP_MIN, lambda x, o, a, b: torch.clamp_min(x, a),
        lambda g, x, out, o, a, b: (_where_passes(g, x >= a), None), n_params=1),
    _op("clamp_max", CLAMP_MAX, lambda x, o, a, b: torch.clamp_max(x, a),
        lambda g, x, out, o, a, b: (_where_passes(g, x <= a), None), n_params=1),
    _op("elu", ELU, lambda x, o, a, b: F.elu(x, a),
        lambda g, x, out, o, a, b: (aten.elu_backward(g, a, 1, 1, False, x), None), n_params=1),
    _op("softplus", SOFTPLUS, lambda x, o, a, b: F.softplus(x, a, b),
        lambda g, x, out, o, a, b: (aten.softplus_backward(g, x, a, b), None), n_params=2),
    _op("hardswish", HARDSWISH, lambda x, o, a, b: F.hardswish(x),
        lambda g, x, out, o, a, b: (aten.hardswish_backward(g, x), None)),
    _op("mish", MISH, lambda x, o, a, b: F.mish(x), lambda g, x, out, o, a, b: (aten.mish_backward(g, x), None)),
)}


# --------------------------------------------------------------------------- programs


@dataclass(frozen=True)
class Operand:
    """A binary op's second operand: an earlier value, one of the tail's tensors, or a number."""
    value: Optional[int] = None
    tensor: Optional[int] = None
    number: Optional[float] = None

    def text(self) -> str:
        if self.value is not None:
            return f"v{self.value}"
        return f"t{self.tensor}" if self.tensor is not None else repr(float(self.number))

    @classmethod
    def parse(cls, text: str) -> "Operand":
        if text[0] == "v":
            return cls(value=int(text[1:]))
        if text[0] == "t":
            return cls(tensor=int(text[1:]))
        return cls(number=float(text))


@dataclass(frozen=True)
class Instruction:
    op: PointwiseOp
    input: int  # the value index of the (first) operand
    other: Optional[Operand] = None
    params: tuple[float, ...] = ()

    def text(self) -> str:
        operands = [f"v{self.input}"] + ([self.other.text()] if self.other is not None else [])
        params = "|" + ",".join(repr(float(p)) for p in self.params) if self.params else ""
        return f"{self.op.name}({','.join(operands)}{params})"

    def param(self, i: int) -> float:
        return self.params[i] if i < len(self.params) else 0.0


_INSTRUCTION = re.compile(r"(\w+)\(([^|)]*)(?:\|([^)]*))?\)$")


@functools.lru_cache(maxsize=None)
def parse(program: str) -> tuple[Instruction, ...]:
    """The instructions of a program's text (see the module docstring); checks what it can."""
    instructions = []
    for i, text in enumerate(t for t in program.split(";") if t):
        found = _INSTRUCTION.match(text.strip())
        if not found or found.group(1) not in OPS:
            raise ValueError(f"fusepass: bad tail instruction {text!r} in {program!r}")
        op = OPS[found.group(1)]
        operands = [Operand.parse(t.strip()) for t in found.group(2).split(",")]
        params = tuple(float(p) for p in found.group(3).split(",")) if found.group(3) else ()
        first, others = operands[0], operands[1:]
        if first.value is None or first.value > i or len(others) != int(op.binary) or len(params) != op.n_params:
            raise ValueError(f"fusepass: bad tail instruction {text!r} in {program!r}")
        if others and others[0].value is not None and others[0].value > i:
            raise ValueError(f"fusepass: tail instruction {text!r} reads a later value")
        instructions.append(Instruction(op, first.value, others[0] if others else None, params))
    return tuple(instructions)


def program_text(instructions) -> str:
    return ";".join(instruction.text() for instruction in instructions)


def is_single_relu(program: str) -> bool:
    """Whether the tail is one relu of the batch norm's output: its derivative is then eager's
    threshold_backward on the chain's own output, whose sign is all it reads."""
    instructions = parse(program)
    return len(instructions) == 1 and instructions[0].op.name == "relu"


def tensor_count(program: str) -> int:
    """How many tensor operands the program reads (it numbers them from 0)."""
    return 1 + max((ins.other.tensor for ins in parse(program) if ins.other and ins.other.tensor is not None),
                   default=-1)


def tail_program(program: str, tensors: tuple[Optional[Tensor], ...]) -> tuple[tuple, ...]:
    """The program as the kernels' TAIL meta-parameter: one constexpr of plain tuples (Inductor writes
    a traced kernel's constexprs into its generated code, so they must be literals), one entry per
    instruction in each: (opcodes, input value, value operand, tensor operand, parameter a,
    parameter b), then each tensor operand's scale mode."""
    instructions = parse(program)

    def operand_index(ins: Instruction, kind: str) -> int:
        index = getattr(ins.other, kind) if ins.other is not None else None
        return -1 if index is None else index

    return (
        tuple(ins.op.code for ins in instructions),
        tuple(ins.input for ins in instructions),
        tuple(operand_index(ins, "value") for ins in instructions),
        tuple(operand_index(ins, "tensor") for ins in instructions),
        # A number operand travels in parameter a: binary ops have no parameters.
        tuple(float(ins.other.number) if ins.other is not None and ins.other.number is not None
              else ins.param(0) for ins in instructions),
        tuple(ins.param(1) for ins in instructions),
        tuple(_tensor_mode(t) for t in tensors),
    )


def _tensor_mode(tensor: Optional[Tensor]) -> int:
    return scale_mode(tensor) if tensor is not None else 0


# --------------------------------------------------------------------------- PyTorch: forward and backward


def _operand(ins: Instruction, values: list[Tensor], tensors) -> Union[Tensor, float, None]:
    other = ins.other
    if other is None:
        return None
    if other.value is not None:
        return values[other.value]
    if other.tensor is not None:
        return tensors[other.tensor].float()
    return other.number


def run(program: str, u: Tensor, tensors) -> list[Tensor]:
    """Every value of the program on fp32 u: [v0 = u, v1, ...]; the last is the tail's result."""
    values = [u]
    for ins in parse(program):
        values.append(ins.op.forward(values[ins.input], _operand(ins, values, tensors), ins.param(0), ins.param(1)))
    return values


def backward(program: str, values: list[Tensor], grad: Tensor, tensors,
             softmax_probs: Optional[Tensor] = None) -> tuple[Tensor, dict[int, Tensor]]:
    """The gradient of the batch norm's output u = values[0], given `grad` of the tail's result, and the
    gradients of the tensor operands, summed to their shapes ({slot: gradient}).

    `softmax_probs`: the softmax's output, when the tail feeds one. Each row of a softmax's input
    gradient sums to exactly 0, so a one-element tensor's gradient from the last instruction is a
    covariance under the probabilities: its operand derivative is centred per row first, which removes
    that 0's rounding from the sum (an added constant's gradient becomes exactly 0, as it is)."""
    instructions = parse(program)
    grads: list[Optional[Tensor]] = [None] * len(values)
    grads[-1] = grad
    tensor_grads: dict[int, Tensor] = {}
    for index in reversed(range(len(instructions))):
        ins, g = instructions[index], grads[index + 1]
        if g is None:
            continue
        x, other = values[ins.input], _operand(ins, values, tensors)
        grad_x, grad_other = ins.op.derivative(g, x, values[index + 1], other, ins.param(0), ins.param(1))
        _accumulate(grads, ins.input, grad_x)
        if ins.other is not None and ins.other.value is not None:
            _accumulate(grads, ins.other.value, grad_other)
        elif ins.other is not None and ins.other.tensor is not None:
            tensor = tensors[ins.other.tensor]
            if softmax_probs is not None and index == len(instructions) - 1 and tensor.numel() == 1:
                d_other = ins.op.derivative(torch.ones_like(g), x, values[index + 1], other, ins.param(0),
                                            ins.param(1))[1]
                grad_other = g * (d_other - (softmax_probs * d_other).sum(1, keepdim=True))
            slot = ins.other.tensor
            reduced = reduce_to(grad_other, tensor)
            tensor_grads[slot] = reduced if slot not in tensor_grads else tensor_grads[slot] + reduced
    return (grads[0] if grads[0] is not None else torch.zeros_like(values[0])), tensor_grads


def _accumulate(grads: list, index: int, grad: Tensor) -> None:
    grads[index] = grad if grads[index] is None else grads[index] + grad


def reduce_to(grad: Tensor, tensor: Tensor) -> Tensor:
    """Sums a broadcast gradient down to the tensor's shape. A one-element tensor sums everything: that
    single reduction accumulates in float64, cheaply and as exactly as it can."""
    if tensor.numel() == 1:
        return grad.double().sum().reshape(tensor.shape).to(tensor.dtype)
    return grad.sum_to_size(tensor.shape).to(tensor.dtype)
