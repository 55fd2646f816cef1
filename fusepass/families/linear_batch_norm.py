"""The family `head -> [* s1] -> batch_norm -> [pointwise tail] -> [softmax over the features]`, the head
a linear or a matmul by an (in, out) weight with an optional bias added, and its replacement, one call of
`torch.ops.fusepass.batch_norm_chain` (fusepass/lowering/).

Pattern: the steps below, anchored on batch_norm. Replacement: the op, its arguments built by name
(ChainArgs) from the steps' normalized arguments; in training, copies of the op's new running
statistics and the incremented num_batches_tracked into the module's buffers, in one foreach copy (the
op itself mutates nothing).
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from fusepass.families.linear import (LINEAR_TARGETS, MATMUL_TARGETS, SUPPORTED_DTYPES, check_tensor, parse_head,
                                      scale_like)
from fusepass.families.tail import (DROPOUT_TARGETS, SOFTMAX_TARGETS, TAIL_TARGETS, TailArgs, grow_tail,
                                    parse_identity_dropout)
from fusepass.lowering.pointwise import MAX_TAIL_TENSORS
from fusepass.lowering.schema import (BatchNorm, ChainArgs, ChainOutputs, KernelOptions, Linear, Scale, Tail, flatten,
                                     op_casts_weight)
from fusepass.matcher import ChainFamily, Match, NoMatch, Step, bind_arguments, carry_sources, is_call, meta_value
from fusepass.sync_batch_norm import sync_batch_norm

ADD_TARGETS = (operator.add, torch.add, torch.Tensor.add)
MUL_TARGETS = (operator.mul, torch.mul, torch.Tensor.mul)
BATCH_NORM_TARGETS = (F.batch_norm, sync_batch_norm)  # the second: a SyncBatchNorm (sync_batch_norm.py)

# --------------------------------------------------------------------------- steps
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
class SoftmaxArgs:
    dtype: Optional[torch.dtype]  # softmax's dtype= argument; the op takes eager's result dtype anyway


def parse_bias(node: Node) -> list[tuple[BiasArgs, Optional[Node]]]:
    """`x @ W + b` (either order) with b of shape (out_features,): a matmul head's bias."""
    args = bind_arguments(node, ("input", "other", "alpha"), {"alpha": 1})
    if args["alpha"] != 1:
        raise NoMatch(f"`{node.name}`: add with alpha")
    for head, bias in ((args["input"], args["other"]), (args["other"], args["input"])):
        head_value, bias_value = meta_value(head), meta_value(bias)
        if (is_call(head, MATMUL_TARGETS) and isinstance(head_value, torch.Tensor) and head_value.dim() == 2
                and isinstance(bias_value, torch.Tensor) and tuple(bias_value.shape) == (head_value.shape[1],)
                and bias_value.dtype in SUPPORTED_DTYPES):
            return [(BiasArgs(bias), head)]
    raise NoMatch(f"`{node.name}` is not a matmul's output plus a bias of shape (out_features,)")


def parse_scale(node: Node) -> list[tuple[ScaleArgs, Optional[Node]]]:
    args = bind_arguments(node, ("input", "other"), {})
    interpretations = []
    for chain, scale in ((args["input"], args["other"]), (args["other"], args["input"])):
        chain_value = meta_value(chain)
        if not isinstance(chain_value, torch.Tensor) or chain_value.dim() != 2 or chain is scale:
            continue
        if scale_like(scale, chain_value.shape[-1]):
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
    args = bind_arguments(node, names, defaults)
    check_tensor(args["input"], "batch_norm input", ndim=2)
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


def parse_softmax(node: Node) -> list[tuple[SoftmaxArgs, Optional[Node]]]:
    names = ("input", "dim", "_stacklevel", "dtype") if node.target is F.softmax else ("input", "dim", "dtype")
    args = bind_arguments(node, names, {"dim": None, "_stacklevel": 3, "dtype": None})
    check_tensor(args["input"], "softmax input", ndim=2)
    # dim=None on 2-D input is F.softmax's implicit dim 1.
    if args["dim"] not in (1, -1, None):
        raise NoMatch(f"`{node.name}`: softmax over dim {args['dim']}; only the last (feature) dim is fused")
    if args["dtype"] is not None and args["dtype"] not in SUPPORTED_DTYPES:
        raise NoMatch(f"`{node.name}`: softmax dtype {args['dtype']} is not fused")
    return [(SoftmaxArgs(args["dtype"]), args["input"])]


# --------------------------------------------------------------------------- the family

FUSED_OP = torch.ops.fusepass.batch_norm_chain.default

HEAD = Step("linear", "linear", LINEAR_TARGETS + MATMUL_TARGETS, parse_head)  # named by its args: linear, matmul
BIAS = Step("bias", "add", ADD_TARGETS, parse_bias, optional=True)
SCALE_BEFORE = Step("scale_before", "scale", MUL_TARGETS, parse_scale, optional=True)
# Dropout in eval (or with p = 0) passes its input through: it joins the chain where it sits, and the
# fused op leaves it out (PointNet's classifier: bn(dropout(fc(x)))).
DROPOUT_AFTER_HEAD = Step("dropout_after_head", "dropout", DROPOUT_TARGETS, parse_identity_dropout, optional=True)
DROPOUT_BEFORE_BATCH_NORM = Step("dropout_before_batch_norm", "dropout", DROPOUT_TARGETS, parse_identity_dropout,
                                 optional=True)
BATCH_NORM = Step("batch_norm", "batch_norm", BATCH_NORM_TARGETS, parse_batch_norm)
TAIL = Step("tail", "tail", TAIL_TARGETS, None, optional=True, grow=grow_tail)
SOFTMAX = Step("softmax", "softmax", SOFTMAX_TARGETS, parse_softmax, optional=True)


def replace(graph: Graph, match: Match, replaced: dict[Node, Node], kernel: KernelOptions) -> Node:
    """Puts FUSED_OP in place of the match; returns the node that now stands for the chain's output.
    `replaced` maps the last nodes of chains replaced earlier to their new nodes (a chain may feed
    another)."""
    last = match.last
    result = meta_value(last)
    before = set(graph.nodes)
    args = _op_args(graph, match, replaced, kernel, result)
    with graph.inserting_before(last):
        fused = graph.call_function(FUSED_OP, flatten(args))
        out = graph.call_function(operator.getitem, (fused, ChainOutputs._fields.index("out")))
        out.meta.update(last.meta)
        bn = args.batch_norm
        if bn.updates_running_stats:
            buffers = [bn.running_mean, bn.running_var]
            new_values = [graph.call_function(operator.getitem, (fused, ChainOutputs._fields.index(name)))
                          for name in ("new_running_mean", "new_running_var")]
            increment = _counter_increment(bn.running_mean)
            if increment is not None:
                counter = increment.args[0]
                buffers.append(counter)
                new_values.append(graph.call_function(torch.add, (counter, 1)))
                graph.erase_node(increment)
            # One foreach copy: Inductor writes every buffer in one kernel, where a copy_ per buffer (and the
            # counter's add_) take a launch each.
            graph.call_function(torch._foreach_copy_, (buffers, new_values))
    carry_sources([n for n in graph.nodes if n not in before], match.nodes)
    last.replace_all_uses_with(out)
    for node in reversed(match.nodes):
        graph.erase_node(node)
    return out


def _counter_increment(running_mean: Node) -> Optional[Node]:
    """The `num_batches_tracked.add_(1)` of the module whose running mean this is, where Dynamo's graph has
    both buffers as inputs named by their sources (an inlined nn.Module's `_buffers[...]`) and the
    increment is the counter's only use; else None (it then stays in the graph as it is)."""
    source = _source_name(running_mean)
    if not source.endswith("['running_mean']"):
        return None
    counter_source = source.removesuffix("['running_mean']") + "['num_batches_tracked']"
    for node in running_mean.graph.find_nodes(op="placeholder"):
        if _source_name(node) == counter_source and len(node.users) == 1:
            [use] = node.users
            is_increment = (use.op == "call_method" and use.target == "add_" and use.args[1:] == (1,)
                            and not use.kwargs and not use.users)
            return use if is_increment else None
    return None


def _source_name(node: Node) -> str:
    """Where Dynamo took a graph input from ("L['self']._modules['bn']._buffers['running_mean']"), or ""."""
    graph_arg = node.meta.get("grapharg") if node.op == "placeholder" else None
    source = getattr(graph_arg, "source", None)
    name = getattr(source, "name", "")
    return name() if callable(name) else name  # a method in older torch releases, a property in newer


def _op_args(graph: Graph, match: Match, replaced: dict[Node, Node], kernel: KernelOptions, result) -> ChainArgs:
    """The op's arguments for a match, as graph nodes and constants."""
    linear, bn = match.get("linear"), match.get("batch_norm")
    # Under autocast the linear runs in a lower precision than its inputs: the op sees that dtype.
    compute_dtype = meta_value(match.nodes[0]).dtype
    device = meta_value(match.nodes[0]).device

    def node(value: Optional[Node], cast: bool = False) -> Optional[Node]:
        value = replaced.get(value, value)
        with graph.inserting_before(match.last):
            value = _to_device(graph, value, device)
            return _cast(graph, value, compute_dtype) if cast else value

    autocast_weight = op_casts_weight(meta_value(linear.weight).dtype, compute_dtype)

    def tail(step: Optional[TailArgs]) -> Tail:
        if step is None:
            return Tail()
        tensors = [node(t) for t in step.tensors] + [None] * (MAX_TAIL_TENSORS - len(step.tensors))
        return Tail(step.program, *tensors)

    def scale(step: Optional[ScaleArgs]) -> Scale:
        if step is None:
            return Scale()
        return Scale(tensor=node(step.scale)) if isinstance(step.scale, Node) else Scale(value=float(step.scale))

    weight = node(linear.weight, cast=not autocast_weight)
    if linear.weight_in_out:  # x @ W: the op takes W as a linear does, (out, in); a view, not a copy
        with graph.inserting_before(match.last):
            weight = graph.call_method("t", (weight,))
    bias = match.get("bias").bias if match.get("bias") is not None else linear.bias
    return ChainArgs(
        linear=Linear(x=node(linear.x, cast=True), weight=weight, bias=node(bias, cast=True)),
        scale_before=scale(match.get("scale_before")),
        batch_norm=BatchNorm(weight=node(bn.weight), bias=node(bn.bias), running_mean=node(bn.running_mean),
                             running_var=node(bn.running_var), training=bn.training, momentum=bn.momentum,
                             eps=bn.eps, group_name=bn.group_name),
        tail=tail(match.get("tail")),
        softmax=match.get("softmax") is not None,
        out_dtype=result.dtype,
        save_linear_out=bool(result.requires_grad),  # the backward needs it; inference does not
        kernel=kernel,
        input_grad=bool(meta_value(linear.x).requires_grad),
    )


def _to_device(graph: Graph, node: Optional[Node], device: torch.device) -> Optional[Node]:
    """A 0-d CPU tensor that eager lets into a CUDA op (a scale, a tail operand) moved to the chain's
    device: the kernels read device memory only."""
    value = meta_value(node)
    if not isinstance(value, torch.Tensor) or value.device == device:
        return node
    return graph.call_method("to", (node, device))


def _cast(graph: Graph, node: Optional[Node], dtype: torch.dtype) -> Optional[Node]:
    """Casts `node` to `dtype` in the graph, as autocast does for linear's inputs; no-op if it already is."""
    value = meta_value(node)
    if node is None or value is None or value.dtype == dtype:
        return node
    return graph.call_method("to", (node, dtype))


def describe(match: Match) -> dict[str, Any]:
    linear, bn = match.get("linear"), match.get("batch_norm")
    first, last = match.nodes[0], match.last
    return {
        "shapes": {"x": _shape(linear.x), "weight": _shape(linear.weight), "out": _shape(last)},
        "dtypes": {"x": _dtype(linear.x), "linear": _dtype(first), "out": _dtype(last)},
        "training": bn.training,
        "tail": match.get("tail").program if match.get("tail") else "-",
    }


def _shape(node: Any):
    value = meta_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _dtype(node: Any):
    value = meta_value(node)
    return str(value.dtype).replace("torch.", "") if isinstance(value, torch.Tensor) else None


FAMILY = ChainFamily(head=(HEAD, BIAS, DROPOUT_AFTER_HEAD, SCALE_BEFORE, DROPOUT_BEFORE_BATCH_NORM),
                     anchor=BATCH_NORM, tail=(TAIL, SOFTMAX),
                     replace=replace, describe=describe)
