"""How fusepass finds the chains it fuses: step parsers and a generic matcher.

A chain family (fusepass/families/) is a list of steps around an anchor, each step a parser that
recognises one FX node and normalizes its arguments once (into LinearArgs, BiasArgs, ScaleArgs,
BatchNormArgs, SoftmaxArgs), or a region step that grows over several nodes (the pointwise tail,
grow_tail -> TailArgs). The matcher anchors on the family's anchor (the rare op), walks back through
the head steps and forward through the tail steps; every anchor it cannot fuse, and every tail step
it had to leave out, becomes a Miss with the reason for `explain()`. What replaces a match is the family's own
business (its `replace`), kept next to its steps.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from fusepass.lowering import pointwise
from fusepass.sync_batch_norm import sync_batch_norm

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_DEVICES = ("cpu", "cuda")

LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
MATMUL_TARGETS = (operator.matmul, torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm)
ADD_TARGETS = (operator.add, torch.add, torch.Tensor.add)
MUL_TARGETS = (operator.mul, torch.mul, torch.Tensor.mul)
BATCH_NORM_TARGETS = (F.batch_norm, sync_batch_norm)  # the second: a SyncBatchNorm (sync_batch_norm.py)
SOFTMAX_TARGETS = (F.softmax, torch.softmax, torch.Tensor.softmax)
DROPOUT_TARGETS = (F.dropout,)

# The pointwise tail's calls: target -> (op, parameter names, defaults). The op is a pointwise.OPS name,
# or one resolved from the arguments ("binary:<name>", "gelu", "clamp", "dropout": see _tail_call).
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


class NoMatch(Exception):
    """A node does not fit a step; the message is the reason shown in explain()."""


# --------------------------------------------------------------------------- normalized arguments


@dataclass(frozen=True)
class LinearArgs:
    x: Node
    weight: Node  # (out, in) for a linear; (in, out) for a matmul head (weight_in_out)
    bias: Optional[Node]
    weight_in_out: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return ("matmul",) if self.weight_in_out else ("linear",)


@dataclass(frozen=True)
class BiasArgs:
    bias: Node  # a tensor of shape (out_features,), added to a matmul head's output


@dataclass(frozen=True)
class ScaleArgs:
    scale: Union[Node, float]  # a tensor of shape (F,), (1,) or (), or a Python number


@dataclass(frozen=True)
class BatchNormArgs:
    running_mean: Optional[Node]
    running_var: Optional[Node]
    weight: Optional[Node]
    bias: Optional[Node]
    training: bool
    momentum: float
    eps: float
    group_name: str = ""  # a SyncBatchNorm's process group

    @property
    def names(self) -> tuple[str, ...]:
        return ("sync_batch_norm",) if self.group_name else ("batch_norm",)


@dataclass(frozen=True)
class IdentityArgs:
    """A step that passes its input through: dropout in eval, or with p = 0."""


@dataclass(frozen=True)
class SoftmaxArgs:
    dtype: Optional[torch.dtype]  # softmax's dtype= argument; the op takes eager's result dtype anyway


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


def meta_value(node: Any) -> Any:
    """The fake tensor (or SymInt) Dynamo recorded for a node; None for non-nodes."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def _bind(node: Node, names: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
    """Maps a call's positional and keyword arguments onto parameter names."""
    if len(node.args) > len(names):
        raise NoMatch(f"{node.name}: unexpected extra arguments")
    bound = dict(defaults)
    bound.update(zip(names, node.args))
    for key, value in node.kwargs.items():
        if key not in names:
            raise NoMatch(f"{node.name}: unexpected keyword {key!r}")
        bound[key] = value
    missing = [n for n in names if n not in bound]
    if missing:
        raise NoMatch(f"{node.name}: missing arguments {missing}")
    return bound


def _is_call(node: Any, targets: tuple) -> bool:
    return isinstance(node, Node) and (
        (node.op == "call_function" and node.target in targets)
        or (node.op == "call_method" and getattr(torch.Tensor, str(node.target), None) in targets)
    )


def _check_tensor(node: Node, what: str, ndim: Optional[int] = None) -> torch.Tensor:
    value = meta_value(node)
    if not isinstance(value, torch.Tensor):
        raise NoMatch(f"{what} `{node.name}` has no recorded tensor metadata")
    if ndim is not None and value.dim() != ndim:
        raise NoMatch(f"{what} `{node.name}` is {value.dim()}-D; only {ndim}-D is fused")
    if value.dtype not in SUPPORTED_DTYPES:
        raise NoMatch(f"{what} `{node.name}` has dtype {value.dtype}; fused dtypes are float32, bfloat16, float16")
    if value.device.type not in SUPPORTED_DEVICES:
        raise NoMatch(f"{what} `{node.name}` is on {value.device.type}; fused devices are cpu and cuda")
    return value


def _describe(node: Any) -> str:
    if not isinstance(node, Node):
        return repr(node)
    if node.op == "placeholder":
        return f"graph input `{node.name}` (a Dynamo graph break may separate it from its producer)"
    if node.op == "call_function":
        return f"`{node.name}` ({getattr(node.target, '__name__', node.target)})"
    return f"`{node.name}` ({node.op} {node.target})"


# --------------------------------------------------------------------------- step parsers
# Each parser takes a node whose target fits the step and returns the interpretations
# [(args, chain_input)] under which it fits; chain_input is the node the previous step must produce.


def parse_linear(node: Node) -> list[tuple[LinearArgs, Optional[Node]]]:
    args = _bind(node, ("input", "weight", "bias"), {"bias": None})
    _check_tensor(args["input"], "linear input", ndim=2)
    _check_tensor(node, "linear output", ndim=2)
    return [(LinearArgs(args["input"], args["weight"], args["bias"]), None)]


def parse_head(node: Node) -> list[tuple[LinearArgs, Optional[Node]]]:
    """A linear, or a matmul of a 2-D input by a 2-D weight in (in, out) layout (x @ W)."""
    if _is_call(node, LINEAR_TARGETS):
        return parse_linear(node)
    args = _bind(node, ("input", "other"), {})
    _check_tensor(args["input"], "matmul input", ndim=2)
    _check_tensor(args["other"], "matmul weight", ndim=2)
    _check_tensor(node, "matmul output", ndim=2)
    return [(LinearArgs(args["input"], args["other"], None, weight_in_out=True), None)]


def parse_bias(node: Node) -> list[tuple[BiasArgs, Optional[Node]]]:
    """`x @ W + b` (either order) with b of shape (out_features,): a matmul head's bias."""
    args = _bind(node, ("input", "other", "alpha"), {"alpha": 1})
    if args["alpha"] != 1:
        raise NoMatch(f"`{node.name}`: add with alpha")
    for head, bias in ((args["input"], args["other"]), (args["other"], args["input"])):
        head_value, bias_value = meta_value(head), meta_value(bias)
        if (_is_call(head, MATMUL_TARGETS) and isinstance(head_value, torch.Tensor) and head_value.dim() == 2
                and isinstance(bias_value, torch.Tensor) and tuple(bias_value.shape) == (head_value.shape[1],)
                and bias_value.dtype in SUPPORTED_DTYPES):
            return [(BiasArgs(bias), head)]
    raise NoMatch(f"`{node.name}` is not a matmul's output plus a bias of shape (out_features,)")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scale_like(operand: Any, n_features: int) -> bool:
    if _number(operand):
        return True
    value = meta_value(operand)
    return (
        isinstance(value, torch.Tensor)
        and value.dtype in SUPPORTED_DTYPES
        and tuple(value.shape) in ((n_features,), (1,), ())
    )


def parse_scale(node: Node) -> list[tuple[ScaleArgs, Optional[Node]]]:
    args = _bind(node, ("input", "other"), {})
    interpretations = []
    for chain, scale in ((args["input"], args["other"]), (args["other"], args["input"])):
        chain_value = meta_value(chain)
        if not isinstance(chain_value, torch.Tensor) or chain_value.dim() != 2 or chain is scale:
            continue
        if _scale_like(scale, chain_value.shape[-1]):
            interpretations.append((ScaleArgs(float(scale) if not isinstance(scale, Node) else scale), chain))
    if not interpretations:
        raise NoMatch(
            f"`{node.name}` multiplies by something other than a per-feature, (1,), 0-d or Python-number scale"
        )
    return interpretations


def parse_batch_norm(node: Node) -> list[tuple[BatchNormArgs, Optional[Node]]]:
    signature = inspect.signature(node.target)  # F.batch_norm's, or sync_batch_norm's: the same + group_name
    names = tuple(signature.parameters)
    defaults = {k: p.default for k, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}
    args = _bind(node, names, defaults)
    _check_tensor(args["input"], "batch_norm input", ndim=2)
    if not isinstance(args["training"], bool):
        raise NoMatch(f"`{node.name}`: training flag is not a constant")
    if not all(isinstance(args[k], (int, float)) for k in ("momentum", "eps")):
        raise NoMatch(f"`{node.name}`: momentum and eps must be constants (momentum=None in training "
                      "graph-breaks in Dynamo before fusepass sees it)")
    running = (args["running_mean"], args["running_var"])
    if (running[0] is None) != (running[1] is None):
        raise NoMatch(f"`{node.name}`: only one of running_mean / running_var is given")
    if not args["training"] and running[0] is None:
        raise NoMatch(f"`{node.name}`: eval-mode batch_norm without running statistics")
    bn = BatchNormArgs(args["running_mean"], args["running_var"], args["weight"], args["bias"],
                       args["training"], float(args["momentum"]), float(args["eps"]), args.get("group_name", ""))
    return [(bn, args["input"])]


def _check_identity_dropout(node: Node, args: dict[str, Any]) -> None:
    """Dropout is an identity in eval and with p = 0; NoMatch where it is not (or not known to be)."""
    if not (_number(args["p"]) and isinstance(args["training"], bool)):
        raise NoMatch(f"`{node.name}`: dropout with a p or training flag that is not a constant")
    if args["training"] and args["p"] > 0:
        raise NoMatch(f"`{node.name}`: dropout with p = {args['p']} in training is random; the chain ends before it")


def parse_identity_dropout(node: Node) -> list[tuple[IdentityArgs, Optional[Node]]]:
    """A dropout that passes its input through: dropout in eval or with p = 0 (F.dropout's signature)."""
    kind, names, defaults = TAIL_CALLS[F.dropout]
    args = _bind(node, names, defaults)
    _check_identity_dropout(node, args)
    return [(IdentityArgs(), args["input"])]


def parse_softmax(node: Node) -> list[tuple[SoftmaxArgs, Optional[Node]]]:
    names = ("input", "dim", "_stacklevel", "dtype") if node.target is F.softmax else ("input", "dim", "dtype")
    args = _bind(node, names, {"dim": None, "_stacklevel": 3, "dtype": None})
    _check_tensor(args["input"], "softmax input", ndim=2)
    # dim=None on 2-D input is F.softmax's implicit dim 1.
    if args["dim"] not in (1, -1, None):
        raise NoMatch(f"`{node.name}`: softmax over dim {args['dim']}; only the last (feature) dim is fused")
    if args["dtype"] is not None and args["dtype"] not in SUPPORTED_DTYPES:
        raise NoMatch(f"`{node.name}`: softmax dtype {args['dtype']} is not fused")
    return [(SoftmaxArgs(args["dtype"]), args["input"])]


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
    args = _bind(node, names, defaults)
    params = {k: v for k, v in args.items() if k not in ("input", "other", "inplace")}
    inplace = args.get("inplace") is True
    if kind.startswith("binary:"):
        if params.get("alpha", 1) != 1 or params.get("rounding_mode") is not None:
            raise NoMatch(f"`{node.name}`: {kind[7:]} with alpha or rounding_mode is not fused")
        return _TailCall(kind[7:], (args["input"], args["other"]))
    if kind == "dropout":
        _check_identity_dropout(node, args)
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
    if not all(_number(v) for v in values):
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
    if b not in inside and not _scale_like(b, shape[-1]):
        raise NoMatch(f"`{node.name}` combines the tail with {_describe(b)}: only numbers and tensors of shape "
                      "(), (1,) or (F,) are fused")
    return op, a, b


@dataclass
class _Candidate:
    op: Optional[str]
    input: Node
    other: Any
    params: tuple[float, ...]


def grow_tail(start: Node) -> tuple[Optional[TailArgs], tuple[Node, ...], list["Miss"]]:
    """The largest pointwise region fed by `start` (the batch norm's output) that ends in one node and
    whose intermediates have no users outside it: (its arguments, its nodes in graph order, misses for
    the calls just outside it). No region: (None, (), misses)."""
    candidates, rejected, inside = {}, {}, {start}
    node = start.next
    while node.op != "root" and node.op != "output":
        if any(arg in inside for arg in node.all_input_nodes):
            if _is_call(node, TAIL_TARGETS):
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


def _tail_misses(start: Node, region: list[Node], candidates: dict, rejected: dict) -> list["Miss"]:
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
            elif user.op == "output" or _is_call(user, SOFTMAX_TARGETS + LINEAR_TARGETS):
                continue  # the graph's result, the chain's next step, the next layer
            elif node is end:
                reason = f"the tail ends before {_describe(user)}: not a pointwise op fusepass fuses"
            else:
                reason = f"the tail ends before {_describe(user)}, which also reads `{node.name}`"
            misses.append(Miss(user, reason, (node, user)))
    return misses


# --------------------------------------------------------------------------- chain families


@dataclass(frozen=True)
class Step:
    key: str  # unique within a family: where Match.args keeps this step's arguments
    name: str  # how a pattern name spells the step (both scale steps are "scale")
    targets: tuple  # the callables (or Tensor methods) this step's node may call
    parse: Optional[Callable[[Node], list[tuple[Any, Optional[Node]]]]]
    optional: bool = False
    # A region step (the pointwise tail): from the chain's last node, (args, nodes, misses) (grow_tail).
    grow: Optional[Callable[[Node], tuple[Any, tuple[Node, ...], list]]] = None

    def interpretations(self, node: Any) -> list[tuple[Any, Optional[Node]]]:
        if not _is_call(node, self.targets):
            raise NoMatch(f"expected {self.name}, found {_describe(node)}")
        return self.parse(node)


@dataclass(frozen=True)
class ChainFamily:
    """Steps in data-flow order: `head` feeds `anchor`, which feeds `tail`. Optional steps may be
    absent; the tail's steps are all optional, the chain simply ends earlier. `replace(graph, match,
    replaced, kernel)` puts the fused op in the graph in place of a match and returns the node that
    stands for the chain's output; `describe(match)` gives explain() the match's shapes and dtypes.
    `counter`: the backend's counter of this family's rewrites (torch._dynamo.utils.counters["fusepass"])."""

    head: tuple[Step, ...]
    anchor: Step
    tail: tuple[Step, ...]
    replace: Callable[..., Node]
    describe: Callable[["Match"], dict[str, Any]]
    counter: str = "rewrites"


@dataclass
class Match:
    """A chain to replace: `nodes` in data-flow order and each matched step's normalized arguments."""

    family: ChainFamily
    nodes: tuple[Node, ...]
    steps: tuple[Step, ...]
    args: dict[str, Any]  # step key -> LinearArgs / ScaleArgs / BatchNormArgs / TailArgs / SoftmaxArgs
    verdict: Optional[str] = None  # why it runs fused rather than as Inductor's code (race.py), if timed

    @property
    def pattern(self) -> str:
        names = []
        for step in self.steps:
            args = self.args.get(step.key)
            names += list(args.names) if isinstance(args, (TailArgs, LinearArgs, BatchNormArgs)) else [step.name]
        return "_".join(names)

    @property
    def last(self) -> Node:
        """The node whose value the fused op replaces."""
        return self.nodes[-1]

    def get(self, key: str) -> Any:
        return self.args.get(key)


@dataclass
class Miss:
    """A node that was not fused (a batch_norm, or a tail step left out), and why."""

    node: Node
    reason: str
    nodes: tuple[Node, ...] = field(default_factory=tuple)


@dataclass
class _Failure:
    reason: str
    depth: int  # how many steps matched before failing: the deepest failure is the most telling
    nodes: tuple[Node, ...]
    # At equal depth: a node that calls the step's op but does not fit it says more than one that calls
    # another op, and a required step's "expected ..." more than an optional step's.
    telling: tuple[bool, bool] = (False, False)


def _match_head(steps: tuple[Step, ...], node: Node, matched: tuple) -> Union[list, _Failure]:
    """Matches `steps` (in data-flow order) ending at `node`, walking backwards. Returns the list of
    (step, node, args) in data-flow order, or the deepest failure."""
    if not steps:
        return []
    step, earlier = steps[-1], steps[:-1]
    failures = []
    try:
        interpretations = step.interpretations(node)
    except NoMatch as exc:
        interpretations = []
        failures.append(_Failure(str(exc), len(matched), tuple(matched),
                                 (_is_call(node, step.targets), not step.optional)))
    for args, chain_input in interpretations:
        if len(node.users) != 1:
            users = ", ".join(u.name for u in node.users)
            failures.append(_Failure(f"intermediate `{node.name}` has other users ({users})",
                                     len(matched) + 1, (node, *matched)))
            continue
        rest = _match_head(earlier, chain_input, (node, *matched)) if earlier else []
        if isinstance(rest, _Failure):
            failures.append(rest)
            continue
        return [*rest, (step, node, args)]
    if step.optional:
        rest = _match_head(earlier, node, matched)
        if not isinstance(rest, _Failure):
            return rest
        failures.append(rest)
    return max(failures, key=lambda f: (f.depth, f.telling))


def _match_tail(steps: tuple[Step, ...], node: Node) -> tuple[list, list[Miss]]:
    """Extends a chain ending at `node` forward through the optional `steps`, as far as it can.
    Returns the (step, nodes, args) taken and a Miss for each step that was there but left out."""
    taken, left_out = [], []
    for step in steps:
        if step.grow is not None:
            args, nodes, misses = step.grow(node)
            left_out += misses
            if nodes:
                taken.append((step, nodes, args))
                node = nodes[-1]
            continue
        users = [u for u in node.users if _is_call(u, step.targets)]
        if not users:
            continue
        if len(node.users) != 1:
            left_out.append(Miss(users[0], f"not fused after `{node.name}`: it has other users", (node,)))
            break
        try:
            fits = [args for args, chain_input in step.interpretations(users[0]) if chain_input is node]
        except NoMatch as exc:
            fits, reason = [], str(exc)
        else:
            reason = f"`{users[0].name}` does not take `{node.name}` as a {step.name} step"
        if not fits:
            left_out.append(Miss(users[0], reason, (node, users[0])))
            break
        taken.append((step, (users[0],), fits[0]))
        node = users[0]
    return taken, left_out


def _match_anchor(family: ChainFamily, anchor: Node) -> Union[tuple[Match, list[Miss]], _Failure]:
    try:
        [(anchor_args, chain_input)] = family.anchor.interpretations(anchor)
    except NoMatch as exc:
        return _Failure(str(exc), 0, (anchor,))
    head = _match_head(family.head, chain_input, (anchor,))
    if isinstance(head, _Failure):
        return head
    tail, left_out = _match_tail(family.tail, anchor)
    steps = [(step, (node,), args) for step, node, args in head] + [(family.anchor, (anchor,), anchor_args), *tail]
    match = Match(family=family, nodes=tuple(n for _, nodes, _ in steps for n in nodes),
                  steps=tuple(s for s, _, _ in steps), args={s.key: a for s, _, a in steps})
    return match, left_out


def find_chains(graph: Graph, families: Optional[tuple[ChainFamily, ...]] = None) -> tuple[list[Match], list[Miss]]:
    """Every fusable chain in `graph`, and every anchor-like node that could not be fused, with why.
    `families`: those to look for, in priority order (default: all of fusepass's): a node belongs to
    the first family that matches it, and a later family neither matches nor reports it."""
    if families is None:
        from fusepass.families import FAMILIES
        families = FAMILIES
    matches, misses, claimed = [], [], set()
    for family in families:
        for node in graph.nodes:
            if node in claimed or not _is_call(node, family.anchor.targets):
                continue
            result = _match_anchor(family, node)
            if isinstance(result, _Failure):
                misses.append(Miss(node, result.reason, result.nodes))
                continue
            match, left_out = result
            if claimed.intersection(match.nodes):
                continue
            claimed.update(match.nodes)
            matches.append(match)
            misses += left_out
    return matches, _unclaimed(misses, claimed)


def _unclaimed(misses: list[Miss], claimed: set[Node]) -> list[Miss]:
    """Misses of nodes that no family matched (a later family may have taken what an earlier missed)."""
    return [miss for miss in misses if miss.node not in claimed]
