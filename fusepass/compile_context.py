"""Whether the compile under way is fusepass's: Dynamo wraps a backend in objects that forward
`compiler_fn` and `kwargs`, and DDPOptimizer wraps it in its own `compile_fn` (a bound method whose
object holds `backend_compile_fn`). explain()'s recording backend counts as fusepass's: it must see
the graphs fusepass would."""

from __future__ import annotations

from typing import Callable, Optional

import torch


def fusepass_kwargs(compiler_fn: Callable) -> Optional[dict]:
    """The `mode`/`options` of a compile whose backend is fusepass's; None for another backend."""
    from fusepass.backend import fusepass_backend
    fn, kwargs = compiler_fn, {}
    for _ in range(8):  # a few layers of wrapping at most
        kwargs = getattr(fn, "kwargs", None) or kwargs
        if fn is fusepass_backend or getattr(fn, "sees_fusepass_graphs", False):
            return dict(kwargs)
        fn = getattr(fn, "compiler_fn", None) or getattr(getattr(fn, "__self__", None), "backend_compile_fn", None)
        if fn is None:
            return None
    return None


@torch._dynamo.assume_constant_result
def compiling_with_fusepass() -> bool:
    """Called while Dynamo traces: run then, its result a constant of the graph being traced."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    tx = InstructionTranslator.current_tx()
    return tx is not None and fusepass_kwargs(tx.output.compiler_fn) is not None
