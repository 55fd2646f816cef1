"""The backend's deciding stage: whether each match runs as fusepass's fused op or as the code Inductor
generates for its own nodes (`keep_faster`: the matches to keep, and a miss for each left to Inductor).

Each is compiled on its own from the match's nodes (the unfused one exactly as the graph has them, the
fused one after its family's rewrite) and run on the match's inputs: the graph's own values where a
node is a graph input (cloned: a timed batch norm updates its running statistics), random stand-ins for
activations. Both are timed by the tuner, L2 flushed as for the fused op's implementations but launched
from Python (tuning.launched_time), not replayed from a CUDA graph: a capture of a compiled backward
that fails leaves CUDA's random-number generator in capture mode, and the next torch.randn fails (seen
under bf16 autocast on an H200). Forward only where no gradient flows, forward plus backward where one
does (the training step that will run); the faster is kept; the verdict is cached on disk with the
tuner's choices, so a match is timed once per problem, size bucket, GPU and fusepass version.

Only with the backend option time_unfused=True (off by default: it adds seconds to a first compile),
on CUDA, with static shapes, and while the tuner times at all (FUSEPASS_TUNE=0 keeps every match fused).
Inductor's code must also meet fusepass's numerical contract on the same inputs (no further from a
float64 run than eager): otherwise the match stays fused, however fast Inductor's code is.

The times a match was decided by are in the backend's report (its log and debug dump) and explain();
a later process that reads the verdict from the cache reports it as cached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Optional

import torch
from torch._dynamo.metrics_context import MetricsContext
from torch.fx import Graph, GraphModule, Node

from fusepass.lowering import tuning
from fusepass.lowering.schema import KernelOptions
from fusepass.lowering.tuning import TUNER, Problem, bucket
from fusepass.numerics import no_further_than_eager, rel_error
from fusepass.matcher import Match, Miss, find_chains, meta_value
from fusepass.rewrite import apply
from fusepass.sync_batch_norm import sync_batch_norm

log = logging.getLogger(__name__)
FUSED = "fused"
LEFT_TO_INDUCTOR = "left to Inductor, whose code for it measured faster"
UNFUSED = "unfused (Inductor)"
NOT_YET_TIMED = f"{FUSED}; with the option time_unfused=True, timed against Inductor's code when first compiled"
# Inductor options that the compiled candidates leave out: a candidate is timed as a default-mode step.
UNTIMED_PATCHES = ("triton.cudagraphs",)


@dataclasses.dataclass(frozen=True)
class Verdict:
    fused: bool
    why: str


Compiler = Callable[[GraphModule, list], Callable]


def keep_faster(gm: GraphModule, matches: list[Match], example_inputs: list, kernel: KernelOptions,
                compile_fn: Compiler) -> tuple[list[Match], list[Miss]]:
    """The matches that run fused, and a miss for each left to Inductor's faster code. Each is timed on
    `gm` as given (before any is replaced); its verdict is kept on the match for the report."""
    kept, left = [], []
    for match in matches:
        verdict = decide(gm, match, example_inputs, kernel, compile_fn)
        match.verdict = verdict.why
        if verdict.fused:
            kept.append(match)
        else:
            left.append(Miss(match.last, f"{LEFT_TO_INDUCTOR} ({verdict.why})", match.nodes))
    return kept, left


def decide(gm: GraphModule, match: Match, example_inputs: list, kernel: KernelOptions,
           compile_fn: Compiler) -> Verdict:
    """The verdict for `match` in `gm` (not yet rewritten); `example_inputs` are the graph's inputs,
    `compile_fn` compiles a graph module as the backend compiles the rest (Inductor)."""
    untimed = _why_not_timed(match)
    if untimed:
        return Verdict(True, f"{FUSED}: not timed against Inductor: {untimed}")
    try:
        return _time_both(gm, match, example_inputs, kernel, compile_fn)
    except Exception as exc:  # noqa: BLE001  (timing is an optimization: the match stays fused)
        log.warning("fusepass: timing %s against Inductor's code failed (%r); it stays fused", match.pattern, exc)
        return Verdict(True, f"{FUSED}: not timed against Inductor: {exc!r}")


def recorded(gm: GraphModule, match: Match, kernel: KernelOptions) -> str:
    """What a compile would decide for `match` without timing anything: the cached verdict, or why
    there is none yet."""
    untimed = _why_not_timed(match)
    if untimed:
        return f"{FUSED}: not timed against Inductor: {untimed}"
    _, problem, choice = _cached(gm, match, kernel)
    return _describe(problem, choice) if choice else NOT_YET_TIMED


def _cached(gm: GraphModule, match: Match, kernel: KernelOptions) -> tuple[GraphModule, Problem, Optional[str]]:
    """The match's nodes alone (extract), its problem key, and the verdict cached for it, if any."""
    unfused = extract(gm, match.nodes)
    problem = problem_key(match, unfused, kernel)
    return unfused, problem, TUNER.cached(problem, meta_value(match.last).device)


def _time_both(gm: GraphModule, match: Match, example_inputs: list, kernel: KernelOptions,
               compile_fn: Compiler) -> Verdict:
    unfused, problem, cached = _cached(gm, match, kernel)
    if cached:  # nothing to compile or run
        return Verdict(cached == FUSED, _describe(problem, cached))
    fused = extract(gm, match.nodes)
    rewritten, _ = find_chains(fused.graph, (match.family,))
    apply(fused, rewritten, kernel)
    if len(rewritten) != 1:
        return Verdict(True, f"{FUSED}: not timed against Inductor: the match does not stand alone")
    inputs = stand_ins(gm, unfused, example_inputs)
    device = meta_value(match.last).device
    upstream = _upstream_gradients(unfused)
    runners = {FUSED: _compiled_step(compile_fn, fused, inputs, upstream),
               UNFUSED: _compiled_step(compile_fn, unfused, inputs, upstream)}
    inaccurate = _further_than_eager(unfused, inputs, upstream, runners[UNFUSED])
    if inaccurate:  # remembered like a timed verdict: the next compile does not compile both again
        TUNER.record(problem, device, FUSED)
        return Verdict(True, f"{FUSED}: Inductor's code is further from float64 than eager ({inaccurate})")
    with _isolated():
        choice = TUNER.choose(problem, device, runners, clock=tuning.launched_time)
    return Verdict(choice == FUSED, _describe(problem, choice))


def _why_not_timed(match: Match) -> Optional[str]:
    if tuning.search() == "off":
        return f"{tuning.TUNE_ENV}=0"
    if not hasattr(torch._functorch.config, "force_non_lazy_backward_lowering"):
        # A CUDA backward runs on autograd's device thread; compiled lazily there, inside this compile,
        # it would wait for the compile lock this thread holds.
        return "this torch cannot compile a candidate's backward ahead of its first call"
    if any(n.target is sync_batch_norm for n in match.nodes):
        # Both ways run collectives, which only the timing rank would issue: another may read the verdict
        # from the cache, and would hang or be corrupted by the collectives it never joins.
        return "a SyncBatchNorm chain (timing it would issue collectives on this rank alone)"
    values = [meta_value(n) for n in match.nodes]
    if not all(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in values):
        return "not on CUDA"
    if not all(isinstance(s, int) for v in values for s in v.shape):
        return "symbolic shapes"
    return None


def extract(gm: GraphModule, nodes: tuple[Node, ...]) -> GraphModule:
    """A graph module computing `nodes` alone: each value they read from outside becomes a placeholder
    (named and with the meta of the node it stands for), each of them used outside is an output."""
    members = set(nodes)
    graph = Graph()
    env: dict[Node, Node] = {}

    def outside(node: Node) -> Node:
        if node not in env:
            env[node] = graph.placeholder(node.name)
            env[node].meta.update(node.meta)
        return env[node]

    for node in gm.graph.nodes:  # graph order: a node's inputs come before it
        if node in members:
            env[node] = graph.node_copy(node, lambda n: env[n] if n in members else outside(n))
    outputs = [n for n in nodes if any(user not in members for user in n.users)]
    graph.output(tuple(env[n] for n in outputs))
    return GraphModule(gm, graph)


def stand_ins(gm: GraphModule, sub: GraphModule, example_inputs: list) -> list:
    """Inputs for `sub`: clones of the graph's own inputs (a batch norm's running variance must stay
    positive, a user's buffers untouched) and random activations shaped as recorded."""
    graph_inputs = {n.name: value for n, value in zip(_placeholders(gm), example_inputs)}
    inputs = []
    for node in _placeholders(sub):
        value = graph_inputs.get(node.name)
        recorded = meta_value(node)
        if isinstance(value, torch.Tensor):
            inputs.append(value.detach().clone().requires_grad_(value.requires_grad))
        elif isinstance(recorded, torch.Tensor):
            inputs.append(_random_like(recorded))
        else:
            inputs.append(value if value is not None else recorded)
    return inputs


def _random_like(value: torch.Tensor) -> torch.Tensor:
    shape = tuple(value.shape)
    if value.dtype.is_floating_point:
        t = torch.randn(shape, dtype=value.dtype, device=value.device)
        return t.requires_grad_(value.requires_grad)
    return torch.zeros(shape, dtype=value.dtype, device=value.device)


def _placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _upstream_gradients(sub: GraphModule) -> list[torch.Tensor]:
    """Random upstream gradients for the outputs of `sub` that need one, shaped as recorded."""
    values = [meta_value(n) for n in _outputs(sub)]
    return [_random_like(v).detach() for v in values if isinstance(v, torch.Tensor) and v.requires_grad]


def _outputs(sub: GraphModule) -> tuple[Node, ...]:
    [output] = [n for n in sub.graph.nodes if n.op == "output"]
    return tuple(output.args[0])


def _step(fn: Callable, inputs: list, upstream: list[torch.Tensor]) -> list[torch.Tensor]:
    """fn's outputs on `inputs`, then, where gradients flow, the gradients (to `upstream`) of the
    inputs that need one."""
    outputs = [o for o in fn(*inputs) if isinstance(o, torch.Tensor)]
    needing = [o for o in outputs if o.requires_grad]
    grad_inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not needing or not grad_inputs:
        return outputs
    grads = torch.autograd.grad(needing, grad_inputs, [u.to(o.dtype) for u, o in zip(upstream, needing)],
                                allow_unused=True)
    return outputs + [g for g in grads if g is not None]


def _compiled_step(compile_fn: Compiler, sub: GraphModule, inputs: list,
                   upstream: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
    """Compiles `sub` (in a compile context of its own: the enclosing graph's compile keeps its state)
    and returns its step on `inputs`. The backward is compiled now, not at its first call: a CUDA
    backward runs on autograd's device thread, which would wait for the compile lock this thread holds
    (seen on an H200: the timing hung)."""
    with _isolated(), torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        compiled = compile_fn(sub, list(inputs))
    return lambda: _step(compiled, inputs, upstream)


def _further_than_eager(sub: GraphModule, inputs: list, upstream: list[torch.Tensor],
                        candidate: Callable[[], list[torch.Tensor]]) -> Optional[str]:
    """Which of the candidate's outputs and gradients is further from float64 than eager's (the
    numerical contract, fusepass.numerics) on these inputs, or None. One-element values are left out:
    one sample of rounding noise says nothing (tests/chains.py)."""
    as_float64 = [t.detach().double().requires_grad_(t.requires_grad)
                  if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    reference = _step(sub, as_float64, [u.double() for u in upstream])
    eager = _step(sub, inputs, upstream)
    with _isolated():
        values = candidate()
    n_outputs = len(_outputs(sub))
    for i, (value, eager_value, ref) in enumerate(zip(values, eager, reference)):
        error, eager_error = rel_error(value, ref), rel_error(eager_value, ref)
        if ref.numel() > 1 and not no_further_than_eager(error, eager_error):
            what = f"output {i}" if i < n_outputs else f"gradient {i - n_outputs}"
            return f"{what}: {error:.3g} to eager's {eager_error:.3g}"
    return None


@contextlib.contextmanager
def _isolated():
    """Compiles and runs a candidate as if no other compile were in progress: no tracing context, and
    compile metrics of its own (compiling its backward would otherwise set the enclosing compile's
    metrics a second time, which torch refuses)."""
    tls = getattr(torch._dynamo.utils, "_metrics_context_tls", None)
    saved = getattr(tls, "metrics_context", None)
    if tls is not None:
        tls.metrics_context = MetricsContext(on_exit=lambda *args, **kwargs: None)
    try:
        with torch._guards.tracing(None):
            yield
    finally:
        if tls is not None:
            if saved is None:
                del tls.metrics_context
            else:
                tls.metrics_context = saved


def problem_key(match: Match, sub: GraphModule, kernel: KernelOptions) -> Problem:
    """What the verdict depends on. Family: the match's pattern, train or eval, its inputs (dtype, rank,
    dimension order of the strides, whether a gradient flows), its features, the ambient precision
    (autocast, TF32, grad mode) and the fused op's options. Bucket: its rows rounded up to a power of two,
    as the ops' choices are."""
    described = match.family.describe(match)
    parts = [f"timed {match.pattern}", f"training={described.get('training')}"]
    for node in _placeholders(sub):
        v = meta_value(node)
        if isinstance(v, torch.Tensor):
            order = ",".join(str(d) for d in sorted(range(v.dim()), key=lambda d: v.stride(d)))
            grad = ":grad" if v.requires_grad else ""
            parts.append(f"{v.dim()}d:{str(v.dtype).removeprefix('torch.')}:{order}{grad}")
        else:
            parts.append(repr(v))
    autocast = (torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None)
    parts += [f"autocast={autocast}", f"tf32={torch.backends.cuda.matmul.allow_tf32}",
              f"grad={torch.is_grad_enabled()}", f"kernel={kernel.fp32_matmul},{kernel.gemm}"]
    (rows, in_features), out_features = described["shapes"]["x"], described["shapes"]["out"][1]
    parts.append(f"features={in_features}->{out_features}")
    return Problem(" ".join(parts), (bucket(rows),))


def _describe(problem: Problem, choice: str) -> str:
    times = TUNER.timings.get(problem.describe())
    if not times:
        return f"{choice}: the tuning cache's choice"
    measured = ", ".join(f"{name} {ms:.3f} ms" for name, ms in sorted(times.items(), key=lambda i: i[1]))
    return f"{choice}: timed {measured}"


def compiler_without(patches: dict[str, Any], compile_fx: Callable) -> Compiler:
    """The backend's compiler for the timed candidates: its Inductor options, less UNTIMED_PATCHES."""
    kept = {k: v for k, v in patches.items() if k not in UNTIMED_PATCHES}
    return lambda sub, inputs: compile_fx(sub, inputs, config_patches=kept)
