"""Replaces matched chains in an FX graph with their families' fused operators."""

from __future__ import annotations

import copy
from typing import Callable, Optional

from torch.fx import Graph, GraphModule, Node

from fusepass.lowering.schema import Kernel
from fusepass.pattern import ChainFamily, Match, Miss, find_chains
from fusepass.race import Verdict

UNFUSED_REASON = "left to Inductor, whose code for it measured faster"


def rewrite(gm: GraphModule, kernel: Kernel = Kernel(), families: Optional[tuple[ChainFamily, ...]] = None,
            decide: Optional[Callable[[Match], Verdict]] = None) -> tuple[list[Match], list[Miss]]:
    """Rewrites every match in `gm` in place (of `families`, default all). `decide`, if given, says of
    each match (before any is rewritten) whether it runs fused; one that does not becomes a miss with
    the verdict's reason. Returns the matches (now replaced) and the misses."""
    matches, misses = find_chains(gm.graph, families)
    if decide is not None:
        matches, unfused = _decided(matches, decide)
        misses += unfused
    replaced: dict[Node, Node] = {}  # a chain's last node -> what replaced it (a chain may feed another)
    for match in matches:
        replaced[match.last] = match.family.replace(gm.graph, match, replaced, kernel)
    if matches:
        gm.graph.lint()
        gm.recompile()
    return matches, misses


def _decided(matches: list[Match], decide: Callable[[Match], Verdict]) -> tuple[list[Match], list[Miss]]:
    fused, unfused = [], []
    for match in matches:
        verdict = decide(match)
        match.verdict = verdict.why
        if verdict.fused:
            fused.append(match)
        else:
            unfused.append(Miss(match.last, f"{UNFUSED_REASON} ({verdict.why})", match.nodes))
    return fused, unfused


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A GraphModule sharing gm's attributes but with its own copy of the graph (node meta kept)."""
    graph = Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    duplicate = GraphModule(gm, graph)
    duplicate.meta.update(getattr(gm, "meta", {}))
    return duplicate
