"""The torch.compile backend: rewrite the Dynamo graph's chains into fused ops, then hand it to Inductor.

Registered as "fusepass" through the `torch_dynamo_backends` entry point (see pyproject.toml), so
`torch.compile(model, backend="fusepass", mode=..., options=...)` works without importing fusepass.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Optional

from torch._inductor.compile_fx import compile_fx
from torch.fx import GraphModule

from fusepass.explain import Report, write_debug_dump
from fusepass.options import Options
from fusepass.rewrite import copy_graph_module, rewrite

log = logging.getLogger(__name__)


class FusepassFallbackWarning(UserWarning):
    """A graph could not use fused ops and runs with the fallback compiler instead."""


def fusepass_backend(gm: GraphModule, example_inputs: list, mode: Optional[str] = None,
                     options: Optional[dict[str, Any]] = None) -> Callable:
    opts = Options.parse(mode, options)
    original = copy_graph_module(gm)
    try:
        matches, misses = rewrite(gm)
        report = Report()
        report.add_graph(matches, misses)
        log.info("%s", report)
        if opts.debug_dir:
            write_debug_dump(opts.debug_dir, original, gm, report)
        compiled = compile_fx(gm, example_inputs, config_patches=opts.inductor_patches)
    except Exception as exc:  # never break the user's model: compile it without fused ops
        return _fall_back(original, example_inputs, opts, f"rewriting or compiling failed: {exc!r}")
    if not matches:
        return compiled
    return _FirstCallGuard(compiled, lambda exc: _fall_back(
        original, example_inputs, opts, f"the fused graph failed on its first call: {exc!r}"))


def _fall_back(original: GraphModule, example_inputs: list, opts: Options, why: str) -> Callable:
    warnings.warn(f"fusepass: {why}; this graph falls back to {opts.fallback}", FusepassFallbackWarning,
                  stacklevel=2)
    if opts.fallback == "eager":
        return original.forward
    return compile_fx(original, example_inputs, config_patches=opts.inductor_patches)


class _FirstCallGuard:
    """Runs the fused graph; if its first call fails (a Triton kernel that does not compile, say),
    switches this graph to the fallback for good. A compiled graph applies its input mutations
    (running statistics) only after it finishes, so the retry sees the inputs unchanged."""

    def __init__(self, compiled: Callable, make_fallback: Callable[[Exception], Callable]):
        self._compiled = compiled
        self._make_fallback = make_fallback
        self._checked = False

    def __call__(self, *args: Any) -> Any:
        if self._checked:
            return self._compiled(*args)
        try:
            result = self._compiled(*args)
        except Exception as exc:
            self._compiled = self._make_fallback(exc)
            result = self._compiled(*args)
        self._checked = True
        return result
