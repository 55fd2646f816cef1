"""Picks the fastest implementation of a fused op per problem by timing every candidate once, and
remembers the choice in memory and on disk, so that a second process does not tune again.

A problem is a family (what every call of it shares: dtypes, layouts, precision, flags; the ops build
it) and a size bucket: each GEMM dimension rounded up to a power of two. A choice serves its whole
bucket; the kernels take the exact sizes at run time. A bucket met for the first time takes the choice
of the nearest bucket of its family already chosen, at once, without timing: timing a bucket costs a
stall of about 0.1 s per candidate, and a new candidate's compile a second or more. Only a family's
first bucket is timed, unless `tune_every_bucket()` is in force (`fusepass.warmup` fills the cache for
a list of batch sizes that way, ahead of time). Borrowed choices stay in this process; the disk keeps
timed ones.

The file is JSON, `$FUSEPASS_CACHE_DIR/tuning.json` (default `~/.cache/fusepass`): one entry per GPU,
torch and triton versions, hash of the kernels' source and problem family, mapping each timed bucket to
its choice.

How much is timed (FUSEPASS_TUNE): by default a short list per problem (the ops build it: each GEMM
precision's first tile config, a small-tile config where the first's tiles would leave SMs idle, and
cuBLAS; each Triton candidate costs a kernel compile, most of a tuning's time, and the ops' candidates
compile at the same time, on threads); "full" times every candidate; "0" times nothing and takes each
problem's first candidate (the heuristic default).

Counted in torch._dynamo.utils.counters["fusepass"]: "tunings" (buckets timed), "borrowed" (buckets
that took a neighbour's choice).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
import triton
from filelock import FileLock, Timeout
from torch._dynamo.utils import counters

log = logging.getLogger(__name__)
CACHE_DIR_ENV = "FUSEPASS_CACHE_DIR"
# do_bench_cudagraph replays a graph of about this many ms of calls ten times, so each candidate costs
# ~0.1 s of a first compile (a cold fp32 training step's compile times about ten).
TIMING_MS = 10
TUNE_ENV = "FUSEPASS_TUNE"
LOCK_TIMEOUT_S = 30  # a write waits this long for another process's; past it the choice stays in memory


def search() -> str:
    """"off", "short" (default) or "full": how many candidates the ops offer for timing (FUSEPASS_TUNE)."""
    value = os.environ.get(TUNE_ENV, "1")
    return {"0": "off", "full": "full"}.get(value, "short")


def bucket(n: int) -> int:
    """The size bucket of a dimension: the next power of two (0 and 1 are their own)."""
    return 1 << (n - 1).bit_length() if n > 1 else n


class Problem(NamedTuple):
    """What a choice depends on: a family and a bucket of sizes (each already rounded by `bucket`)."""
    family: str
    sizes: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.family} sizes={'x'.join(map(str, self.sizes))}"

    def distance(self, sizes: tuple[int, ...]) -> float:
        """How far another bucket of the family is: the sum of the dimensions' log2 ratios."""
        return sum(abs(math.log2(max(a, 1)) - math.log2(max(b, 1))) for a, b in zip(self.sizes, sizes))


def cache_path() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fusepass")
    return Path(root) / "tuning.json"


@functools.cache
def source_hash() -> str:
    """A hash of fusepass's Python source: its kernels, and everything that decides how they run."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def environment_key(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name}|torch {torch.__version__}|triton {triton.__version__}|source {source_hash()}"


_TUNE_EVERY_BUCKET = threading.local()


@contextlib.contextmanager
def tune_every_bucket() -> Iterator[None]:
    """Within it, a bucket met for the first time is timed instead of borrowing a neighbour's choice."""
    previous = getattr(_TUNE_EVERY_BUCKET, "on", False)
    _TUNE_EVERY_BUCKET.on = True
    try:
        yield
    finally:
        _TUNE_EVERY_BUCKET.on = previous


def _sizes_key(sizes: tuple[int, ...]) -> str:
    return "x".join(map(str, sizes))


class Tuner:
    def __init__(self) -> None:
        self._choices: dict[str, dict[str, str]] = {}  # family key -> bucket -> choice (this process)
        self._lock = threading.Lock()
        self.timings: dict[str, dict[str, float]] = {}  # problem -> candidate -> median ms, this process

    def forget(self) -> None:
        """Drops what this process remembers (the disk cache stays): tests start from a clean slate."""
        with self._lock:
            self._choices.clear()
            self.timings.clear()

    def cached(self, problem: Problem, device: torch.device) -> Optional[str]:
        """The choice remembered for exactly this problem (this process, or the disk cache), without
        timing or borrowing."""
        with self._lock:
            return self._family(_cache_key(problem.family, device)).get(_sizes_key(problem.sizes))

    def record(self, problem: Problem, device: torch.device, choice: str) -> None:
        """Remembers a choice made without timing (here and on disk), as if timing had made it."""
        with self._lock:
            self._remember(_cache_key(problem.family, device), problem.sizes, choice, on_disk=True)

    def _family(self, key: str) -> dict[str, str]:
        """The family's buckets: this process's, over the disk's."""
        return {**_read_cache().get(key, {}), **self._choices.get(key, {})}

    def _remember(self, key: str, sizes: tuple[int, ...], choice: str, on_disk: bool) -> None:
        self._choices.setdefault(key, {})[_sizes_key(sizes)] = choice
        if on_disk:
            _write_cache(key, _sizes_key(sizes), choice)

    def choose(self, problem: Problem, device: torch.device, candidates: dict[str, Callable[[], Any]],
               clock: Optional[Callable[[Callable[[], Any]], float]] = None, parallel_first_runs: bool = False
               ) -> str:
        """The name of the fastest candidate for `problem`: remembered for its bucket, else borrowed from
        the nearest bucket of its family, else timed. Candidates are side-effect-free callables (each
        allocates its own outputs); the first is the default when timing is off or impossible. `clock`
        times one candidate (default gpu_time). Each candidate runs once before it is timed; with
        `parallel_first_runs`, all of them at once on threads (see _run_each_once)."""
        key = _cache_key(problem.family, device)
        with self._lock:
            known = self._family(key)
            choice = known.get(_sizes_key(problem.sizes))
            if choice in candidates:
                self._remember(key, problem.sizes, choice, on_disk=False)
                return choice
            borrowed = self._nearest(problem, known, candidates)
            if borrowed is not None:
                counters["fusepass"]["borrowed"] += 1
                self._remember(key, problem.sizes, borrowed, on_disk=False)
                return borrowed
            first = next(iter(candidates))
            if search() == "off" or capturing(device):
                return first  # timing inside a CUDA graph capture is impossible; not remembered
            times = _time_candidates(candidates, clock or gpu_time, device if parallel_first_runs else None)
            _release_cublas_workspaces(device)
            counters["fusepass"]["tunings"] += 1
            self.timings[problem.describe()] = times
            choice = min(times, key=times.get) if times else first
            log.info("fusepass tuning %s: %s", problem.describe(),
                     ", ".join(f"{name} {ms:.4f} ms" for name, ms in sorted(times.items(), key=lambda i: i[1])))
            self._remember(key, problem.sizes, choice, on_disk=True)
            return choice

    @staticmethod
    def _nearest(problem: Problem, known: dict[str, str], candidates: dict) -> Optional[str]:
        if getattr(_TUNE_EVERY_BUCKET, "on", False):
            return None
        usable = [(problem.distance(tuple(int(d) for d in sizes.split("x"))), sizes) for sizes, choice in known.items()
                  if choice in candidates and sizes]
        return known[min(usable)[1]] if usable else None


def _cache_key(family: str, device: torch.device) -> str:
    return f"{environment_key(device)}|{family}"


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _time_candidates(candidates: dict[str, Callable[[], Any]], clock: Callable[[Callable[[], Any]], float],
                     parallel_on: Optional[torch.device]) -> dict[str, float]:
    """Median ms of each candidate that runs (a config that does not fit the GPU fails in its first,
    untimed run). The first runs are concurrent where `parallel_on` names the device."""
    failed = _run_each_once(candidates, parallel_on) if parallel_on is not None else {}
    times = {}
    for name, run in candidates.items():
        if name in failed:
            log.info("fusepass tuning: candidate %s failed: %r", name, failed[name])
            continue
        try:
            if parallel_on is None:
                run()
            times[name] = clock(run)
        except Exception as exc:  # noqa: BLE001  (a candidate that cannot run is simply not chosen)
            log.info("fusepass tuning: candidate %s failed: %r", name, exc)
    return times


def _run_each_once(candidates: dict[str, Callable[[], Any]], device: torch.device) -> dict[str, BaseException]:
    """Runs every candidate once, all at the same time, and returns the failures. A first run compiles
    the candidate's Triton kernels, most of a tuning's cost, and Triton compiles mostly outside the GIL
    (its MLIR passes, LLVM, ptxas): on threads the candidates compile in about the time of the slowest
    one instead of their sum (four GEMM configs for sm_90 on a 2-core CPU machine: 2.0 s instead of 3.0). Each thread
    runs on the caller's stream, without autograd: for the ops' candidates, which are kernels and the
    outputs they write."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def first_run(run: Callable[[], Any]) -> None:
        if stream is not None:
            # A new thread has no current CUDA context until a runtime call that needs one binds the
            # device's primary context; cuBLAS would otherwise warn that it had to set it itself.
            torch.cuda.synchronize(device)
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            run()

    with ThreadPoolExecutor(max_workers=len(candidates), thread_name_prefix="fusepass-tuning") as pool:
        futures = {name: pool.submit(first_run, run) for name, run in candidates.items()}
    return {name: future.exception() for name, future in futures.items() if future.exception() is not None}


def _release_cublas_workspaces(device: torch.device) -> None:
    """cuBLAS keeps a workspace for every thread and stream it ran on, for the life of the process: the
    tuning threads' and the timing graphs' capture streams' held 98 MB through a whole training run
    (H100, fp32, 1024 x 8192 -> 8192). Freed here (after the timed work is done); the stream a model
    runs on makes its own again at its next cuBLAS call."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch._C._cuda_clearCublasWorkspaces()


def gpu_time(run: Callable[[], Any]) -> float:
    """Median ms of the GPU work alone, with the L2 cache flushed before each call as the benchmark's
    do_bench does: replayed from a CUDA graph that flushes and runs, less one that only flushes.
    Timed back to back from Python, a candidate whose launches take longer on the host than its
    kernels on the GPU would be judged by its host time, which varies with the machine's load (at
    compile time, Inductor's compile workers) and mostly vanishes once Inductor launches the kernels
    itself. Without the flush, operands that fit in L2 favour some kernels: a bf16 Triton GEMM on
    transposed operands measured 0.050 ms against cuBLAS's 0.049, and 0.122 against 0.048 flushed
    (H100, 4096 x 4096 @ 4096 x 1024, tools/tune_linear.py)."""
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    if cache.is_cuda:
        # do_bench_cudagraph runs on a stream of its own, which does not wait for the caller's. The flush
        # buffer, allocated on the caller's stream, may be a block freed while a kernel queued there still
        # reads it (a model's intermediate, when a new size is tuned mid-step): zeroed unsynchronized, it
        # corrupted that kernel's input (an fp64 reference GEMM at 16384 x 4096 -> 4096, H100).
        torch.cuda.synchronize(cache.device)
    try:
        flushed = triton.testing.do_bench_cudagraph(lambda: (cache.zero_(), run()), rep=TIMING_MS,
                                                    return_mode="median")
        ms = flushed - _flush_ms(cache)
        if ms <= 0:  # the flush was timed while the GPU was busier than now (seen under 8 test workers)
            ms = flushed - _flush_ms(cache, again=True)
        if ms <= 0:  # still lost in the load's noise (seen under 12): the run alone, L2 not flushed, not 0
            ms = triton.testing.do_bench_cudagraph(run, rep=TIMING_MS, return_mode="median")
        return ms
    except Exception as exc:  # noqa: BLE001  (not capturable: time it from Python, which flushes too)
        log.info("fusepass tuning: CUDA-graph timing failed (%r); timing from Python", exc)
        return launched_time(run)


def launched_time(run: Callable[[], Any]) -> float:
    """Median ms per call launched from Python, L2 flushed before each (triton's do_bench): the GPU's
    time plus whatever the host adds where launches cannot keep ahead. For work that must not be
    captured in a CUDA graph."""
    return triton.testing.do_bench(run, warmup=TIMING_MS, rep=TIMING_MS, return_mode="median")


_FLUSH_MS: dict[tuple, float] = {}


def _flush_ms(cache: torch.Tensor, again: bool = False) -> float:
    """The flush's own time, the least taken so far: another process's load on the GPU only adds."""
    key = (cache.device, cache.numel())
    if again or key not in _FLUSH_MS:
        ms = triton.testing.do_bench_cudagraph(cache.zero_, rep=TIMING_MS, return_mode="median")
        _FLUSH_MS[key] = min(ms, _FLUSH_MS.get(key, ms))
    return _FLUSH_MS[key]


def _read_cache() -> dict[str, dict[str, str]]:
    try:
        entries = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return {key: value for key, value in entries.items() if isinstance(value, dict)}


def _write_cache(key: str, sizes: str, choice: str) -> None:
    """Merges one bucket's choice into the cache file. The ranks of one job tune at the same time: each
    read-modify-write holds a lock file, or one process's write would drop the choices another wrote
    since its read; the file is replaced atomically, so that readers need no lock."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S):
            entries = _read_cache()
            entries.setdefault(key, {})[sizes] = choice
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
                json.dump(entries, tmp, indent=1, sort_keys=True)
            os.replace(tmp.name, path)
    except (OSError, Timeout) as exc:
        log.warning("fusepass: could not write the tuning cache %s: %r", path, exc)


TUNER = Tuner()
