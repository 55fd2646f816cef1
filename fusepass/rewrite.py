"""Replaces matched chains in an FX graph with the fused operator."""

from __future__ import annotations

import copy
import operator
from typing import Optional

import torch
from torch.fx import Graph, GraphModule, Node

from fusepass.lowering import linear_scale_batch_norm  # noqa: F401  (registers the op)
from fusepass.options import KernelOptions
from fusepass.pattern import Match, Miss, ScaleArgs, find_chains, meta_value

FUSED_OP = torch.ops.fusepass.linear_scale_batch_norm.default
# Outputs of FUSED_OP, by position.
OUT, NEW_RUNNING_MEAN, NEW_RUNNING_VAR = 0, 1, 2


def _cast(graph: Graph, node: Optional[Node], dtype: torch.dtype) -> Optional[Node]:
    """Casts `node` to `dtype` in the graph, as autocast does for linear's inputs; no-op if it already is."""
    value = meta_value(node)
    if node is None or value is None or value.dtype == dtype:
        return node
    return graph.call_method("to", (node, dtype))


def _scale_args(scale: Optional[ScaleArgs]) -> tuple[Optional[Node], float]:
    """(tensor, number) for the op: a tensor scale, or a Python number (1.0 when the step is absent)."""
    if scale is None:
        return None, 1.0
    if isinstance(scale.scale, Node):
        return scale.scale, 1.0
    return None, float(scale.scale)


def replace_chain(graph: Graph, match: Match, replaced: dict[Node, Node], kernel: KernelOptions) -> Node:
    """Replaces one matched chain by FUSED_OP; returns the node that now stands for the chain's output.
    `replaced` maps the last nodes of chains replaced earlier to their new nodes (a chain may feed another)."""
    linear, bn = match.get("linear"), match.get("batch_norm")
    last = match.last
    result = meta_value(last)
    # Under autocast the linear runs in a lower precision than its inputs: the op sees that dtype.
    compute_dtype = meta_value(match.nodes[0]).dtype
    scale_before, scale_before_value = _scale_args(match.get("scale_before"))
    scale_after, scale_after_value = _scale_args(match.get("scale_after"))

    def arg(node: Optional[Node], cast: bool = False) -> Optional[Node]:
        node = replaced.get(node, node)
        return _cast(graph, node, compute_dtype) if cast else node

    with graph.inserting_before(last):
        fused = graph.call_function(FUSED_OP, (
            arg(linear.x, cast=True), arg(linear.weight, cast=True), arg(linear.bias, cast=True),
            arg(scale_before), scale_before_value,
            arg(bn.weight), arg(bn.bias), arg(bn.running_mean), arg(bn.running_var),
            bn.training, bn.momentum, bn.eps,
            result.dtype,
            bool(result.requires_grad),  # keep the linear output for the backward only if one is needed
            arg(scale_after), scale_after_value,
            match.get("softmax") is not None,
            kernel.fp32_matmul, kernel.gemm,
        ))
        out = graph.call_function(operator.getitem, (fused, OUT))
        out.meta.update(last.meta)
        if bn.training and bn.running_mean is not None:
            for index, buffer in ((NEW_RUNNING_MEAN, bn.running_mean), (NEW_RUNNING_VAR, bn.running_var)):
                graph.call_method("copy_", (arg(buffer), graph.call_function(operator.getitem, (fused, index))))

    last.replace_all_uses_with(out)
    for node in reversed(match.nodes):
        graph.erase_node(node)
    return out


def rewrite(gm: GraphModule, kernel: KernelOptions = KernelOptions()) -> tuple[list[Match], list[Miss]]:
    """Rewrites every match in `gm` in place. Returns the matches (now replaced) and the misses."""
    matches, misses = find_chains(gm.graph)
    replaced: dict[Node, Node] = {}
    for match in matches:
        replaced[match.last] = replace_chain(gm.graph, match, replaced, kernel)
    if matches:
        gm.graph.lint()
        gm.recompile()
    return matches, misses


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A GraphModule sharing gm's attributes but with its own copy of the graph (node meta kept)."""
    graph = Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    duplicate = GraphModule(gm, graph)
    duplicate.meta.update(getattr(gm, "meta", {}))
    return duplicate

