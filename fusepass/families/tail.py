"""The chain family's pointwise tail: the largest elementwise region after batch norm, grown over the
graph (grow_tail), and the dropout that passes its input through.

The tail's calls (TAIL_CALLS): target -> (op, parameter names, defaults). The op is a pointwise.OPS name,
or one resolved from the arguments ("binary:<name>", "gelu", "clamp", "dropout": see _tail_call).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from fusepass.families.linear import LINEAR_TARGETS, SUPPORTED_DTYPES, is_number, scale_like
from fusepass.lowering import pointwise
from fusepass.matcher import Miss, NoMatch, bind_arguments, describe_node, is_call, meta_value

SOFTMAX_TARGETS = (F.softmax, torch.softmax, torch.Tensor.softmax)  # the chain's step after the tail
DROPOUT_TARGETS = (F.dropout,)

_UNARY = ("input",)
_BINARY = ("input", "other")
TAIL_CALLS: dict[Any, tuple[str, tuple[str, ...], dict[str, Any]]] = {
    operator.add: ("binary:add", _BINARY, {}), torch.add: ("binary:add", _BINARY + ("alpha",), {"alpha": 1}),
    torch.Tensor.add: ("binary:add", _BINARY + ("alpha",), {"alpha": 1}),
    operator.sub: ("binary:sub", _BINARY, {}), torch.sub: ("binary:sub", _BINARY + ("alpha",), {"alpha": 1}),
    torch.Tensor.sub: ("binary:sub", _BINARY + ("alpha",), {"alpha": 1}),
    operator.mul: ("binary:mul", _BINARY, {}), torch.mul: ("binary:mul", _BINARY, {}),
    torch.Tensor.mul: ("binary:mul", _BINARY, {}),
    operator.truediv: ("binary:div", _BINARY, {}),
    torch.div: ("binary:div", _BINARY + ("rounding_mode",), {"rounding_mode": None}),
    torch.Tensor.div: ("binary:div", _BINARY + ("rounding_mode",), {"rounding_mode": None}),
    operator.neg: ("neg", _UNARY, {}), torch.neg: ("neg", _UNARY, {}), torch.Tensor.neg: ("neg", _UNARY, {}),
    F.relu: ("relu", ("input", "inplace"), {"inplace": False}), torch.relu: ("relu", _UNARY, {}),
    torch.Tensor.relu: ("relu", _UNARY, {}), torch.relu_: ("relu", ("input",), {"inplace": True}),
    torch.Tensor.relu_: ("relu", ("input",), {"inplace": True}),
    F.leaky_relu: ("leaky_relu", ("input", "negative_slope", "inplace"), {"negative_slope": 0.01, "inplace": False}),
    F.gelu: ("gelu", ("input", "approximate"), {"approximate": "none"}),
    F.silu: ("silu", ("input", "inplace"), {"inplace": False}),
    torch.sigmoid: ("sigmoid", _UNARY, {}), torch.Tensor.sigmoid: ("sigmoid", _UNARY, {}),
    F.sigmoid: ("sigmoid", _UNARY, {}),
    torch.tanh: ("tanh", _UNARY, {}), torch.Tensor.tanh: ("tanh", _UNARY, {}), F.tanh: ("tanh", _UNARY, {}),
    F.hardtanh: ("hardtanh", ("input", "min_val", "max_val", "inplace"),
                 {"min_val": -1.0, "max_val": 1.0, "inplace": False}),
    F.relu6: ("hardtanh", ("input", "inplace"), {"min_val": 0.0, "max_val": 6.0, "inplace": False}),
    torch.clamp: ("clamp", ("input", "min", "max"), {"min": None, "max": None}),
    torch.Tensor.clamp: ("clamp", ("input", "min", "max"), {"min": None, "max": None}),
    torch.clip: ("clamp", ("input", "min", "max"), {"min": None, "max": None}),
    torch.clamp_min: ("clamp", ("input", "min"), {"max": None}),
    torch.Tensor.clamp_min: ("clamp", ("input", "min"), {"max": None}),
    torch.clamp_max: ("clamp", ("input", "max"), {"min": None}),
    torch.Tensor.clamp_max: ("clamp", ("input", "max"), {"min": None}),
    F.elu: ("elu", ("input", "alpha", "inplace"), {"alpha": 1.0, "inplace": False}),
    F.softplus: ("softplus", ("input", "beta", "threshold"), {"beta": 1.0, "threshold": 20.0}),
    F.hardswish: ("hardswish", ("input", "inplace"), {"inplace": False}),
    F.mish: ("mish", ("input", "inplace"), {"inplace": False}),
    F.dropout: ("dropout", ("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False}),
}
TAIL_TARGETS = tuple(TAIL_CALLS)


@dataclass(frozen=True)
class TailArgs:
    """The pointwise tail: its instructions (pointwise.Instruction; v0 is the batch norm's output), the
    nodes its tensor operands come from (t0, t1, ...), and each region node's op name in graph order
    ("dropout" for an identity dropout)."""
    instructions: tuple
    tensors: tuple[Node, ...]
    names: tuple[str, ...]

    @property
    def program(self) -> str:
        return pointwise.program_text(self.instructions)


@dataclass(frozen=True)
class IdentityArgs:
    """A step that passes its input through: dropout in eval, or with p = 0."""


def check_identity_dropout(node: Node, args: dict[str, Any]) -> None:
    """Dropout is an identity in eval and with p = 0; NoMatch where it is not (or not known to be)."""
    if not (is_number(args["p"]) and isinstance(args["training"], bool)):
        raise NoMatch(f"`{node.name}`: dropout with a p or training flag that is not a constant")
    if args["training"] and args["p"] > 0:
        raise NoMatch(f"`{node.name}`: dropout with p = {args['p']} in training is random; the chain ends before it")


def parse_identity_dropout(node: Node) -> list[tuple[IdentityArgs, Optional[Node]]]:
    """A dropout that passes its input through: dropout in eval or with p = 0 (F.dropout's signature)."""
    kind, names, defaults = TAIL_CALLS[F.dropout]
    args = bind_arguments(node, names, defaults)
    check_identity_dropout(node, args)
    return [(IdentityArgs(), args["input"])]


@dataclass(frozen=True)
class _TailCall:
    op: Optional[str]  # a pointwise.OPS name before operand order is known; None for an identity
    operands: tuple  # (input,) or (input, other)
    params: tuple[float, ...] = ()
    inplace: bool = False


def _tail_call(node: Node) -> _TailCall:
    """What a call of TAIL_TARGETS computes, its arguments normalized; NoMatch where it is not fused."""
    target = node.target if node.op == "call_function" else getattr(torch.Tensor, str(node.target))
    kind, names, defaults = TAIL_CALLS[target]
    args = bind_arguments(node, names, defaults)
    params = {k: v for k, v in args.items() if k not in ("input", "other", "inplace")}
    inplace = args.get("inplace") is True
    if kind.startswith("binary:"):
        if params.get("alpha", 1) != 1 or params.get("rounding_mode") is not None:
            raise NoMatch(f"`{node.name}`: {kind[7:]} with alpha or rounding_mode is not fused")
        return _TailCall(kind[7:], (args["input"], args["other"]))
    if kind == "dropout":
        check_identity_dropout(node, args)
        return _TailCall(None, (args["input"],), inplace=inplace)
    if kind == "gelu":
        if args["approximate"] not in ("none", "tanh"):
            raise NoMatch(f"`{node.name}`: gelu approximate={args['approximate']!r}")
        return _TailCall("gelu" if args["approximate"] == "none" else "gelu_tanh", (args["input"],))
    values = tuple(params.values())
    if kind == "clamp":
        low, high = params["min"], params["max"]
        if low is None and high is None:
            raise NoMatch(f"`{node.name}`: clamp without bounds")
        kind, values = ("clamp", (low, high)) if low is not None and high is not None else (
            ("clamp_min", (low,)) if low is not None else ("clamp_max", (high,)))
    if not all(is_number(v) for v in values):
        raise NoMatch(f"`{node.name}`: {kind}'s parameters {values} are not constant numbers")
    return _TailCall(kind, (args["input"],), tuple(float(v) for v in values), inplace)


_SWAPPED = {"add": "add", "mul": "mul", "sub": "rsub", "div": "rdiv"}


def _tail_step(node: Node, call: _TailCall, inside: set, start: Node) -> tuple[Optional[str], Any, Any]:
    """(op, value input, other operand) of a tail call whose inputs include a tail value, with the tail
    value first (rsub / rdiv when it was second); NoMatch where the call cannot join the tail."""
    shape = tuple(meta_value(start).shape)
    value = meta_value(node)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype not in SUPPORTED_DTYPES:
        raise NoMatch(f"`{node.name}` does not give a {shape} float tensor")
    first = call.operands[0]
    if call.inplace and len(first.users) != 1:
        raise NoMatch(f"`{node.name}` changes `{first.name}` in place, and `{first.name}` has other users")
    if len(call.operands) == 1:
        return call.op, first, None
    a, b = call.operands
    if a not in inside:
        if call.op not in _SWAPPED:
            raise NoMatch(f"`{node.name}`: {call.op} with the tail value second")
        a, b, op = b, a, _SWAPPED[call.op]
    else:
        op = call.op
    if b not in inside and not scale_like(b, shape[-1]):
        raise NoMatch(f"`{node.name}` combines the tail with {describe_node(b)}: only numbers and tensors of shape "
                      "(), (1,) or (F,) are fused")
    return op, a, b


@dataclass
class _Candidate:
    op: Optional[str]
    input: Node
    other: Any
    params: tuple[float, ...]


def grow_tail(start: Node) -> tuple[Optional[TailArgs], tuple[Node, ...], list[Miss]]:
    """The largest pointwise region fed by `start` (the batch norm's output) that ends in one node and
    whose intermediates have no users outside it: (its arguments, its nodes in graph order, misses for
    the calls just outside it). No region: (None, (), misses)."""
    candidates, rejected, inside = {}, {}, {start}
    node = start.next
    while node.op != "root" and node.op != "output":
        if any(arg in inside for arg in node.all_input_nodes):
            if is_call(node, TAIL_TARGETS):
                try:
                    call = _tail_call(node)
                    op, first, other = _tail_step(node, call, inside, start)
                    candidates[node] = _Candidate(op, first, other, call.params)
                    inside.add(node)
                except NoMatch as exc:
                    rejected[node] = str(exc)
            else:
                rejected[node] = None
        node = node.next
    region = _largest_closed_region(start, candidates)
    misses = _tail_misses(start, region, candidates, rejected)
    if not region:
        return None, (), misses
    return _tail_args(start, region, candidates), tuple(region), misses


def _largest_closed_region(start: Node, candidates: dict) -> list[Node]:
    """The candidates' largest subset that ends in one node and leaves no intermediate (nor start) with a
    user outside it, within MAX_TAIL_OPS ops and MAX_TAIL_TENSORS tensors; in graph order."""
    best: list[Node] = []
    for end in candidates:
        region, stack = {end}, [end]
        while stack:
            for arg in stack.pop().all_input_nodes:
                if arg in candidates and arg not in region:
                    region.add(arg)
                    stack.append(arg)
        closed = all(user in region for node in (start, *region) if node is not end for user in node.users)
        ops = sum(candidates[n].op is not None for n in region)
        tensors = {c.other for c in (candidates[n] for n in region) if isinstance(c.other, Node)} - region - {start}
        if closed and ops <= pointwise.MAX_TAIL_OPS and len(tensors) <= pointwise.MAX_TAIL_TENSORS \
                and len(region) >= len(best):
            best = [n for n in candidates if n in region]
    return best


def _tail_args(start: Node, region: list[Node], candidates: dict) -> TailArgs:
    index, instructions, tensors = {start: 0}, [], []
    for node in region:
        c = candidates[node]
        if c.op is None:  # an identity: its value is its input's
            index[node] = index[c.input]
            continue
        other = None
        if c.other is not None:
            if c.other in index:
                other = pointwise.Operand(value=index[c.other])
            elif isinstance(c.other, Node):
                if c.other not in tensors:
                    tensors.append(c.other)
                other = pointwise.Operand(tensor=tensors.index(c.other))
            else:
                other = pointwise.Operand(number=float(c.other))
        instructions.append(pointwise.Instruction(pointwise.OPS[c.op], index[c.input], other, c.params))
        index[node] = len(instructions)
    names = tuple(candidates[n].op or "dropout" for n in region)
    return TailArgs(tuple(instructions), tuple(tensors), names)


def _tail_misses(start: Node, region: list[Node], candidates: dict, rejected: dict) -> list[Miss]:
    """Why the tail ends where it does: a miss for each call just outside the region that reads one of its
    values, except the chain's own next step (softmax), a next linear and the graph's output."""
    end = region[-1] if region else start
    misses = []
    for node in (start, *region):
        for user in node.users:
            if user in region:
                continue
            if user in candidates:
                reason = (f"`{user.name}` is not fused into the tail: `{node.name}` would keep a user outside it "
                          f"(or the tail would pass {pointwise.MAX_TAIL_OPS} ops / "
                          f"{pointwise.MAX_TAIL_TENSORS} tensors)")
            elif rejected.get(user) is not None:
                reason = rejected[user]
            elif user.op == "output" or is_call(user, SOFTMAX_TARGETS + LINEAR_TARGETS):
                continue  # the graph's result, the chain's next step, the next layer
            elif node is end:
                reason = f"the tail ends before {describe_node(user)}: not a pointwise op fusepass fuses"
            else:
                reason = f"the tail ends before {describe_node(user)}, which also reads `{node.name}`"
            misses.append(Miss(user, reason, (node, user)))
    return misses
