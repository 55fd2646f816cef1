"""The backend's `mode` and `options`: fusepass's own keys, the rest forwarded to Inductor."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

import torch._inductor
from torch._inductor import config as inductor_config

from fusepass.families import FAMILIES
from fusepass.families.bare_linear import FAMILY as BARE_LINEAR
from fusepass.lowering.launch import OPAQUE_ENV
from fusepass.lowering.recompute import RebuildChainOutputs
from fusepass.lowering.schema import KernelOptions
from fusepass.lowering.tuning import source_hash


class FusepassFallbackWarning(UserWarning):
    """A graph could not use fused ops and runs with the fallback compiler instead."""


DEBUG_DIR_ENV = "FUSEPASS_DEBUG_DIR"
TIME_UNFUSED_ENV = "FUSEPASS_TIME_UNFUSED"  # "1": time_unfused=True unless the options say otherwise
FALLBACKS = ("inductor", "eager")
# fusepass's own keys and what they mean; every other key must be an Inductor config key.
FUSEPASS_KEYS = {
    "bare_linear": "run fp32 linears outside any chain (and their backward) on fusepass's linear op, which "
                   "picks the 3xTF32 Triton GEMM or cuBLAS per shape: True (default) or False",
    "debug_dir": "write each graph before/after rewriting and its match report here (env FUSEPASS_DEBUG_DIR)",
    "fallback": "what a graph falls back to if rewriting or compiling the fused op fails: 'inductor' or 'eager'",
    "fp32_matmul": "fp32 GEMMs when torch does not allow TF32: 'tf32x3' (default; fp32-accurate on tensor "
                   "cores) or 'ieee' (plain fp32 FMA, on cuBLAS whatever 'gemm' says); with TF32 allowed they use "
                   "TF32, as eager",
    "rebuild_outputs": "whether a training step rebuilds a chain's 16-bit (autocast) output in its backward (one "
                       "pass over the saved linear output) instead of holding it from the forward: True (default) "
                       "or False; fp32 outputs are held either way",
    "time_unfused": "on the first compile of a problem (CUDA), time each match fused against Inductor's own code for "
                    "its nodes, forward and backward where gradients flow, and keep the faster where Inductor's is no "
                    "further from float64 than eager (cached on disk with the tuner's choices): False (default; "
                    "always fused, unless env FUSEPASS_TIME_UNFUSED=1) or True. Experimental: adds seconds to a "
                    "first compile",
    "gemm": "the fused ops' GEMM: 'auto' (default; time Triton and cuBLAS per shape, cached on disk), "
            "'triton' or 'cublas'",
    "operand_copies": "whether an fp32 GEMM may copy an operand to read it faster (split into tf32 halves, rounded "
                      "to tf32, or made K-major; the backward's operands grow with the batch): True (default) or "
                      "False (the training step holds less; on Hopper its fp32 GEMMs split their tiles inside the "
                      "kernel, elsewhere they run at about cuBLAS's speed)",
}


@dataclass(frozen=True)
class Options:
    mode: str = "default"
    debug_dir: Optional[str] = None
    fallback: str = "inductor"
    kernel: KernelOptions = KernelOptions()  # the fused ops' own options, passed to each op in the graph
    bare_linear: bool = True
    rebuild_outputs: bool = True
    time_unfused: bool = False
    inductor_patches: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, mode: Optional[str] = None, options: Optional[dict[str, Any]] = None) -> "Options":
        mode = mode or "default"
        modes = torch._inductor.list_mode_options()
        if mode not in modes:
            raise ValueError(f"fusepass: unknown mode {mode!r}; valid modes: {', '.join(modes)}")
        options = dict(options or {})
        own = {key: options.pop(key) for key in list(options) if key in FUSEPASS_KEYS}
        fallback = own.get("fallback", "inductor")
        if fallback not in FALLBACKS:
            raise ValueError(f"fusepass: options['fallback'] must be one of {FALLBACKS}, got {fallback!r}")
        debug_dir = own.get("debug_dir") or os.environ.get(DEBUG_DIR_ENV) or None
        kernel = KernelOptions(**{f.name: own[f.name] for f in fields(KernelOptions) if f.name in own})
        kernel.validate()
        defaults = {"bare_linear": cls.bare_linear, "rebuild_outputs": cls.rebuild_outputs,
                    "time_unfused": os.environ.get(TIME_UNFUSED_ENV) == "1"}
        flags = {key: own.get(key, default) for key, default in defaults.items()}
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"fusepass: options[{key!r}] must be True or False, got {value!r}")
        patches = dict(modes[mode])
        patches.update(_inductor_patches(options))
        kernel = replace(kernel, cuda_graphs=bool(patches.get("triton.cudagraphs", False)))
        _launch_fused_kernels_statically(patches)
        _key_caches_on_fusepass_source(patches)
        if flags["rebuild_outputs"]:
            _rebuild_chain_outputs(patches)
        return cls(mode=mode, debug_dir=debug_dir, fallback=fallback, kernel=kernel, inductor_patches=patches,
                   **flags)

    @property
    def launches_fused_kernels_statically(self) -> bool:
        return bool(self.inductor_patches.get(_STATIC_USER_KERNELS, False))

    @property
    def families(self) -> tuple:
        """The families to rewrite, in priority order. Bare linears only where their op can differ from
        cuBLAS fp32: not with fp32_matmul='ieee'."""
        if self.bare_linear and self.kernel.fp32_matmul != "ieee":
            return FAMILIES
        return tuple(f for f in FAMILIES if f is not BARE_LINEAR)


def _inductor_patches(options: dict[str, Any]) -> dict[str, Any]:
    known = inductor_config.get_config_copy()
    patches = {}
    for key, value in options.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(_unknown_key_message(key, known))
        patches[name] = value
    return patches


_STATIC_USER_KERNELS = "static_launch_user_defined_triton_kernels"


def _launch_fused_kernels_statically(patches: dict[str, Any]) -> None:
    """The fused ops' Triton kernels reach Inductor as user-defined kernels, which it launches through
    Triton's Python launcher unless told otherwise; its static launcher (what it uses for its own
    kernels) cut a bf16 MLP training step's host time by 13% on an H200. The patch reaches the kernels
    compiled in this process; for those compiled in Inductor's workers the backend starts the workers set
    the same way (compile_workers.py). The user's option wins."""
    if hasattr(inductor_config, _STATIC_USER_KERNELS):
        patches.setdefault(_STATIC_USER_KERNELS, True)


def _key_caches_on_fusepass_source(patches: dict[str, Any]) -> None:
    """Inductor's caches know the fused op by name only, not its Python kernels or backward formula:
    key them on fusepass's source, so a changed fusepass never reuses a stale compiled graph, and on
    FUSEPASS_OPAQUE, which decides inside the op's traced body whether its kernels enter the graph (a
    process with it loaded graphs compiled without it, and the reverse)."""
    key = "unsafe_marked_cacheable_functions"
    if hasattr(inductor_config, key):
        marked = dict(patches.get(key, getattr(inductor_config, key)))
        marked["torch.ops.fusepass"] = source_hash() + (" opaque" if os.environ.get(OPAQUE_ENV) else "")
        patches[key] = marked


def _rebuild_chain_outputs(patches: dict[str, Any]) -> None:
    """The partitioner rebuilds chains' outputs in the backward (recompute.py), after the user's own joint
    pass if there is one."""
    key = "joint_custom_pre_pass"
    user_pass = patches.get(key, getattr(inductor_config, key))
    patches[key] = RebuildChainOutputs(user_pass)


def _unknown_key_message(key: str, inductor_keys: dict[str, Any]) -> str:
    own = "\n".join(f"  {k}: {doc}" for k, doc in FUSEPASS_KEYS.items())
    close = difflib.get_close_matches(key, [*FUSEPASS_KEYS, *inductor_keys], n=5)
    hint = f"\nDid you mean: {', '.join(close)}?" if close else ""
    return (
        f"fusepass: unknown option {key!r}. Valid options are fusepass's own keys\n{own}\n"
        f"and any of the {len(inductor_keys)} torch._inductor.config keys "
        f"(see torch._inductor.list_options()).{hint}"
    )
