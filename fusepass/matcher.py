"""The generic matcher: chains of FX nodes that a family declares as steps around an anchor.

A chain family (fusepass/families/) is a list of steps around an anchor, each step a parser that
recognises one FX node and normalizes its arguments once, or a region step that grows over several nodes.
The matcher anchors on the family's anchor (the rare op), walks back through the head steps and forward
through the tail steps; every anchor it cannot fuse, and every tail step it had to leave out, becomes a
Miss with the reason for `explain()`. It knows no family: what a step means, and what replaces a match,
is the family's own business.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch.fx import Graph, Node


class NoMatch(Exception):
    """A node does not fit a step; the message is the reason shown in explain()."""


# What Dynamo writes into a graph where grad mode, inference mode or autocast change: the nodes after
# it run in another mode. A chain must not cross one: its op runs every step in one mode. (Private
# functions, looked up by name: a torch version may lack one.)
_ENTER_AUTOCAST = getattr(torch.amp.autocast_mode, "_enter_autocast", None)
_EXIT_AUTOCAST = getattr(torch.amp.autocast_mode, "_exit_autocast", None)
MODE_CHANGES = tuple(f for f in (
    torch._C._set_grad_enabled,
    getattr(torch.autograd.grad_mode, "_enter_inference_mode", None),
    getattr(torch.autograd.grad_mode, "_exit_inference_mode", None),
    _ENTER_AUTOCAST,
    _EXIT_AUTOCAST,
) if f is not None)


def meta_value(node: Any) -> Any:
    """The fake tensor (or SymInt) Dynamo recorded for a node; None for non-nodes."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def under_autocast(node: Node) -> bool:
    """Whether autocast is on for the node's device where it runs: entered around the compiled code
    (Dynamo guards on that, so it holds while compiling), or by an autocast region in the graph."""
    device = meta_value(node).device.type
    if torch.is_autocast_enabled(device):
        return True
    closed = 0
    previous = node.prev
    while previous.op != "root":  # back to the innermost region still open at the node
        if is_call(previous, (_EXIT_AUTOCAST,)):
            closed += 1
        elif is_call(previous, (_ENTER_AUTOCAST,)):
            if closed:
                closed -= 1
            elif previous.args[0] == device:
                return bool(previous.args[2])
        previous = previous.prev
    return False


def bind_arguments(node: Node, names: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
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


def is_call(node: Any, targets: tuple) -> bool:
    return isinstance(node, Node) and (
        (node.op == "call_function" and node.target in targets)
        or (node.op == "call_method" and getattr(torch.Tensor, str(node.target), None) in targets)
    )


def describe_node(node: Any) -> str:
    if not isinstance(node, Node):
        return repr(node)
    if node.op == "placeholder":
        return f"graph input `{node.name}` (a Dynamo graph break may separate it from its producer)"
    if node.op == "call_function":
        return f"`{node.name}` ({getattr(node.target, '__name__', node.target)})"
    return f"`{node.name}` ({node.op} {node.target})"


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
        if not is_call(node, self.targets):
            raise NoMatch(f"expected {self.name}, found {describe_node(node)}")
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
    verdict: Optional[str] = None  # why it runs fused rather than as Inductor's code (timing.py), if timed

    @property
    def pattern(self) -> str:
        names = []
        for step in self.steps:
            args = self.args.get(step.key)
            names += list(getattr(args, "names", None) or [step.name])  # a step may name itself by its args
        return "_".join(names)

    @property
    def last(self) -> Node:
        """The node whose value the fused op replaces."""
        return self.nodes[-1]

    def get(self, key: str) -> Any:
        return self.args.get(key)


def carry_sources(new_nodes: list[Node], replaced: tuple[Node, ...]) -> None:
    """Gives nodes that replace others where they came from: the last replaced node's stack trace (what
    a dump of the graph prints above them) and, in meta["fusepass_sources"], every replaced node's
    source line, once each, in order."""
    trace = next((n.meta["stack_trace"] for n in reversed(replaced) if n.meta.get("stack_trace")), None)
    sources = list(dict.fromkeys(line for n in replaced if (line := source_line(n))))
    for node in new_nodes:
        if trace:
            node.meta["stack_trace"] = trace
        node.meta["fusepass_sources"] = sources


def source_line(node: Node) -> str:
    """`file:line` of the user's code a node came from (the innermost frame of its stack trace), or ""."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""


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
                                 (is_call(node, step.targets), not step.optional)))
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
        users = [u for u in node.users if is_call(u, step.targets)]
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
    change = _mode_change_within(match.nodes)
    if change is not None:
        return _Failure(f"`{change.name}` changes grad mode or autocast between the chain's steps",
                        len(match.nodes), match.nodes)
    mutation = _input_mutated_within(match.nodes)
    if mutation is not None:
        return _Failure(f"`{mutation.name}` changes one of the chain's inputs in place between its steps",
                        len(match.nodes), match.nodes)
    return match, left_out


def _input_mutated_within(nodes: tuple[Node, ...]) -> Optional[Node]:
    """The first node between the chain's first and last (graph order) that changes in place a tensor the
    chain reads from outside: the fused op stands at the last node's place and would read the changed
    value where eager's first steps read the old one."""
    chain = set(nodes)
    inputs = {_alias_root(i) for n in nodes for i in n.all_input_nodes if i not in chain}
    for node in _between(nodes):
        mutated = _mutated(node) if node not in chain else None
        if mutated is not None and _alias_root(mutated) in inputs:
            return node
    return None


def _between(nodes: tuple[Node, ...]) -> Iterator[Node]:
    """The graph's nodes after the first of `nodes` up to the last, in graph order."""
    node = nodes[0]
    while node is not nodes[-1]:
        node = node.next
        yield node


# Views: a result that shares its first argument's storage. `_get_data_attr` is Dynamo's `.data`.
_VIEW_METHODS = {"view", "view_as", "t", "transpose", "permute", "reshape", "expand", "expand_as", "detach",
                 "narrow", "select", "squeeze", "unsqueeze", "flatten", "unflatten", "as_strided",
                 "contiguous", "__getitem__"}
_VIEW_FUNCTIONS = {torch._C._autograd._get_data_attr, operator.getitem, torch.t, torch.transpose,
                   torch.permute, torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze, torch.narrow,
                   torch.select, torch.detach}
_IN_PLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                       operator.ixor, operator.ilshift, operator.irshift}


def _alias_root(node: Node) -> Node:
    """The node whose storage `node` views, through view ops and `.data`."""
    while node.args and isinstance(node.args[0], Node) and (
            (node.op == "call_method" and node.target in _VIEW_METHODS)
            or (node.op == "call_function" and node.target in _VIEW_FUNCTIONS)):
        node = node.args[0]
    return node


def _mutated(node: Node) -> Optional[Node]:
    """The tensor a node changes in place (an `x.add_(...)`, `x[i] = v`, `x += v`, `inplace=True`), or None."""
    if node.op not in ("call_method", "call_function") or not node.args or not isinstance(node.args[0], Node):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    in_place = (name.endswith("_") and not name.startswith("__")) or node.kwargs.get("inplace") is True
    return node.args[0] if in_place or node.target in _IN_PLACE_OPERATORS else None


def _mode_change_within(nodes: tuple[Node, ...]) -> Optional[Node]:
    """The first node of MODE_CHANGES in graph order between the first and the last of `nodes`."""
    return next((node for node in _between(nodes) if is_call(node, MODE_CHANGES)), None)


def find_chains(graph: Graph, families: tuple[ChainFamily, ...]) -> tuple[list[Match], list[Miss]]:
    """Every chain of `families` in `graph`, and every anchor-like node that could not be fused, with why.
    `families` in priority order: a node belongs to the first family that matches it, and a later family
    neither matches nor reports it."""
    matches, misses, claimed = [], [], set()
    for family in families:
        for node in graph.nodes:
            if node in claimed or not is_call(node, family.anchor.targets):
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
