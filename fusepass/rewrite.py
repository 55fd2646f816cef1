"""Replaces matched chains in an FX graph with their families' fused operators."""

from __future__ import annotations

import copy
from typing import Optional

from torch.fx import Graph, GraphModule, Node

from fusepass.lowering.schema import Kernel
from fusepass.pattern import ChainFamily, Match, Miss, find_chains


def rewrite(gm: GraphModule, kernel: Kernel = Kernel(), families: Optional[tuple[ChainFamily, ...]] = None
            ) -> tuple[list[Match], list[Miss]]:
    """Rewrites every match in `gm` in place (of `families`, default all). Returns the matches (now
    replaced) and the misses."""
    matches, misses = find_chains(gm.graph, families)
    replaced: dict[Node, Node] = {}  # a chain's last node -> what replaced it (a chain may feed another)
    for match in matches:
        replaced[match.last] = match.family.replace(gm.graph, match, replaced, kernel)
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
