"""What fusepass-bench measures (bench.py is its command line): is fusepass correct on a KernelBench-format
problem, and how much faster is it?

For each problem, mode and precision it builds Model(*get_init_inputs()), one identical copy per
provider (eager, Inductor, fusepass, optionally Inductor max-autotune) and a float64 copy; checks every
provider on several fresh input draws against the float64 copy (and its running statistics against
eager's); then times the providers that were correct. A wrong provider is reported wrong, not timed.

A provider is wrong when it fails; a fusepass provider also when its running statistics are further
from float64 than eager's, or when its output (or, with --backward, gradient) is neither allclose to
float64 at --atol/--rtol nor at least as close to float64 as eager's (fusepass's numerical criterion).
Other providers that miss that criterion are timed all the same, their verdict noting the miss. The
allclose result is shown on its own too:
at low precision eager itself often fails KernelBench's tolerances. Exit status: 0 all correct, 1 some
provider wrong, 2 bad input.

Before any provider gets its copy, the model's floating-point parameters and batch-norm running
statistics are perturbed with seeded noise (perturb_parameters): the reference problems keep
BatchNorm's weight = 1, bias = 0, running mean 0 and variance 1, and a softmax problem's scale of 1,
values under which a kernel that drops gamma, beta, the scale or a running statistic gives the
right answer. A fusepass provider that fell back to the fallback compiler for any graph
(torch._dynamo.utils.counters["fusepass"]["fallbacks"]) is wrong too: its timing would not be fusepass's.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import math
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import triton
from torch._dynamo.utils import counters
from torch.utils.flop_counter import FlopCounterMode

from fusepass.numerics import no_further_than_eager, rel_error
from fusepass.providers import (INPUT_SEED, BenchError, build_model, load, make_provider, problem_inputs, problem_name,
                                provider_call, sync, to_device)

# allclose tolerances to the float64 model when --atol/--rtol are not given (KernelBench's: 1e-4 fp32, 1e-2 else).
DEFAULT_TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "bf16-autocast": 1e-2, "fp16-autocast": 1e-2}


@dataclass
class Result:
    problem: str  # the file's name, with "@NxKxF" when it ran resized (--size, --shrink)
    mode: str
    precision: str
    provider: str
    size: Optional[list[int]] = None  # [batch, in_features, out_features] as run: None if the input is not 2-D
    forward_flop: Optional[int] = None  # the model's forward FLOP at this size (torch's FLOP counter)
    correct: bool = False
    max_abs_error: float = math.nan  # worst over the seeds, to the float64 model
    rel_error: float = math.nan  # worst ||out - ref|| / ||ref|| over the seeds
    allclose: Optional[bool] = None  # output allclose to float64 at --atol/--rtol on every seed
    grad_rel_error: Optional[float] = None  # with --backward: all parameters' gradients as one vector, worst seed
    grad_allclose: Optional[bool] = None
    stats_match_eager: Optional[bool] = None  # None when the model has no running statistics
    failure: Optional[str] = None
    note: Optional[str] = None  # a non-fusepass provider's miss of fusepass's numerical contract (timed anyway)
    stats_further_than_eager: bool = False
    compile_s: float = math.nan  # the first call, compilation included
    median_ms: float = math.nan
    p20_ms: float = math.nan
    p80_ms: float = math.nan
    round_medians_ms: Optional[list[float]] = None  # each interleaved round's median (Config.rounds)
    peak_mb: float = math.nan  # everything the bench process holds at the call's peak
    own_peak_mb: float = math.nan  # the call's own: its peak above what was allocated just before it
    speedup_vs_eager: Optional[float] = None
    speedup_vs_inductor: Optional[float] = None
    # what fusepass's backend did while this provider compiled and ran (0 for providers without it)
    fusepass_rewrites: int = 0
    fusepass_linears: int = 0
    fusepass_fallbacks: int = 0


@dataclass
class Config:
    device: str
    modes: list[str]
    precisions: list[str]
    providers: list[str]
    backward: bool
    seeds: int
    size: Optional[list[int]]
    shrink: int
    atol: Optional[float]
    rtol: Optional[float]
    warmup_ms: int
    rep_ms: int
    # Timing rounds, interleaved across the providers, rep_ms shared among them: a host-bound step's time
    # drifts within a process by more than providers differ, and rounds spread the drift over all of them.
    rounds: int = 1
    results: list[Result] = field(default_factory=list)


def fusepass_counts() -> tuple[int, int, int]:
    """(rewrites, linears, fallbacks) fusepass's backend has counted so far in this process."""
    stats = counters["fusepass"]
    return stats["rewrites"], stats["linears"], stats["fallbacks"]


@contextlib.contextmanager
def counting_fusepass(result: "Result"):
    """Adds the rewrites, bare linears and fallbacks that happen inside to `result`."""
    before = fusepass_counts()
    try:
        yield
    finally:
        rewrites, linears, fallbacks = (now - then for now, then in zip(fusepass_counts(), before))
        result.fusepass_rewrites += rewrites
        result.fusepass_linears += linears
        result.fusepass_fallbacks += fallbacks


# --------------------------------------------------------------------------- one configuration


class Run:
    """One problem in one mode and precision: every provider's copy of the model, and the checks."""

    def __init__(self, cfg: Config, name: str, module, mode: str, precision: str):
        self.cfg, self.module, self.mode, self.precision = cfg, module, mode, precision
        base = build_model(module, mode, cfg.device)
        self.models = {p: copy.deepcopy(base) for p in cfg.providers}
        self.reference = copy.deepcopy(base).double()
        self.fns = {p: make_provider(p, self.models[p]) for p in cfg.providers}
        self.results = {p: Result(name, mode, precision, p) for p in cfg.providers}
        default_tol = DEFAULT_TOLERANCE[precision]
        self.atol = cfg.atol if cfg.atol is not None else default_tol
        self.rtol = cfg.rtol if cfg.rtol is not None else default_tol

    def provider_call(self, provider: str, inputs: list,
                      upstream: Optional[torch.Tensor] = None) -> Callable[[], torch.Tensor]:
        return provider_call(self.fns[provider], inputs, mode=self.mode, precision=self.precision,
                             device=self.cfg.device, backward=self.cfg.backward, upstream=upstream)

    def check(self, progress: Callable[[str], None]) -> None:
        for seed in range(self.cfg.seeds):
            inputs = problem_inputs(self.module, self.cfg.device, INPUT_SEED + seed)
            grad = self.cfg.backward or self.mode == "train"
            with torch.set_grad_enabled(grad), FlopCounterMode(display=False) as flop:
                ref_out = self.reference(*to_device(inputs, self.cfg.device, torch.float64))
            if seed == 0:
                self._record_size(inputs, ref_out, flop.get_total_flops())
            upstream = torch.randn(ref_out.shape, device=self.cfg.device, dtype=torch.float64)
            if self.cfg.backward:
                (ref_out * upstream).sum().backward()
            for provider, result in self.results.items():
                if result.failure:
                    continue
                progress(f"{provider}: seed {seed}" + (" (compiling)" if seed == 0 else ""))
                try:
                    self._check_one(provider, result, inputs, ref_out, upstream.float(), first=seed == 0)
                except Exception as exc:  # a provider that crashes is wrong, not a reason to stop
                    result.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            for model in (*self.models.values(), self.reference):
                model.zero_grad(set_to_none=True)
        self._verdicts()

    def _record_size(self, inputs: list, out: torch.Tensor, forward_flop: int) -> None:
        for result in self.results.values():
            result.forward_flop = forward_flop
        first = inputs[0] if inputs else None
        if isinstance(first, torch.Tensor) and first.dim() == 2 and out.dim() == 2:
            for result in self.results.values():
                result.size = [*first.shape, out.shape[1]]

    def _verdicts(self) -> None:
        """fusepass's numerical contract (no further from float64 than eager) decides a fusepass
        provider's verdict; for the providers it is compared with, a miss is noted but does not stop
        their timing (Inductor's reduction orders give it eager's error class, sometimes a bit above)."""
        eager = self.results["eager"]
        for result in self.results.values():
            if result.failure is None:
                result.failure = fallback_failure(result)
            misses = []
            if not result.allclose and not no_further_than_eager(result.rel_error, eager.rel_error):
                misses.append(f"output not allclose to float64 (atol={self.atol:g}, rtol={self.rtol:g}) "
                              f"and further from it than eager")
            if self.cfg.backward and not result.grad_allclose and not no_further_than_eager(
                    result.grad_rel_error, eager.grad_rel_error):
                misses.append("gradients not allclose to float64 and further from it than eager's")
            if result.stats_further_than_eager:
                misses.append("running statistics further from float64 than eager's")
            if misses and result.failure is None:
                if result.provider.startswith("fusepass"):
                    result.failure = misses[0]
                else:
                    result.note = misses[0]
            result.correct = result.failure is None

    def _check_one(self, provider, result, inputs, ref_out, upstream, first):
        start = time.perf_counter()
        with counting_fusepass(result):
            out = self.provider_call(provider, inputs, upstream)()
            sync(self.cfg.device)
        if first:
            result.compile_s = time.perf_counter() - start
        diff = (out.double() - ref_out).abs()
        result.max_abs_error = max(_nan_to_inf(diff.max().item()), _zero_if_nan(result.max_abs_error))
        result.rel_error = max(_nan_to_inf(rel_error(out, ref_out)), _zero_if_nan(result.rel_error))
        close = torch.allclose(out.double(), ref_out, atol=self.atol, rtol=self.rtol)
        result.allclose = close and result.allclose is not False
        if self.cfg.backward:
            self._check_grads(provider, result)
        self._check_stats(provider, result)

    def _check_grads(self, provider, result):
        """Judged at the scale of the model's whole gradient: a parameter whose exact gradient is 0 (the
        linear bias under training-mode batch norm) has a float64 reference of pure rounding noise."""
        pairs = [(name, param.grad, ref.grad) for (name, param), ref in
                 zip(self.models[provider].named_parameters(), self.reference.parameters()) if ref.grad is not None]
        missing = [name for name, grad, _ in pairs if grad is None]
        if missing:
            result.failure = f"no gradient for {missing[0]}"
            return
        scale = max(ref.abs().max().item() for _, _, ref in pairs)
        close = all(torch.allclose(grad.double(), ref, atol=self.atol * scale, rtol=self.rtol)
                    for _, grad, ref in pairs)
        result.grad_allclose = close and result.grad_allclose is not False
        diff = math.sqrt(sum((grad.double() - ref).square().sum().item() for _, grad, ref in pairs))
        norm = math.sqrt(sum(ref.square().sum().item() for _, _, ref in pairs))
        result.grad_rel_error = max(diff / norm, result.grad_rel_error or 0.0)

    def _check_stats(self, provider, result):
        """"stats = eager" reports allclose to eager's buffers at --atol/--rtol; the buffers are wrong
        when a float one is further from the float64 model's than eager's is, or an integer one differs."""
        buffers = list(zip(self.models[provider].buffers(), self.models["eager"].buffers(), self.reference.buffers()))
        if not buffers:
            return
        tol = dict(atol=self.atol, rtol=self.rtol)
        match = all(torch.allclose(b.double(), e.double(), **tol) if b.is_floating_point() else torch.equal(b, e)
                    for b, e, _ in buffers)
        result.stats_match_eager = match and result.stats_match_eager is not False
        for b, e, ref in buffers:
            exact = (no_further_than_eager(rel_error(b, ref), rel_error(e, ref)) if b.is_floating_point()
                     else torch.equal(b, e))
            if not exact:
                result.stats_further_than_eager = True

    def _every_parameter(self) -> list:
        return [p for model in (*self.models.values(), self.reference) for p in model.parameters()]

    def time_all(self, progress: Callable[[str], None]) -> None:
        """Every correct provider in `rounds` interleaved rounds (each round starting one provider later),
        then its peak memory; the median and percentiles are over all rounds' calls."""
        inputs = problem_inputs(self.module, self.cfg.device)
        fns = {p: self.provider_call(p, inputs) for p, result in self.results.items() if result.correct}
        rounds, providers = {p: [] for p in fns}, list(fns)
        for index in range(self.cfg.rounds):
            start = index % max(len(providers), 1)
            for provider in (p for p in providers[start:] + providers[:start] if p in fns):
                progress(f"{provider}: timing" + (f", round {index + 1} of {self.cfg.rounds}"
                                                  if self.cfg.rounds > 1 else ""))
                times = self._time_one(provider, fns[provider])
                if times is None:
                    del fns[provider]
                else:
                    rounds[provider].append(times)
        for provider, fn in fns.items():
            self._record_times(provider, fn, rounds[provider])
        eager, inductor = self.results.get("eager"), self.results.get("inductor")
        for result in self.results.values():
            if result.correct:
                result.speedup_vs_eager = _ratio(eager, result)
                result.speedup_vs_inductor = _ratio(inductor, result)

    def _time_one(self, provider: str, fn: Callable) -> Optional[list[float]]:
        """One round's call times of a provider, or None (the result marked wrong)."""
        params = list(self.models[provider].parameters())
        return _checked(self.results[provider],
                        lambda: measure(fn, self.cfg, params, rep_ms=self.cfg.rep_ms / self.cfg.rounds))

    def _record_times(self, provider: str, fn: Callable, rounds: list[list[float]]) -> None:
        result = self.results[provider]
        peaks = _checked(result, lambda: peak_memory_mb(fn, self.cfg.device, self._every_parameter()))
        if peaks is None:
            return
        result.peak_mb, result.own_peak_mb = peaks
        times = [t for round_times in rounds for t in round_times]
        result.median_ms = statistics.median(times)
        result.p20_ms, result.p80_ms = _quantile(times, 0.2), _quantile(times, 0.8)
        result.round_medians_ms = [statistics.median(round_times) for round_times in rounds]


def _checked(result: Result, call: Callable[[], Any]) -> Optional[Any]:
    """call()'s value, or None with the result marked wrong where it crashed (a provider that crashes while
    timed is wrong, not a reason to stop) or a recompilation inside it fell back."""
    try:
        with counting_fusepass(result):
            value = call()
    except Exception as exc:
        result.failure = f"while timing: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    else:
        result.failure = fallback_failure(result)
    if result.failure:
        result.correct = False
        return None
    return value


def fallback_failure(result: Result) -> Optional[str]:
    """A fusepass provider whose graphs fell back ran without (some of) its fused ops."""
    if result.provider.startswith("fusepass") and result.fusepass_fallbacks:
        return (f"{result.fusepass_fallbacks} fusepass fallback(s): a graph ran without fused ops, so this "
                f"provider's speed would not be fusepass's")
    return None


def measure(fn: Callable, cfg: Config, params: list, rep_ms: float) -> list[float]:
    """Per-call times in ms over about rep_ms: CUDA events via triton.testing.do_bench (L2 flushed between
    calls), or a host clock on CPU."""
    if cfg.device == "cuda":
        return triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=rep_ms, grad_to_none=params,
                                       return_mode="all")
    for _ in range(3):
        fn()
    times, deadline = [], time.perf_counter() + rep_ms / 1000
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


def peak_memory_mb(fn: Callable, device: str, params: list) -> tuple[float, float]:
    """(peak, the call's own peak) in MB: torch.cuda.max_memory_allocated over one call of fn, and that
    peak above what was allocated just before the call (the step's activations, its gradients and its
    transients, not the models the process holds), every model's gradients dropped before it (`params`:
    every provider's parameters). The same baseline for every provider: the gradients an
    earlier provider's timing left behind counted against the later ones (fp32 training step at
    1024 x 8192 -> 8192 on an H200: Inductor 225 MB over eager and fusepass 320 MB over Inductor, where
    measured each in a process of its own on an H100 fusepass and Inductor peaked at 672 and 673 MB)."""
    if device != "cuda":
        return math.nan, math.nan
    for param in params:
        param.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return peak / 2**20, (peak - before) / 2**20


def _ratio(base: Optional[Result], result: Result) -> Optional[float]:
    if base is None or not base.correct or not result.median_ms:
        return None
    return base.median_ms / result.median_ms


def _quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _nan_to_inf(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _zero_if_nan(value: float) -> float:
    return 0.0 if math.isnan(value) else value


# --------------------------------------------------------------------------- driver and output


def run(paths: list[str], cfg: Config, progress: Callable[[str], None]) -> list[Result]:
    size = tuple(cfg.size) if cfg.size else None
    modules = {path: load(path, size, cfg.shrink) for path in paths}  # bad input fails before any work
    for path, module in modules.items():
        check_eager(path, module, cfg.device)
    resized = size is not None or cfg.shrink > 1
    total = len(paths) * len(cfg.modes) * len(cfg.precisions)
    step = 0
    for path, module in modules.items():
        for mode in cfg.modes:
            for precision in cfg.precisions:
                step += 1
                torch._dynamo.reset()
                name = problem_name(path, module, resized)
                prefix = f"[{step}/{total}] {name} {mode} {precision}"
                one = Run(cfg, name, module, mode, precision)
                started = time.perf_counter()
                say = lambda text: progress(f"{prefix} {text} ({time.perf_counter() - started:.0f} s)")  # noqa: E731
                one.check(say)
                one.time_all(say)
                cfg.results += one.results.values()
    return cfg.results


def check_eager(path: str, module, device: str) -> None:
    try:
        torch.manual_seed(0)
        model = module.Model(*module.get_init_inputs()).to(device)
        model(*to_device(module.get_inputs(), device))
    except Exception as exc:
        raise BenchError(f"{path}: the problem fails in eager: {type(exc).__name__}: {exc}") from exc


def environment(device: str, argv: list[str]) -> dict[str, Any]:
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["fusepass-bench", *argv]),
    }


def source_commit() -> Optional[str]:
    """The commit measured: HEAD's short hash, "+changes" when fusepass/ differs from it; None outside a
    git checkout. FUSEPASS_SOURCE_COMMIT overrides it, for copies of a work tree whose .git is not its own."""
    if os.environ.get("FUSEPASS_SOURCE_COMMIT"):
        return os.environ["FUSEPASS_SOURCE_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "fusepass"], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if changed else "")


