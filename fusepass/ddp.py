"""DistributedDataParallel: no fused chain is lost to a gradient-bucket cut.

Under `DDP`, Dynamo's DDPOptimizer (the default `optimize_ddp="ddp_optimizer"`) cuts the captured graph
where a gradient bucket fills and calls the backend once per piece, so a cut can fall inside a chain.
Before it cuts, fusepass holds each matched chain as one call node (`ChainCall`, its arguments the
chain's inputs: its parameters among them, so buckets are sized as before). A cut can fall before or
after that node, not inside it. The backend, given a piece, first puts each chain's nodes back
(`inline_chains`) and then fuses as usual, with the usual fallback to unfused Inductor code.

The hook is a wrapper around `DDPOptimizer.compile_fn` that acts only when the backend it splits for is
fusepass's; torch offers no pass before the split. `optimize_ddp="python_reducer"` and
`"no_optimization"` keep the graph whole and need nothing of this.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

from torch.fx import Graph, GraphModule, Node

from torch._dynamo.backends.distributed import DDPOptimizer

from fusepass.compile_context import fusepass_kwargs
from fusepass.matcher import Match, find_chains
from fusepass.options import FusepassFallbackWarning, Options


class ChainCall:
    """A matched chain's nodes as one callable: what the call node in the graph runs (DDPOptimizer runs
    the pieces on fake tensors) until the backend inlines it."""

    __name__ = "fusepass_chain"

    def __init__(self, graph_module: GraphModule, pattern: str):
        self.graph_module = graph_module
        self.pattern = pattern

    def __call__(self, *args: Any) -> Any:
        return self.graph_module(*args)

    def __repr__(self) -> str:
        return f"fusepass_chain[{self.pattern}]"


def group_chains(gm: GraphModule, matches: list[Match]) -> int:
    """Replaces each of `matches` (find_chains's, in gm) of two or more nodes by one ChainCall node;
    returns how many."""
    grouped = sum(_group(gm.graph, match) for match in matches if len(match.nodes) > 1)
    if grouped:
        gm.graph.lint()
        gm.recompile()
    return grouped


def _group(graph: Graph, match: Match) -> bool:
    members = set(match.nodes)
    if any(user not in members for node in match.nodes[:-1] for user in node.users):
        return False  # a value inside the chain is read outside it: not one call with one result
    inputs: list[Node] = []
    for node in match.nodes:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in inputs:
                inputs.append(arg)
    chain = Graph()
    env = {arg: chain.placeholder(arg.name) for arg in inputs}
    for arg, placeholder in env.items():
        placeholder.meta = dict(arg.meta)
    for node in match.nodes:
        env[node] = chain.node_copy(node, lambda n: env[n])
    chain.output(env[match.last])
    call_target = ChainCall(GraphModule(graph.owning_module, chain), match.pattern)
    with graph.inserting_before(match.last):
        call = graph.call_function(call_target, tuple(inputs))
    call.meta = dict(match.last.meta)
    match.last.replace_all_uses_with(call)
    for node in reversed(match.nodes):
        graph.erase_node(node)
    return True


def inline_chains(gm: GraphModule) -> int:
    """Puts the nodes of every ChainCall in `gm` back in its place; returns how many."""
    calls = [node for node in gm.graph.nodes if node.op == "call_function" and isinstance(node.target, ChainCall)]
    for call in calls:
        chain = call.target.graph_module.graph
        placeholders = [node for node in chain.nodes if node.op == "placeholder"]
        env = dict(zip(placeholders, call.args))
        with gm.graph.inserting_before(call):
            for node in chain.nodes:
                if node.op == "placeholder":
                    continue
                if node.op == "output":
                    call.replace_all_uses_with(env[node.args[0]])
                    break
                env[node] = gm.graph.node_copy(node, lambda n: env[n])
        gm.graph.erase_node(call)
    if calls:
        gm.graph.lint()
        gm.recompile()
    return len(calls)


def _group_or_leave(gm: GraphModule, kwargs: dict) -> None:
    """Groups gm's chains in place. If finding them fails, gm is left as it is (with one warning): the
    split goes on as torch does it, and only chains that a cut falls into stay unfused."""
    try:
        families = Options.parse(kwargs.get("mode"), kwargs.get("options")).families
        matches, _ = find_chains(gm.graph, families)
    except Exception as exc:
        warnings.warn(f"fusepass: keeping chains whole across DDP's bucket cuts failed ({exc!r}); "
                      "chains that a cut falls into are not fused", FusepassFallbackWarning, stacklevel=2)
        return
    group_chains(gm, matches)


def install() -> None:
    """Wraps DDPOptimizer.compile_fn once per process (fusepass.backend and explain() call this)."""
    split_and_compile = DDPOptimizer.compile_fn
    if getattr(split_and_compile, "fusepass_groups_chains", False):
        return

    @functools.wraps(split_and_compile)
    def compile_fn(self, gm: GraphModule, example_inputs: list, **compiler_configs: Any) -> Callable:
        kwargs = fusepass_kwargs(self.backend_compile_fn)
        if kwargs is not None:
            _group_or_leave(gm, kwargs)
        return split_and_compile(self, gm, example_inputs, **compiler_configs)

    compile_fn.fusepass_groups_chains = True
    DDPOptimizer.compile_fn = compile_fn
