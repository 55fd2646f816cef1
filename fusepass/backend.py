"""The torch.compile backend, a pipeline over each graph Dynamo captures: find the families' chains
(matcher.py), decide which run fused (all of them, or timing.py's verdicts with time_unfused=True),
apply the families' replacements (rewrite.py), and compile with Inductor, falling back to unfused code
if any of it fails.

Registered as "fusepass" through the `torch_dynamo_backends` entry point (see pyproject.toml), so
`torch.compile(model, backend="fusepass", mode=..., options=...)` works without importing fusepass.
Importing this module (torch does, to resolve the backend's name) installs the two hooks a fusepass
compile needs before Dynamo traces: DDPOptimizer's (ddp.py) and SyncBatchNorm's (sync_batch_norm.py).
Both act only in compiles whose backend is fusepass's; `import fusepass` alone installs neither.

What the backend did is counted in `torch._dynamo.utils.counters["fusepass"]`:

- "graphs": graphs the backend compiled (with or without a chain to fuse; not one Dynamo restarted);
- "rewrites": fused chains in use. A graph's rewrites count once it has compiled, and are taken back
  out if its first call fails and it falls back, so a graph that runs without fused ops adds none;
- "linears": bare linears running on fusepass's linear op (the bare-linear family), counted likewise;
- "unfused": matches left to Inductor because its code for them measured faster (timing.py);
- "fallbacks": graphs that run with the fallback compiler because rewriting, compiling or the first
  call of their fused graph failed (each also warns with FusepassFallbackWarning).

A key appears once it has been counted: a process whose graphs all fused has no "fallbacks" key.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import Counter
from typing import Any, Callable, Optional

import torch
from torch._dynamo.exc import RestartAnalysis
from torch._dynamo.utils import counters
from torch._inductor.compile_fx import compile_fx
from torch.fx import GraphModule

from fusepass import compile_workers, ddp, sync_batch_norm, timing
from fusepass.compile_context import mark_fusepass_backend
from fusepass.explain import Report, write_debug_dump
from fusepass.matcher import find_chains
from fusepass.options import FusepassFallbackWarning, Options
from fusepass.rewrite import apply, copy_graph_module

log = logging.getLogger(__name__)
# Debug directories whose dump failed and has been warned about (once per directory and process).
_failed_dump_dirs: set[str] = set()



@mark_fusepass_backend
def fusepass_backend(gm: GraphModule, example_inputs: list, mode: Optional[str] = None,
                     options: Optional[dict[str, Any]] = None) -> Callable:
    opts = Options.parse(mode, options)
    if opts.launches_fused_kernels_statically:
        compile_workers.start()  # as Inductor's backend does, set to launch fusepass's kernels statically
    compiled = _compile(gm, example_inputs, opts)
    stats()["graphs"] += 1  # once the graph is done with: not a graph Dynamo asked to trace again
    return compiled


def _compile(gm: GraphModule, example_inputs: list, opts: Options) -> Callable:
    """Find, decide, apply, compile; the graph unfused through the fallback compiler if any step fails."""
    ddp.inline_chains(gm)  # a DDP piece's chains, held whole across the bucket cuts (ddp.py)
    original = copy_graph_module(gm)
    try:
        matches, misses = find_chains(gm.graph, opts.families)
        if opts.time_unfused:
            compile_candidate = timing.compiler_without(opts.inductor_patches, compile_fx)
            matches, left_to_inductor = timing.keep_faster(gm, matches, example_inputs, opts.kernel, compile_candidate)
            misses += left_to_inductor
        apply(gm, matches, opts.kernel)
        report = Report()
        report.add_graph(matches, misses)
        log.info("%s", report)
        if opts.debug_dir:
            _debug_dump(opts.debug_dir, original, gm, report)
        if matches:
            mutated = mutated_input_positions(gm)
            compiled = compile_fx(gm, example_inputs, config_patches=opts.inductor_patches)
    except RestartAnalysis:  # Dynamo's request to trace again (a symbolic float it wants specialized, say)
        raise
    except Exception as exc:  # never break the user's model: compile it without fused ops
        return _fall_back(original, example_inputs, opts, f"rewriting or compiling failed: {exc!r}")
    counted = _count_by_family(matches)
    stats().update(counted)
    unfused = sum(miss.reason.startswith(timing.LEFT_TO_INDUCTOR) for miss in misses)
    if unfused:
        stats()["unfused"] += unfused
    if not matches:  # nothing of fusepass's in this graph: plain Inductor, its errors its own
        return compile_fx(gm, example_inputs, config_patches=opts.inductor_patches)
    contexts = _compile_contexts()

    def compile_fallback() -> Callable:
        with contexts():
            return _compile_fallback(original, example_inputs, opts)

    def report_fallback(exc: Exception) -> None:
        _report_fallback(opts, f"the fused graph failed on its first call: {exc!r}", not_used=counted)
    return _FirstCallGuard(compiled, mutated, compile_fallback, report_fallback)


def _compile_contexts() -> Callable[[], contextlib.AbstractContextManager]:
    """Re-enters, later, the contexts Dynamo compiles this graph in (its tracing context: fake mode, shape
    environment, guards). A fallback compiled at the first call needs them: outside, compile_fx takes
    symbolic example inputs for static ones (a graph for one batch size) and Inductor finds no hint for
    their symbols."""
    tracing_context = torch._guards.TracingContext.try_get()
    compile_context = torch._guards.CompileContext.try_get()

    @contextlib.contextmanager
    def contexts():
        with torch._guards.compile_context(compile_context), torch._guards.tracing(tracing_context):
            yield
    return contexts


def stats() -> Counter:
    """counters["fusepass"] ("graphs", "rewrites", "linears", "unfused", "fallbacks": see the module
    docstring), looked up at each count: `counters.clear()`, PyTorch's usual reset, replaces it."""
    return counters["fusepass"]


def _count_by_family(matches: list) -> Counter:
    return Counter(match.family.counter for match in matches)


def _debug_dump(debug_dir: str, before: GraphModule, after: GraphModule, report: Report) -> None:
    """Writes the debug dump; a dump that cannot be written warns once per directory and leaves the
    rewritten graph as it is (the dump is a by-product, not a reason to give up the fused ops)."""
    try:
        write_debug_dump(debug_dir, before, after, report)
    except Exception as exc:
        log.debug("fusepass: debug dump to %r failed: %r", debug_dir, exc)
        if debug_dir not in _failed_dump_dirs:
            _failed_dump_dirs.add(debug_dir)
            warnings.warn(f"fusepass: cannot write the debug dump to {debug_dir!r} ({exc!r}); "
                          "compiling goes on without it", UserWarning, stacklevel=2)


def _fall_back(original: GraphModule, example_inputs: list, opts: Options, why: str) -> Callable:
    _report_fallback(opts, why)
    return _compile_fallback(original, example_inputs, opts)


def _report_fallback(opts: Options, why: str, not_used: Optional[Counter] = None) -> None:
    stats()["fallbacks"] += 1
    stats().subtract(not_used or Counter())
    warnings.warn(f"fusepass: {why}; this graph falls back to {opts.fallback}", FusepassFallbackWarning,
                  stacklevel=3)


def _compile_fallback(original: GraphModule, example_inputs: list, opts: Options) -> Callable:
    if opts.fallback == "eager":
        return original.forward
    return compile_fx(original, example_inputs, config_patches=opts.inductor_patches)


# Calls the graph holds whole that change some of their arguments in place, by position: the standalone
# SyncBatchNorm writes its running statistics.
IN_PLACE_ARGUMENTS = {sync_batch_norm.sync_batch_norm: (1, 2)}


def mutated_input_positions(gm: GraphModule) -> list[int]:
    """Positions of the graph inputs that the graph changes in place (running statistics, counters):
    the first argument of an in-place call (PyTorch names them with a trailing underscore), every tensor
    of it for a foreach call, and the arguments IN_PLACE_ARGUMENTS names."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = []
    for node in gm.graph.nodes:
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        in_place = isinstance(name, str) and name.endswith("_") and not name.endswith("__")
        if in_place and node.args:
            first = node.args[0]
            written += first if isinstance(first, (list, tuple)) else [first]
        if node.op == "call_function" and node.target in IN_PLACE_ARGUMENTS:
            written += [node.args[i] for i in IN_PLACE_ARGUMENTS[node.target] if i < len(node.args)]
    return [i for i, p in enumerate(placeholders) if any(p is w for w in written)]


class _FirstCallGuard:
    """Runs the fused graph; if its first call fails (a Triton kernel that does not compile, say),
    restores the inputs the graph mutates in place, runs the fallback, and, if that runs, switches this
    graph to it for good. If the fallback fails on the same inputs too (an index out of range, say), the
    error is the inputs', not the fused graph's: it is raised and the fused graph stays, as it does when
    the call runs out of memory (eager would fail the same way; a search for the largest batch catches
    it)."""

    def __init__(self, compiled: Callable, mutated_positions: list[int], compile_fallback: Callable[[], Callable],
                 report_fallback: Callable[[Exception], None]):
        self._compiled = compiled
        self._compile_fallback = compile_fallback
        self._report_fallback = report_fallback
        self._fallback: Optional[Callable] = None
        self._mutated_positions = mutated_positions
        self._checked = False

    def __call__(self, *args: Any) -> Any:
        if self._checked:
            return self._compiled(*args)
        saved = {i: args[i].detach().clone() for i in self._mutated_positions}
        try:
            result = self._compiled(*args)
        except Exception as exc:
            _restore(args, saved)
            if isinstance(exc, torch.OutOfMemoryError):
                raise
            self._fallback = self._fallback or self._compile_fallback()
            try:
                result = self._fallback(*args)
            except Exception:
                _restore(args, saved)
                raise
            self._report_fallback(exc)
            self._compiled = self._fallback
        self._checked, self._fallback = True, None
        return result


def _restore(args: tuple, saved: dict[int, torch.Tensor]) -> None:
    with torch.no_grad():
        for i, value in saved.items():
            args[i].copy_(value)


ddp.install()
sync_batch_norm.install()
