"""One mechanism for fusepass's tuned ops, the chain and the linear: each declares, next to its
implementations, how a call binds, what its problem is (tuning.Problem: a family and a size bucket), its
candidates, and its unfused math, the way `@triton.autotune(configs=..., key=...)` declares a kernel's
configs and key. `TunedOp` registers it with torch.library twice:

- `traced`, a triton_op: torch.compile traces its body, for static and symbolic shapes alike. The
  implementation is chosen while tracing (per bucket, from the size hint where a size is symbolic) and
  its kernels launch from Inductor's graph; a new batch size costs no trace, no choice and no compile.
- `opaque`, its custom_op twin, which chooses when it runs: on CPU it is the unfused math; on CUDA it
  serves FUSEPASS_OPAQUE=1 and choices that cannot be traced (cuBLAS where the global TF32 flag would
  give another precision). Per call: a table lookup by bucket, then the launch.

Every call checks what its implementation's kernels need of it (limits.py) and otherwise runs the
unfused math for that call.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from fusepass.lowering import limits
from fusepass.lowering.launch import OPAQUE_ENV, real_tensors
from fusepass.lowering.tuning import TUNER, Problem, capturing


class Implementation(Protocol):
    """One way to run a call on CUDA: a name the tuner knows it by, the run, and what its kernels need."""
    name: str

    def __call__(self, call: Any) -> Any: ...

    def unlaunchable(self, call: Any) -> Optional[str]: ...


@dataclass(frozen=True)
class Declaration:
    """What an op declares. `signature`: a function whose signature and annotations are the op's (the
    schema torch.library infers); `bind(args, kwargs)`: the call object from the op's arguments, and
    `flatten(call)` the reverse; `device(call)`; `validate(call)`: eager's checks; `problem(call,
    traced)`: the tuning problem, sizes bucketed; `candidates(call, problem, traced)`: the
    implementations by name, default first, those that can run traced only when `traced` (may be none);
    `stand_ins(call)`: real tensors of the call's shapes (size hints for symbolic sizes), for timing while
    traced; `unfused(call)`: the op's math in PyTorch (CPU, and calls no kernel can launch for);
    `fake(call)`: outputs of the right shapes; `without_collectives(call)`: the call as the tuner times it,
    on this process alone (default: the call itself)."""
    name: str
    signature: Callable
    bind: Callable[[tuple, dict], Any]
    flatten: Callable[[Any], tuple]
    device: Callable[[Any], torch.device]
    validate: Callable[[Any], None]
    problem: Callable[[Any, bool], Problem]
    candidates: Callable[[Any, Problem, bool], dict[str, Implementation]]
    stand_ins: Callable[[Any], Any]
    unfused: Callable[[Any], Any]
    fake: Callable[[Any], Any]
    without_collectives: Callable[[Any], Any] = lambda call: call


class TunedOp:
    def __init__(self, declaration: Declaration):
        self.declaration = declaration
        self._chosen: dict[tuple[Problem, bool], Optional[Implementation]] = {}
        d = declaration
        self.traced = torch.library.triton_op(d.name, _with_signature(self._traced_body, d.signature),
                                              mutates_args=())
        self.opaque = torch.library.custom_op(d.name + "_opaque", _with_signature(self._unfused_body, d.signature),
                                              mutates_args=())
        self.opaque.register_kernel("cuda")(_with_signature(self._opaque_cuda_body, d.signature))
        self.opaque.register_fake(_with_signature(self._fake_body, d.signature))

    # ------------------------------------------------------------------ the registered bodies

    def _traced_body(self, *args, **kwargs):
        d = self.declaration
        call = d.bind(args, kwargs)
        run = None
        if d.device(call).type == "cuda" and not os.environ.get(OPAQUE_ENV):
            d.validate(call)
            run = self.choose(call, traced=_is_traced(call, d))
        if run is None:
            return self.opaque(*d.flatten(call))
        return _op_output(self.launch_checked(run, call))

    def _opaque_cuda_body(self, *args, **kwargs):
        d = self.declaration
        call = d.bind(args, kwargs)
        d.validate(call)
        return _op_output(self.launch_checked(self.choose(call, traced=False), call))

    def _unfused_body(self, *args, **kwargs):
        d = self.declaration
        call = d.bind(args, kwargs)
        d.validate(call)
        return _op_output(d.unfused(call))

    def _fake_body(self, *args, **kwargs):
        d = self.declaration
        call = d.bind(args, kwargs)
        d.validate(call)
        return _op_output(d.fake(call))

    # ------------------------------------------------------------------ choice and launch

    def choose(self, call: Any, traced: bool) -> Optional[Implementation]:
        """The implementation for this call's problem: from this op's table (one lookup per call), else
        from the tuner (a bucket's remembered choice, a neighbour's, or timing). Traced, the candidates
        run on stand-ins, and there may be none (the opaque op then chooses when it runs)."""
        d = self.declaration
        problem = d.problem(call, traced)
        key = (problem, traced)
        if key in self._chosen:
            return self._chosen[key]
        candidates = d.candidates(call, problem, traced)
        chosen = None
        if candidates:
            timed_call = _once(lambda: d.without_collectives(d.stand_ins(call) if traced else call))
            runners = {name: functools.partial(_run, impl, timed_call) for name, impl in candidates.items()}
            with real_tensors() if traced else contextlib.nullcontext():
                chosen = candidates[TUNER.choose(problem, d.device(call), runners, parallel_first_runs=True)]
        if not capturing(d.device(call)):  # a choice made in a capture could not be timed
            self._chosen[key] = chosen
        return chosen

    def launch_checked(self, run: Optional[Implementation], call: Any) -> Any:
        """`run` on the call where its kernels can launch for it (checked on every call: a choice made
        for one call serves every other of its bucket), else the unfused math for this call."""
        why = run.unlaunchable(call) if run is not None else "no implementation launches for it"
        if why is None:
            return run(call)
        limits.record_unlaunchable(self.declaration.name, why)
        return self.declaration.unfused(call)

    def forget(self) -> None:
        """Drops this process's table of choices (tests; the tuner keeps its own)."""
        self._chosen.clear()


def _once(make: Callable[[], Any]) -> Callable[[], Any]:
    """`make()`, made on the first call only, also when the first calls come from several threads (the
    tuner's first runs): one set of stand-ins, not one per candidate."""
    lock, made = threading.Lock(), []

    def get() -> Any:
        with lock:
            if not made:
                made.append(make())
        return made[0]
    return get


def _run(impl: Implementation, timed_call: Callable[[], Any]) -> Any:
    return impl(timed_call())


def _is_traced(call: Any, d: Declaration) -> bool:
    return any(is_fake(a) for a in d.flatten(call) if isinstance(a, Tensor))


def _op_output(out: Any) -> Any:
    """What torch.library takes back: a tensor, or a plain tuple of them (not a NamedTuple)."""
    return out if isinstance(out, Tensor) else tuple(out)


def _with_signature(fn: Callable, prototype: Callable) -> Callable:
    """`fn(*args, **kwargs)` with the prototype's signature and annotations, for torch.library."""
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    wrapper.__name__ = prototype.__name__
    wrapper.__signature__ = inspect.signature(prototype)
    wrapper.__annotations__ = dict(prototype.__annotations__)
    return wrapper
