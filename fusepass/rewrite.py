"""Applies matches: each match's family replacement, in the graph, in place."""

from __future__ import annotations

import copy

from torch.fx import Graph, GraphModule, Node

from fusepass.lowering.schema import KernelOptions
from fusepass.matcher import Match


def apply(gm: GraphModule, matches: list[Match], kernel: KernelOptions = KernelOptions()) -> None:
    """Replaces every match in `gm` (find_chains's, on gm's graph) with its family's fused op."""
    replaced: dict[Node, Node] = {}  # a chain's last node -> what replaced it (a chain may feed another)
    for match in matches:
        replaced[match.last] = match.family.replace(gm.graph, match, replaced, kernel)
    if matches:
        gm.graph.lint()
        gm.recompile()


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A GraphModule sharing gm's attributes but with its own copy of the graph (node meta kept)."""
    graph = Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    duplicate = GraphModule(gm, graph)
    duplicate.meta.update(getattr(gm, "meta", {}))
    return duplicate
