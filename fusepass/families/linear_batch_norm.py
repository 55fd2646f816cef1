"""The family `head -> [* s1] -> batch_norm -> [pointwise tail] -> [softmax over the features]`, the head
a linear or a matmul by an (in, out) weight with an optional bias added, and its replacement, one call of
`torch.ops.fusepass.linear_scale_batch_norm` (fusepass/lowering/).

Pattern: the steps below, anchored on batch_norm. Replacement: the op, its arguments built by name
(ChainArgs) from the steps' normalized arguments; in training, copies of the op's new running
statistics into the module's buffers (the op itself mutates nothing); the num_batches_tracked
increment stays in the graph.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from fusepass.lowering.pointwise import MAX_TAIL_TENSORS
from fusepass.lowering.schema import BatchNorm, ChainArgs, ChainOutputs, Kernel, Linear, Scale, Tail, flatten
from fusepass.pattern import (ADD_TARGETS, BATCH_NORM_TARGETS, DROPOUT_TARGETS, LINEAR_TARGETS, MATMUL_TARGETS,
                              MUL_TARGETS, SOFTMAX_TARGETS, TAIL_TARGETS, ChainFamily, Match, ScaleArgs, Step, TailArgs,
                              grow_tail, meta_value, parse_batch_norm, parse_bias, parse_head, parse_identity_dropout,
                              parse_scale, parse_softmax)

FUSED_OP = torch.ops.fusepass.linear_scale_batch_norm.default

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


def replace(graph: Graph, match: Match, replaced: dict[Node, Node], kernel: Kernel) -> Node:
    """Puts FUSED_OP in place of the match; returns the node that now stands for the chain's output.
    `replaced` maps the last nodes of chains replaced earlier to their new nodes (a chain may feed
    another)."""
    last = match.last
    result = meta_value(last)
    args = _op_args(graph, match, replaced, kernel, result)
    with graph.inserting_before(last):
        fused = graph.call_function(FUSED_OP, flatten(args))
        out = graph.call_function(operator.getitem, (fused, ChainOutputs._fields.index("out")))
        out.meta.update(last.meta)
        bn = args.batch_norm
        if bn.updates_running_stats:
            for name, buffer in (("new_running_mean", bn.running_mean), ("new_running_var", bn.running_var)):
                new_value = graph.call_function(operator.getitem, (fused, ChainOutputs._fields.index(name)))
                graph.call_method("copy_", (buffer, new_value))
    last.replace_all_uses_with(out)
    for node in reversed(match.nodes):
        graph.erase_node(node)
    return out


def _op_args(graph: Graph, match: Match, replaced: dict[Node, Node], kernel: Kernel, result) -> ChainArgs:
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

    def tail(step: Optional[TailArgs]) -> Tail:
        if step is None:
            return Tail()
        tensors = [node(t) for t in step.tensors] + [None] * (MAX_TAIL_TENSORS - len(step.tensors))
        return Tail(step.program, *tensors)

    def scale(step: Optional[ScaleArgs]) -> Scale:
        if step is None:
            return Scale()
        return Scale(tensor=node(step.scale)) if isinstance(step.scale, Node) else Scale(value=float(step.scale))

    weight = node(linear.weight, cast=True)
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
