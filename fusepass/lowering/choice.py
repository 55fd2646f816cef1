"""Which CUDA implementation runs a call of the fused op: the candidates for its problem (GEMM precision,
Triton tile configs, cuBLAS), and the choice among them, by timing (tuning.py) or from memory.

A choice depends on the problem only (`ChoiceKey`: shapes, dtypes, precision, which steps are present,
traced or not), so it is made once per problem and process, and cached on disk across processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from fusepass.lowering import gemm, tuning
from fusepass.lowering.implementations import Implementation
from fusepass.lowering.launch import real_tensors
from fusepass.lowering.schema import FLAT_NAMES, ChainArgs, ChainOutputs, flatten, unflatten
from fusepass.lowering.tuning import TUNER, capturing

OP_NAME = "fusepass::linear_scale_batch_norm"
TRITON_GEMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def matmul_precision(dtype: torch.dtype, fp32_matmul: str) -> str:
    """The GEMM precision for this call: bf16/fp16 natively; fp32 as the user allows it (TF32 when
    torch allows TF32, as eager), else fp32-accurate 3xTF32, or IEEE FMA when asked for."""
    if dtype != torch.float32:
        return "native"
    if fp32_matmul == "ieee":
        return "ieee"
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "tf32x3"


def gemm_choice(args: ChainArgs) -> str:
    return gemm_option(args.linear.x, args.linear.weight, args.kernel.gemm)


def gemm_option(x: Tensor, weight: Tensor, gemm_option: str) -> str:
    """The kernel option `gemm`, except that dtypes the Triton GEMM lacks go to cuBLAS."""
    if x.dtype not in TRITON_GEMM_DTYPES or weight.dtype != x.dtype:
        return "cublas"
    return gemm_option


def implementations(args: ChainArgs, precision: str, traced: bool = False) -> dict[str, Implementation]:
    """Every way to run the op for these arguments that the tuner's search times (tuning.search: the
    short search takes each precision's gemm.shortlist), by name, the default first; only those that can
    launch for these arguments (Implementation.unlaunchable). Plain fp32 FMA ("ieee") is cuBLAS's alone,
    whatever the gemm option says. TMA tile configs are offered where the operands allow descriptors.
    `traced`: only those that can run inside Inductor's graph (may be none; see cublas_traceable)."""
    x, weight = args.linear.x, args.linear.weight
    choice = gemm_choice(args)
    candidates = {}
    if choice in ("auto", "triton") and precision != "ieee":
        precisions = [precision] + ([pre_split_precision(x, weight)] if precision == "tf32x3" else [])
        # Traced, no TMA configs: torch does not capture TMA descriptors when it traces a wrap_triton
        # launch outside Dynamo ("not yet supported", torch 2.13's triton_kernel_wrap.py), and the
        # operands' addresses (so their alignment) are not known yet.
        configs = triton_configs(precisions, x, weight.shape[0], tma=not traced)
        candidates.update({impl.name: impl for impl in (Implementation(p, c) for p, c in configs)})
    if (choice in ("auto", "cublas") or not candidates) and (not traced or cublas_traceable(precision)):
        candidates["cublas"] = Implementation(precision)
    return {name: impl for name, impl in candidates.items() if impl.unlaunchable(args) is None}


def triton_configs(precisions: list[str], x: Tensor, n_features: int, tma: bool) -> list[tuple[str, gemm.GemmConfig]]:
    """(precision, tile config) for each that the tuner's search times (gemm.shortlist unless the search
    is full); TMA configs only where `tma` (their operands are checked per call, limits.py)."""
    chosen = []
    for p in precisions:
        configs = gemm.gemm_configs(p, x.dtype)
        if tuning.search() != "full":
            configs = gemm.shortlist(configs, x.shape[0], n_features, x.device)
        chosen += [(p, config) for config in configs if tma or not config.tma]
    return chosen


def pre_split_precision(x: Tensor, weight: Tensor) -> str:
    """3xTF32 with the smaller operand split into tf32 hi + lo in memory, once per call (splitting the
    other, larger one cost up to 13% of the GEMM: 0.20 ms for W at 1024 x 8192 -> 8192 on an H200)."""
    return "split_x" if x.numel() < weight.numel() else "split_w"


def cublas_traceable(precision: str) -> bool:
    """A traced F.linear becomes Inductor's matmul, which follows torch's global TF32 flag when it runs:
    right only where that flag already gives the precision asked for."""
    return precision == "native" or torch.backends.cuda.matmul.allow_tf32 == (precision == "tf32")


class ChoiceKey(NamedTuple):
    """What the choice of implementation depends on, taken from the op's arguments (so a new argument
    is part of it without being listed here): each tensor's shape and dtype (None where absent), every
    flag, dtype and option; not the float values (scales, momentum, eps), which change no kernel. The
    per-process table's key, and (described) the tuner's."""
    arguments: tuple
    device: torch.device
    precision: str
    gemm: str
    traced: bool

    @classmethod
    def of(cls, args: ChainArgs, precision: str, traced: bool) -> "ChoiceKey":
        return cls(tuple(_key_part(value) for value in flatten(args)), args.linear.x.device, precision,
                   gemm_choice(args), traced)

    def describe(self) -> str:
        """The tuner's key (the device is in the tuner's own part of it)."""
        parts = [f"{name}={_describe_part(part)}" for name, part in zip(FLAT_NAMES, self.arguments)
                 if part is not _NOT_A_KEY]
        return " ".join([OP_NAME, f"precision={self.precision}", f"gemm={self.gemm}", *parts]) + (
            " traced" if self.traced else "")


_NOT_A_KEY = "not a key"


def _key_part(value):
    if isinstance(value, Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, float):
        return _NOT_A_KEY
    return value


def _describe_part(part) -> str:
    if isinstance(part, tuple):
        shape, dtype = part
        return ("x".join(map(str, shape)) or "()") + ":" + str(dtype).removeprefix("torch.")
    if part is None:
        return "-"
    return str(part).removeprefix("torch.")


_CHOSEN: dict[ChoiceKey, Optional[Implementation]] = {}
_NOT_CHOSEN = object()


def choose_implementation(args: ChainArgs, traced: bool = False) -> Optional[Implementation]:
    """The implementation for these arguments: from a per-process table (this runs on every call),
    else from the tuner (timing, or its disk cache). `traced`: args are fake (the op is being traced
    for Inductor); candidates are timed on random stand-ins of the same shapes, and there may be none."""
    precision = matmul_precision(args.linear.x.dtype, args.kernel.fp32_matmul)
    key = ChoiceKey.of(args, precision, traced)
    chosen = _CHOSEN.get(key, _NOT_CHOSEN)
    if chosen is not _NOT_CHOSEN:
        return chosen
    candidates = implementations(args, precision, traced)
    chosen = None
    if candidates:
        # Traced, the candidates run for real, on stand-ins made once (only if one must be timed).
        timed_args = functools.cache(lambda: stand_ins(args)) if traced else (lambda: args)
        name = tune(key.describe(), args.linear.x.device,
                    {name: _runner(run, timed_args) for name, run in candidates.items()}, traced)
        chosen = candidates[name]
    remember(_CHOSEN, key, chosen, args.linear.x.device)
    return chosen


def tune(problem: str, device: torch.device, runners: dict[str, Callable[[], object]], traced: bool) -> str:
    """The tuner's choice among `runners` (each runs one candidate on real inputs). Traced, they run
    outside the tracing modes, for real."""
    with real_tensors() if traced else contextlib.nullcontext():
        return TUNER.choose(problem, device, runners)


def remember(table: dict, key, chosen, device: torch.device) -> None:
    """Keeps a choice in a per-process table, unless it was made during a CUDA graph capture, where
    nothing could be timed."""
    if not capturing(device):
        table[key] = chosen


def _runner(run: Implementation, timed_args: Callable[[], ChainArgs]) -> Callable[[], ChainOutputs]:
    return lambda: run(timed_args())


def stand_ins(args: ChainArgs) -> ChainArgs:
    """Real tensors shaped like args' (fake) ones, with values of the kind they hold, for timing."""
    def real(t):
        if not isinstance(t, Tensor):
            return t
        return torch.randn(tuple(t.shape), dtype=t.dtype, device=t.device)
    real_args = unflatten(real(a) for a in flatten(args))
    bn = real_args.batch_norm
    if bn.running_var is not None:  # a variance is positive
        bn = dataclasses.replace(bn, running_var=bn.running_var.abs() + 0.5)
    return dataclasses.replace(real_args, batch_norm=bn)


def static_shapes(args: ChainArgs) -> bool:
    return all(isinstance(size, int) for a in flatten(args) if isinstance(a, Tensor) for size in a.shape)
