"""Whether the compile under way is fusepass's: Dynamo wraps a backend in objects that forward
`compiler_fn` and `kwargs`, and DDPOptimizer wraps it in its own `compile_fn` (a bound method whose
object holds `backend_compile_fn`). A backend counts as fusepass's when it carries the mark
(`mark_fusepass_backend`): fusepass's own, and explain()'s recording backend, which must see the graphs
fusepass would."""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch
from torch._dynamo.symbolic_convert import InstructionTranslator

Backend = TypeVar("Backend", bound=Callable)
MARK = "sees_fusepass_graphs"


def mark_fusepass_backend(backend: Backend) -> Backend:
    """Marks a backend as fusepass's: its compiles capture SyncBatchNorm whole and keep DDP's bucket cuts
    out of chains."""
    setattr(backend, MARK, True)
    return backend


def fusepass_kwargs(compiler_fn: Callable) -> Optional[dict]:
    """The `mode`/`options` of a compile whose backend is fusepass's; None for another backend."""
    fn, kwargs = compiler_fn, {}
    for _ in range(8):  # a few layers of wrapping at most
        kwargs = getattr(fn, "kwargs", None) or kwargs
        if getattr(fn, MARK, False):
            return dict(kwargs)
        fn = getattr(fn, "compiler_fn", None) or getattr(getattr(fn, "__self__", None), "backend_compile_fn", None)
        if fn is None:
            return None
    return None


@torch._dynamo.assume_constant_result
def compiling_with_fusepass() -> bool:
    """Called while Dynamo traces: run then, its result a constant of the graph being traced."""
    tx = InstructionTranslator.current_tx()
    return tx is not None and fusepass_kwargs(tx.output.compiler_fn) is not None
