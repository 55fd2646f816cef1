"""fusepass-bench: is fusepass correct on a KernelBench-format problem, and how much faster is it?

    python -m fusepass.bench PROBLEM.py [PROBLEM.py ...] [options]      (or: fusepass-bench ...)

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

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import triton
from tabulate import tabulate
from torch._dynamo.utils import counters
from torch.utils.flop_counter import FlopCounterMode

from fusepass import shape_changes
from fusepass.lowering.tuning import TUNER
from fusepass.numerics import no_further_than_eager, rel_error
from fusepass.problems import MIN_SHRUNK, ProblemSizeError, Size, check_size
from fusepass.providers import (INPUT_SEED, PRECISIONS, PROVIDERS, BenchError, build_model, load, make_provider,
                                precision_context, problem_inputs, problem_name, provider_call, sync, to_device)
from fusepass.warmup import warmup

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
    peak_mb: float = math.nan
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

    def time_all(self, progress: Callable[[str], None]) -> None:
        inputs = problem_inputs(self.module, self.cfg.device)
        for provider, result in self.results.items():
            if not result.correct:
                continue
            progress(f"{provider}: timing")
            fn = self.provider_call(provider, inputs)
            try:
                with counting_fusepass(result):
                    times = measure(fn, self.cfg, list(self.models[provider].parameters()))
                    peak_mb = peak_memory_mb(fn, self.cfg.device)
            except Exception as exc:  # a provider that crashes while timed is wrong, not a reason to stop
                result.failure = f"while timing: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                result.correct = False
                continue
            result.failure = fallback_failure(result)
            if result.failure:  # a recompilation while timing fell back
                result.correct = False
                continue
            result.median_ms = statistics.median(times)
            result.p20_ms, result.p80_ms = _quantile(times, 0.2), _quantile(times, 0.8)
            result.peak_mb = peak_mb
        eager, inductor = self.results.get("eager"), self.results.get("inductor")
        for result in self.results.values():
            if result.correct:
                result.speedup_vs_eager = _ratio(eager, result)
                result.speedup_vs_inductor = _ratio(inductor, result)


def fallback_failure(result: Result) -> Optional[str]:
    """A fusepass provider whose graphs fell back ran without (some of) its fused ops."""
    if result.provider.startswith("fusepass") and result.fusepass_fallbacks:
        return (f"{result.fusepass_fallbacks} fusepass fallback(s): a graph ran without fused ops, so this "
                f"provider's speed would not be fusepass's")
    return None


def measure(fn: Callable, cfg: Config, params: list) -> list[float]:
    """Per-call times in ms: CUDA events via triton.testing.do_bench (L2 flushed between calls), or
    a host clock on CPU."""
    if cfg.device == "cuda":
        return triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, grad_to_none=params,
                                       return_mode="all")
    for _ in range(3):
        fn()
    times, deadline = [], time.perf_counter() + cfg.rep_ms / 1000
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


def peak_memory_mb(fn: Callable, device: str) -> float:
    if device != "cuda":
        return math.nan
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


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


def format_table(results: list[Result], problem: str, backward: bool) -> str:
    headers = ["mode", "precision", "provider", "verdict", "max abs err", "rel err", "allclose"]
    headers += ["grad rel err", "grad allclose"] if backward else []
    headers += ["stats = eager", "median ms", "p20-p80 ms", "compile s", "peak MB", "vs eager", "vs inductor"]
    rows = []
    for r in (r for r in results if r.problem == problem):
        verdict = (f"ok ({r.note})" if r.note else "ok") if r.correct else f"WRONG: {r.failure}"
        row = [r.mode, r.precision, r.provider, verdict,
               f"{r.max_abs_error:.2e}", f"{r.rel_error:.2e}", _yes_no(r.allclose)]
        row += [f"{r.grad_rel_error:.2e}" if r.grad_rel_error is not None else "-", _yes_no(r.grad_allclose)] \
            if backward else []
        row += [_yes_no(r.stats_match_eager),
                f"{r.median_ms:.3f}" if r.correct else "-",
                f"{r.p20_ms:.3f}-{r.p80_ms:.3f}" if r.correct else "-",
                f"{r.compile_s:.1f}", f"{r.peak_mb:.0f}" if not math.isnan(r.peak_mb) else "-",
                _fmt_ratio(r.speedup_vs_eager), _fmt_ratio(r.speedup_vs_inductor)]
        rows.append(row)
    return tabulate(rows, headers=headers, disable_numparse=True, maxcolwidths=[None, None, None, 36])


def _yes_no(value: Optional[bool]) -> str:
    return {None: "-", True: "yes", False: "NO"}[value]


def _fmt_ratio(value: Optional[float]) -> str:
    return f"{value:.2f}x" if value is not None else "-"


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


def write_plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.problem, r.mode, r.precision) for r in results})
    providers = [p for p in PROVIDERS if any(r.provider == p for r in results) and p != "eager"]
    width = 0.8 / max(1, len(providers))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups)), 4))
    for i, provider in enumerate(providers):
        speedups = [next((r.speedup_vs_eager or 0.0 for r in results if (r.problem, r.mode, r.precision) == g
                          and r.provider == provider), 0.0) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], speedups, width, label=provider)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(providers) - 1) / 2 for x in range(len(groups))])
    ax.set_xticklabels(["\n".join(g) for g in groups], fontsize=7)
    ax.set_ylabel("speedup vs eager (wrong = 0)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class ArgumentParser(argparse.ArgumentParser):
    """Bad arguments raise BenchError (one line, exit status 2) instead of printing usage and exiting."""

    def error(self, message: str):
        raise BenchError(message)


def parse_batches(text: str) -> list[int]:
    """"1024,777,512" -> [1024, 777, 512]."""
    try:
        batches = [int(part) for part in text.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, not {text!r}")
    return batches


def parse_size(text: str) -> Size:
    """"N,K,F" -> (batch, in_features, out_features)."""
    try:
        return check_size(int(part) for part in text.split(","))
    except (ValueError, ProblemSizeError):
        raise argparse.ArgumentTypeError(
            f"expected N,K,F (batch,in_features,out_features): three positive integers, not {text!r}") from None


def add_problem_arguments(parser: argparse.ArgumentParser, providers: list[str]) -> None:
    """The arguments of a tool that runs one problem's providers as the benchmark does (model_and_inputs,
    make_provider, provider_call): PROBLEM.py, --size, --mode, --precision, --backward, --providers."""
    parser.add_argument("problem", metavar="PROBLEM.py")
    parser.add_argument("--size", type=parse_size, metavar="N,K,F", help="batch, in_features, out_features")
    parser.add_argument("--mode", choices=("train", "eval"), default="train")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-autocast")
    parser.add_argument("--backward", action="store_true", help="forward and backward of out.sum()")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=providers)


def parse_args(argv: Optional[list[str]] = None) -> tuple[list[str], Config, argparse.Namespace]:
    parser = ArgumentParser(prog="fusepass-bench", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("problems", nargs="+", metavar="PROBLEM.py")
    parser.add_argument("--mode", nargs="+", choices=("train", "eval"), default=["train"])
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=["fp32"])
    parser.add_argument("--backward", action="store_true", help="time (and check) forward + backward")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=["eager", "inductor", "fusepass"],
                        help="max-autotune is Inductor in mode max-autotune-no-cudagraphs; *-cudagraphs are mode "
                             "reduce-overhead (CUDA graphs); eager always runs")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=parse_size, metavar="N,K,F",
                        help="run every problem at batch N, in_features K, out_features F (the file's "
                             "module-level batch_size, in_features, out_features; what derives from them follows)")
    parser.add_argument("--shrink", type=int, default=1, metavar="F",
                        help="divide batch, in_features and out_features (the file's, or --size's) by F, "
                             f"rounded down but not below {MIN_SHRUNK}: a quick run of the same problem")
    parser.add_argument("--seeds", type=int, default=5, help="fresh input draws for the correctness check")
    parser.add_argument("--atol", type=float, help="allclose atol to float64 (default: 1e-4 fp32, 1e-2 otherwise)")
    parser.add_argument("--rtol", type=float, help="allclose rtol to float64 (default: as --atol)")
    parser.add_argument("--warmup", type=int, default=100, metavar="MS", help="warm-up time per timing (ms)")
    parser.add_argument("--rep", type=int, default=500, metavar="MS", help="timed repetitions per timing (ms)")
    parser.add_argument("--json", metavar="FILE", help="write every figure, with GPU, versions and date")
    parser.add_argument("--plot", metavar="FILE.png", help="bar chart of speedups (needs matplotlib)")
    parser.add_argument("--batch-sequence", type=parse_batches, metavar="B,B,...",
                        help="shape-changes mode: a loop over these batch sizes (train: a training step with an "
                             "SGD step; eval: a forward under no_grad), each provider in a process of its own, "
                             "the wall time of every step with compilation included")
    parser.add_argument("--caches", nargs="+", choices=("cold", "warm"), default=["cold", "warm"],
                        help="with --batch-sequence: empty cache directories, or those a first run filled")
    parser.add_argument("--tune-only", action="store_true",
                        help="fill fusepass's tuning cache for --batch-sizes (fusepass.warmup) and time nothing")
    parser.add_argument("--batch-sizes", type=parse_batches, metavar="B,B,...", help="with --tune-only")
    args = parser.parse_args(argv)
    if args.tune_only and not args.batch_sizes:
        raise BenchError("--tune-only needs --batch-sizes")
    # eager first: running statistics and the float64 criterion are judged against it
    args.providers = ["eager", *(p for p in args.providers if p != "eager")]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda, but no CUDA GPU is available (use --device cpu)")
    if args.shrink < 1:
        raise BenchError(f"--shrink must be at least 1, not {args.shrink}")
    if args.seeds < 1:
        raise BenchError(f"--seeds must be at least 1, not {args.seeds}")
    cfg = Config(args.device, args.mode, args.precision, args.providers, args.backward, args.seeds,
                 list(args.size) if args.size else None, args.shrink, args.atol, args.rtol, args.warmup, args.rep)
    return args.problems, cfg, args


def main(argv: Optional[list[str]] = None) -> int:
    try:
        paths, cfg, args = parse_args(argv)
    except SystemExit as exc:  # --help, which argparse has printed
        return exc.code if isinstance(exc.code, int) else 0
    except BenchError as exc:
        return _bad_input(exc)
    env = environment(cfg.device, sys.argv[1:] if argv is None else argv)
    if args.tune_only:
        return tune_only(paths, cfg, args.batch_sizes)
    if args.batch_sequence:
        return run_shape_changes(paths, cfg, args, env)
    try:
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise BenchError("--plot needs matplotlib, which is not installed (pip install matplotlib)")
        results = run(paths, cfg, progress=lambda text: print(text, file=sys.stderr, flush=True))
    except BenchError as exc:
        return _bad_input(exc)
    print(f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}")
    for problem in dict.fromkeys(r.problem for r in results):
        print(f"\n{problem}")
        print(format_table(results, problem, cfg.backward))
    if args.json:
        payload = {"environment": env, "config": {k: v for k, v in asdict(cfg).items() if k != "results"},
                   "results": [{k: _json_value(v) for k, v in asdict(r).items()} for r in results],
                   "fusepass_tuning": TUNER.timings}
        Path(args.json).write_text(json.dumps(payload, indent=2, allow_nan=False))
    if args.plot:
        write_plot(results, args.plot)
    return 0 if all(r.correct for r in results if r.provider != "eager") else 1


def tune_only(paths: list[str], cfg: Config, batch_sizes: list[int]) -> int:
    """fusepass.warmup for each problem, mode and precision: the tuning cache filled, nothing timed."""
    for path in paths:
        module = load(path, cfg.size, cfg.shrink)
        for mode in cfg.modes:
            for precision in cfg.precisions:
                model, inputs = build_model(module, mode, cfg.device), problem_inputs(module, cfg.device)
                with precision_context(precision, cfg.device):
                    done = warmup(model, inputs, batch_sizes, train=mode == "train")
                print(f"{path} {mode} {precision}: batch sizes {batch_sizes}, {done['tunings']} bucket(s) timed, "
                      f"{done['graphs']} graph(s) compiled")
    return 0


def run_shape_changes(paths: list[str], cfg: Config, args: argparse.Namespace, env: dict) -> int:
    """The shape-changes mode: every problem, mode and precision through --batch-sequence."""
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}")
    runs = []
    for path in paths:
        for mode in cfg.modes:
            for precision in cfg.precisions:
                results = shape_changes.compare(path, args.batch_sequence, mode, precision, cfg.providers,
                                                args.caches, cfg.device, cfg.size, cfg.shrink)
                print(f"\n{Path(path).stem}, {mode}, {precision}: seconds per step, compilation included")
                print(shape_changes.format_table(results, args.batch_sequence))
                runs.append({"problem": Path(path).stem, "mode": mode, "precision": precision,
                             "sequence": args.batch_sequence, "results": results})
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "shape_changes": runs}, indent=2))
    return 0


def _bad_input(exc: BenchError) -> int:
    message = " ".join(line.strip() for line in str(exc).splitlines())  # one line, whatever the cause
    print(f"fusepass-bench: error: {message}", file=sys.stderr)
    return 2


def _json_value(value):
    """JSON has no NaN or infinity: a figure that was not measured is null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


if __name__ == "__main__":
    sys.exit(main())
