"""BENCHMARKS.md, regenerated from measurements. Run from the repository root.

    python tools/benchmark_report.py [all]        run every section (needs a CUDA GPU), then write
    python tools/benchmark_report.py run [--only SECTION ...] [--out DIR] [--dry-run]
    python tools/benchmark_report.py write [--json-dir DIR] [--output FILE]

run:   fusepass-bench (python -m fusepass.bench) once per spec of the chosen sections, each writing
       DIR/<spec>.json (default benchmarks/), which this script annotates with its section, the commit
       and the state of the compile caches (every spec starts with empty Inductor, Triton and fusepass
       caches of its own, so compile times are cold; the compile-warm section runs its spec twice
       over the same caches and keeps the second, warm, run). fusepass must be installed
       (`pip install -e .`): torch.compile finds the backend through its entry point.
write: BENCHMARKS.md from every JSON file in benchmarks/ (no GPU): one table per measure with eager,
       Inductor, Inductor max-autotune and fusepass side by side, fusepass's ratios, the floor and the
       fraction of it reached. Where two files measured the same row, the newer one is shown.
       Everything from the heading "## Tried and rejected" on is hand-written and kept verbatim.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "BENCHMARKS.md"
JSON_DIR = ROOT / "benchmarks"
KEPT_HEADING = "## Tried and rejected"
THIS = "python tools/benchmark_report.py"
BUCKET_TOOL = "tools/bucket_vs_exact.py"
GEMM_TOOL = "tools/gemm_alone.py"

# --------------------------------------------------------------------------- what `run` measures

SCALE_BN = "demos/problems/gemm_scale_batchnorm.py"  # 16384 x 4096 -> 4096
SOFTMAX = "demos/problems/gemm_batchnorm_scale_softmax.py"  # 1024 x 8192 -> 8192
MLP = "demos/problems/mlp_batchnorm.py"  # torchvision.ops.MLP(1024, [4096, 4096, 256]) with BatchNorm1d, batch 4096
BN = "demos/problems/gemm_batchnorm.py"  # 1024 x 8192 -> 8192, nothing after the batch norm
SWISH = "demos/problems/gemm_batchnorm_swish.py"  # the same with a four-op pointwise tail
MATMUL = "demos/problems/matmul_batchnorm_scale_softmax.py"  # SOFTMAX with a matmul head
PROVIDERS = ("eager", "inductor", "max-autotune", "fusepass")
CUDA_GRAPH_PROVIDERS = ("inductor-cudagraphs", "fusepass-cudagraphs")
# Training steps are compared with eager and Inductor in both of Inductor's modes; max-autotune's cold
# GEMM autotuning (57-114 s per training step) would take most of their device time.
TRAINING_PROVIDERS = ("eager", "inductor", "fusepass") + CUDA_GRAPH_PROVIDERS
# Fewer input draws and shorter timings than the bench's defaults (5 draws, 500 ms) keep the whole
# run near 40 minutes on an H200, most of it compiling.
TIMING = ("--seeds", "2", "--warmup", "50", "--rep", "200")
# The compile-warm section wants compile times only: one draw, the shortest timing.
COMPILE_ONLY_TIMING = ("--seeds", "1", "--warmup", "10", "--rep", "20")


@dataclass(frozen=True)
class Spec:
    """One fusepass-bench command. estimate_s: its wall time on an H200 (torch 2.11, triton 3.6) with
    cold caches. Measured: forward-fp32-1024 100 s; training-step-fp32 239 s, -fp32-1024 75-85 s,
    -bf16-1024 73 s; small-shapes 201 s. The others are scaled from those by their compiled graphs.
    Most of it is max-autotune's cold GEMM autotuning: 15-47 s per forward graph, 57-114 s per
    training step."""
    name: str  # the JSON file's stem
    section: str
    problems: tuple[str, ...]
    modes: tuple[str, ...]
    precisions: tuple[str, ...]
    estimate_s: int
    size: Optional[str] = None  # --size N,K,F
    backward: bool = False
    providers: tuple[str, ...] = PROVIDERS
    timing: tuple[str, ...] = TIMING
    warm: bool = False  # run twice over the same caches; keep the second run
    batch_sequence: Optional[str] = None  # the shape-changes mode: B,B,... (cold and warm caches, by the bench)
    largest_batch: bool = False  # the largest-batch mode
    bucket_sizes: Optional[str] = None  # tools/bucket_vs_exact.py's --sizes B,B,... (one mode and precision)
    gemm_alone: bool = False  # tools/gemm_alone.py: the GEMM alone, no problem

    def argv(self, json_path: Path) -> list[str]:
        if self.gemm_alone:
            return [sys.executable, GEMM_TOOL, "--json", str(json_path)]
        if self.bucket_sizes:
            return [sys.executable, BUCKET_TOOL, *self.problems, "--size", self.size, "--sizes", self.bucket_sizes,
                    "--mode", *self.modes, "--precision", *self.precisions, "--json", str(json_path),
                    *(["--backward"] if self.backward else [])]
        if self.largest_batch:
            return [sys.executable, "-m", "fusepass.bench", *self.problems, "--largest-batch", "--device", "cuda",
                    "--precision", *self.precisions, "--providers", *self.providers, "--json", str(json_path),
                    *(["--size", self.size] if self.size else [])]
        if self.batch_sequence:
            return [sys.executable, "-m", "fusepass.bench", *self.problems, "--batch-sequence", self.batch_sequence,
                    "--mode", *self.modes, "--precision", *self.precisions, "--providers", *self.providers,
                    "--caches", "cold", "warm", "--size", self.size, "--json", str(json_path)]
        args = [sys.executable, "-m", "fusepass.bench", *self.problems, "--mode", *self.modes,
                "--precision", *self.precisions, "--providers", *self.providers, *self.timing,
                "--json", str(json_path)]
        args += ["--size", self.size] if self.size else []
        args += ["--backward"] if self.backward else []
        return args


def forward_specs(precision: str, label: str, estimate_s: int, estimate_1024_s: int) -> list[Spec]:
    section = f"forward-{label}"
    return [Spec(section, section, (SCALE_BN, SOFTMAX), ("train", "eval"), (precision,), estimate_s),
            Spec(f"{section}-1024", section, (SCALE_BN,), ("train", "eval"), (precision,), estimate_1024_s,
                 size="1024,8192,8192")]


def training_specs(precision: str, label: str, estimate_s: int, estimate_1024_s: int) -> list[Spec]:
    section = f"training-step-{label}"
    return [Spec(section, section, (SCALE_BN, SOFTMAX, MLP), ("train",), (precision,), estimate_s, backward=True,
                 providers=TRAINING_PROVIDERS),
            Spec(f"{section}-1024", section, (SCALE_BN,), ("train",), (precision,), estimate_1024_s,
                 size="1024,8192,8192", backward=True, providers=TRAINING_PROVIDERS)]


SPECS: list[Spec] = [
    *forward_specs("fp32", "fp32", 230, 100),
    *forward_specs("tf32", "tf32", 220, 100),
    *forward_specs("bf16-autocast", "bf16", 220, 100),
    *training_specs("fp32", "fp32", 200, 60),
    *training_specs("tf32", "tf32", 200, 60),
    *training_specs("bf16-autocast", "bf16", 200, 60),
    Spec("small-shapes", "small-shapes", (SCALE_BN, SOFTMAX), ("train", "eval"), ("fp32", "bf16-autocast"), 200,
         size="128,1024,512", providers=PROVIDERS + CUDA_GRAPH_PROVIDERS),
    Spec("small-shapes-training", "small-shapes", (SCALE_BN, SOFTMAX), ("train",), ("fp32", "bf16-autocast"), 150,
         size="128,1024,512", backward=True, providers=TRAINING_PROVIDERS),
    # A tail is free when the tail problem takes what BN does; a matmul head, when it takes what SOFTMAX does.
    Spec("tails-heads-forward", "tails-heads", (BN, SWISH, SOFTMAX, MATMUL), ("train", "eval"), ("fp32",), 130,
         providers=("eager", "inductor", "fusepass")),
    Spec("tails-heads-training", "tails-heads", (BN, SWISH, SOFTMAX, MATMUL), ("train",), ("fp32",), 110, backward=True,
         providers=("eager", "inductor", "fusepass")),
    # cold priming run (~190 s) + warm run (~40 s)
    Spec("compile-warm", "compile-warm", (SCALE_BN, SOFTMAX), ("train",), ("fp32", "bf16-autocast"), 230,
         timing=COMPILE_ONLY_TIMING, warm=True),
    # Issue 24's loops: a training loop whose last batches are short, and a server's requests (H100: 264 s, 235 s).
    Spec("shape-changes-train-fp32", "shape-changes", (SCALE_BN,), ("train",), ("fp32",), 270, size="1024,4096,4096",
         providers=("inductor", "fusepass"), batch_sequence="1024,1024,1024,777,1024,1024,777,1024,512"),
    Spec("shape-changes-eval-fp32", "shape-changes", (SCALE_BN,), ("eval",), ("fp32",), 240, size="1024,4096,4096",
         providers=("inductor", "fusepass"), batch_sequence="1,8,33,64,100,256,8,1000,64"),
    # The steady step of bucketed choices against exact ones (H200: 68 s train, 39 s eval, caches warm).
    Spec("bucket-vs-exact-train-fp32", "shape-changes", (SCALE_BN,), ("train",), ("fp32",), 120,
         size="1024,4096,4096", backward=True, bucket_sizes="1024,777,16384"),
    Spec("bucket-vs-exact-eval-fp32", "shape-changes", (SCALE_BN,), ("eval",), ("fp32",), 60,
         size="1024,4096,4096", bucket_sizes="1024,777,16384"),
    # Issue 27's measure: each provider's search is ~13 training steps at up to ~1M rows, two compiles (H100:
    # the MLP's ~50 s per provider and precision).
    Spec("largest-batch-mlp", "largest-batch", (MLP,), ("train",), ("fp32", "bf16-autocast"), 300,
         providers=("eager", "inductor", "fusepass"), largest_batch=True),
    Spec("largest-batch-1024", "largest-batch", (SCALE_BN,), ("train",), ("fp32", "bf16-autocast"), 300,
         size="1024,8192,8192", providers=("eager", "inductor", "fusepass"), largest_batch=True),
    # Issue 26's GEMM table: 5 shapes x 4 precisions, every tile config (H100: 31 s for three).
    Spec("gemm-alone", "gemm-alone", (), (), (), 60, gemm_alone=True),
]
SECTIONS = list(dict.fromkeys(spec.section for spec in SPECS))
# Sections grouped into device calls of under 9 minutes each: the estimates add up to at most 7.2
# minutes per call, a margin for the calls' start-up and for estimates that are off.
DEVICE_CALLS = [
    ("forward-fp32",),
    ("forward-tf32",),
    ("forward-bf16",),
    ("training-step-fp32",),
    ("training-step-tf32",),
    ("training-step-bf16",),
    ("small-shapes",),
    ("compile-warm",),
    ("tails-heads",),
    ("shape-changes-train-fp32",),
    ("shape-changes-eval-fp32",),
    ("bucket-vs-exact-train-fp32", "bucket-vs-exact-eval-fp32"),
    ("largest-batch-mlp",),
    ("largest-batch-1024",),
    ("gemm-alone",),
]

COLD_NOTE = ("empty Inductor (FX-graph, autotuning), Triton and fusepass tuning caches of its own: "
             "compile times include fusepass's tuning and max-autotune's GEMM autotuning")
WARM_NOTE = ("second process over the caches the first filled: Inductor's FX-graph and autotuning "
             "caches, Triton's kernel cache and fusepass's tuning are warm")


# --------------------------------------------------------------------------- run


def selected_specs(only: Optional[list[str]]) -> list[Spec]:
    if not only:
        return SPECS
    unknown = [name for name in only if name not in SECTIONS and name not in {s.name for s in SPECS}]
    if unknown:
        raise SystemExit(f"unknown section {unknown[0]!r}; sections: {', '.join(SECTIONS)}")
    return [spec for spec in SPECS if spec.section in only or spec.name in only]


def cache_env(cache_root: Path) -> dict[str, str]:
    """Environment giving one bench process caches of its own under cache_root."""
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_root / "inductor"),
            "TRITON_CACHE_DIR": str(cache_root / "triton"), "FUSEPASS_CACHE_DIR": str(cache_root / "fusepass"),
            "PYTHONUNBUFFERED": "1"}


def run_bench(argv: list[str], env: dict[str, str], dry_run: bool) -> int:
    print(("" if dry_run else "\n") + "$ python " + " ".join(argv[1:]), flush=True)
    if dry_run:
        return 0
    status = subprocess.run(argv, cwd=ROOT, env=env).returncode
    if status not in (0, 1):  # 1: some provider wrong, which the JSON records and the report shows
        raise SystemExit(f"fusepass-bench failed (exit status {status}): {' '.join(argv[1:])}")
    return status


def run_spec(spec: Spec, out_dir: Path, dry_run: bool = False) -> None:
    json_path = out_dir / f"{spec.name}.json"
    cache_root = Path(tempfile.mkdtemp(prefix=f"fusepass-bench-{spec.name}-"))
    try:
        env = cache_env(cache_root)
        if spec.warm:  # the priming run's figures are cold ones, already measured by the forward sections
            run_bench(spec.argv(cache_root / "priming.json"), env, dry_run)
        started = time.perf_counter()
        run_bench(spec.argv(json_path), env, dry_run)
        if not dry_run and not json_path.is_file():
            raise SystemExit(f"fusepass-bench wrote no {json_path}")
        if not dry_run:
            annotate(json_path, spec, time.perf_counter() - started)
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)


def annotate(json_path: Path, spec: Spec, wall_s: float) -> None:
    """Adds what the bench cannot know: section, caches, commit, wall time."""
    from fusepass.measure import source_commit
    payload = json.loads(json_path.read_text())
    payload["report"] = {"section": spec.section, "spec": spec.name, "caches": "warm" if spec.warm else "cold",
                         "caches_note": WARM_NOTE if spec.warm else COLD_NOTE, "commit": source_commit(),
                         "wall_s": round(wall_s)}
    json_path.write_text(json.dumps(payload, indent=2))


def run(only: Optional[list[str]], out_dir: Path, dry_run: bool = False) -> None:
    out_dir = out_dir.resolve()  # the bench runs in the repository root
    out_dir.mkdir(parents=True, exist_ok=True)
    for spec in selected_specs(only):
        run_spec(spec, out_dir, dry_run)


# --------------------------------------------------------------------------- results as rows

SMALL_SIZE = (128, 1024, 512)
MODES = ("train", "eval")
PRECISIONS = ("fp32", "tf32", "bf16-autocast", "fp16-autocast")
COMPILE_ONLY_SECTIONS = ("compile-warm", "compile-cold")  # timings not shown in the speed tables


@dataclass
class Source:
    """One JSON file of fusepass-bench output."""
    path: Path
    payload: dict

    @property
    def env(self) -> dict:
        return self.payload["environment"]

    @property
    def report(self) -> dict:
        return self.payload.get("report", {})

    @property
    def backward(self) -> bool:
        return bool(self.payload["config"].get("backward"))


@dataclass
class Row:
    """One provider's result, with what the tables group and sort by."""
    source: Source
    result: dict
    problem: str  # the problem file's name, without size
    size: Optional[tuple[int, int, int]]
    measure: str  # forward | training-step | small-shapes | compile-only

    @property
    def provider(self) -> str:
        return self.result["provider"]

    @property
    def case(self) -> tuple:
        return (self.problem, self.size, self.result["mode"], self.result["precision"])

    @property
    def usable(self) -> bool:
        """Correct, and no graph fell back (its time would not be fusepass's)."""
        fallbacks = self.result.get("fusepass_fallbacks", self.result.get("fallbacks")) or 0
        return bool(self.result.get("correct")) and not fallbacks


def result_size(result: dict, config: dict) -> Optional[tuple[int, int, int]]:
    if result.get("size"):
        return tuple(result["size"])
    match = re.fullmatch(r".*@(\d+)x(\d+)x(\d+)", result["problem"])
    return tuple(int(n) for n in match.groups()) if match else None


def problem_file_name(name: str) -> str:
    return name.split("@")[0]


def measure_of(source: Source, size: Optional[tuple]) -> str:
    if source.report.get("section") in COMPILE_ONLY_SECTIONS:
        return "compile-only"
    if source.backward:
        return "small-shapes-training" if size == SMALL_SIZE else "training-step"
    return "small-shapes" if size == SMALL_SIZE else "forward"


def rows_of(source: Source) -> list[Row]:
    rows = []
    for result in source.payload["results"]:
        size = result_size(result, source.payload["config"])
        rows.append(Row(source, result, problem_file_name(result["problem"]), size, measure_of(source, size)))
    return rows


def load_sources(json_dir: Path) -> list[Source]:
    """fusepass-bench's timing JSON (the shape-changes and largest-batch modes' are loaded apart)."""
    return [source for source in _load(json_dir)
            if not {SHAPE_CHANGES_KEY, LARGEST_BATCH_KEY, BUCKET_KEY, GEMM_KEY} & source.payload.keys()]


def load_shape_changes(json_dir: Path) -> list[Source]:
    return [source for source in _load(json_dir) if SHAPE_CHANGES_KEY in source.payload]


def load_bucket_vs_exact(json_dir: Path) -> list[Source]:
    return [source for source in _load(json_dir) if BUCKET_KEY in source.payload]


def load_gemm_alone(json_dir: Path) -> list[Source]:
    return [source for source in _load(json_dir) if GEMM_KEY in source.payload]


def load_largest_batch(json_dir: Path) -> list[Source]:
    return [source for source in _load(json_dir) if LARGEST_BATCH_KEY in source.payload]


def _load(json_dir: Path) -> list[Source]:
    return [Source(path, json.loads(path.read_text())) for path in sorted(json_dir.glob("*.json"))]


def newest_rows(sources: list[Source]) -> list[Row]:
    """Every row, where two files measured the same one keeping the later (the dates are ISO, UTC).
    A forward row also gives a compile time: a compile-only row with the same caches gives way to a
    newer one."""
    chosen: dict[tuple, Row] = {}
    for source in sorted(sources, key=lambda s: s.env["date"]):
        for row in rows_of(source):
            chosen[row_key(row)] = row
    rows = list(chosen.values())
    forward = {compile_key(r): r for r in rows if r.measure == "forward"}
    return [r for r in rows if not (r.measure == "compile-only" and compile_key(r) in forward
                                    and forward[compile_key(r)].source.env["date"] >= r.source.env["date"])]


def row_key(row: Row) -> tuple:
    """What makes two rows the same measurement; compile-only rows differ by their caches too."""
    return (row.measure, *(compile_key(row) if row.measure == "compile-only" else (*row.case, row.provider)))


def compile_key(row: Row) -> tuple:
    return (caches_label(row.source), *row.case, row.provider)


def caches_label(source: Source) -> str:
    return source.report.get("caches", "not recorded")


# --------------------------------------------------------------------------- floors

# Rates on an H200 (torch 2.11, triton 3.6; tools/gpu_rates.py): cuBLAS TF32 up to 413 TFLOP/s, bf16 up
# to 709 TFLOP/s, device copy 4.2 TB/s. fp32 runs as 3xTF32 (three TF32 products), whose floor takes the
# data sheet's dense TF32 peak, 494 TFLOP/s, over three: fusepass's training steps went past a third of
# the best measured TF32 rate (141 TFLOP/s effective against 138). No H100 rates are recorded: an
# H100's rows get no floor.
RATES = {"H200": {"gemm": {"fp32": 165e12, "tf32": 413e12, "bf16-autocast": 709e12}, "copy": 4.2e12}}
# Output bytes per element; autocast's is taken as bf16 even where a softmax returns fp32: a lower bound.
OUT_BYTES = {"fp32": 4, "tf32": 4, "bf16-autocast": 2}


def gpu_rates(device: str) -> Optional[dict]:
    return next((rates for model, rates in RATES.items() if model in device), None)


def floor_ms(size: Optional[tuple], precision: str, device: str, training_step: bool,
             forward_flop: Optional[int] = None) -> Optional[float]:
    """The GEMMs (once in a forward, three times in a training step: the forward's, dX's and dW's) at
    the GPU's best measured rate, or a forward's unavoidable traffic (x and W read as fp32, as the model
    holds them, the output written once) at its copy bandwidth, whichever is longer. The GEMM FLOP are
    the bench's count of the model's forward (`forward_flop`), else 2·N·K·F. None where no rate is known."""
    rates = gpu_rates(device)
    if size is None or rates is None or precision not in rates["gemm"]:
        return None
    n, k, f = size
    flop = forward_flop or 2 * n * k * f
    gemm_s = flop * (3 if training_step else 1) / rates["gemm"][precision]
    traffic_s = 0.0 if training_step else (4 * (n * k + f * k) + OUT_BYTES[precision] * n * f) / rates["copy"]
    return max(gemm_s, traffic_s) * 1e3


# --------------------------------------------------------------------------- cells

MISSING = "-"


SPREAD = 1.5  # p80 / p20 above which a median gets its percentiles beside it


def ms_cell(row: Optional[Row], key: str = "median_ms", digits: int = 3) -> str:
    if row is None:
        return MISSING
    if not row.usable:
        return "wrong"
    value = row.result.get(key)
    if value is None:
        return MISSING
    return f"{value:.{digits}f}" + (spread(row.result) if key == "median_ms" else "")


def spread(result: dict) -> str:
    """" (p20–p80)" where they are far apart: that median is not a figure to rely on."""
    p20, p80 = result.get("p20_ms"), result.get("p80_ms")
    return f" ({p20:.3f}–{p80:.3f})" if p20 and p80 and p80 > SPREAD * p20 else ""


def ratio_cell(numerator: Optional[Row], denominator: Optional[Row], key: str = "median_ms") -> str:
    """One row's value over another's. The speed tables put another provider's time over fusepass's
    (above 1, fusepass is faster); the memory table, fusepass's peak over another's (below 1, it holds less).
    Only of two rows one run measured (one JSON file): a later run of some providers leaves the others' older
    rows beside them, on another day or machine."""
    if not same_run(numerator, denominator):
        return MISSING
    a, b = numerator.result.get(key), denominator.result.get(key)
    return f"{a / b:.2f}×" if a is not None and b else MISSING


def same_run(a: Optional[Row], b: Optional[Row]) -> bool:
    """Both rows present and usable, from one run (one JSON file)."""
    return a is not None and b is not None and a.usable and b.usable and a.source.path == b.source.path


def problem_cell(problem: str, size: Optional[tuple]) -> str:
    return f"{problem} {size[0]}×{size[1]}→{size[2]}" if size else problem


def floor_cells(providers: dict[str, Row], training_step: bool) -> list[str]:
    fused = providers.get("fusepass")
    any_row = fused or next(iter(providers.values()))
    floor = floor_ms(any_row.size, any_row.result["precision"], any_row.source.env["device"], training_step,
                     any_row.result.get("forward_flop"))
    if floor is None:
        return [MISSING, MISSING]
    reached = f"{floor / fused.result['median_ms']:.0%}" if fused and fused.usable else MISSING
    return [f"{floor:.3f}", reached]


# --------------------------------------------------------------------------- tables


def by_case(rows: Iterable[Row]) -> dict[tuple, dict[str, Row]]:
    cases: dict[tuple, dict[str, Row]] = {}
    for row in rows:
        cases.setdefault(row.case, {})[row.provider] = row
    return dict(sorted(cases.items(), key=lambda item: case_order(item[0])))


def case_order(case: tuple) -> tuple:
    problem, size, mode, precision = case
    return (problem, -(size or (0,))[0], MODES.index(mode) if mode in MODES else 9,
            PRECISIONS.index(precision) if precision in PRECISIONS else 9)


TIME_HEADERS = ["eager ms", "Inductor ms", "max-autotune ms", "fusepass ms", "vs eager", "vs Inductor",
                "vs max-autotune", "floor ms", "of floor"]


def time_cells(providers: dict[str, Row], training_step: bool = False) -> list[str]:
    fused = providers.get("fusepass")
    return [*(ms_cell(providers.get(p)) for p in PROVIDERS),
            *(ratio_cell(providers.get(p), fused) for p in ("eager", "inductor", "max-autotune")),
            *floor_cells(providers, training_step)]


def markdown(rows: list[list[str]], headers: list[str]) -> str:
    return tabulate(rows, headers, tablefmt="github", disable_numparse=True)


def forward_table(rows: list[Row], precision: str) -> Optional[str]:
    cases = by_case(r for r in rows if r.measure == "forward" and r.result["precision"] == precision)
    lines = [[problem_cell(case[0], case[1]), case[2], *time_cells(providers), gpu_cell(providers)]
             for case, providers in cases.items()]
    return markdown(lines, ["problem", "mode", *TIME_HEADERS, "GPU"]) if lines else None


def training_table(rows: list[Row]) -> Optional[str]:
    """Training steps in both of Inductor's modes: default, and reduce-overhead (CUDA graphs)."""
    cases = by_case(r for r in rows if r.measure == "training-step")
    lines = [[problem_cell(case[0], case[1]), case[3], *graph_mode_cells(providers),
              *floor_cells(providers, training_step=True), gpu_cell(providers)] for case, providers in cases.items()]
    headers = ["problem", "precision", *GRAPH_MODE_HEADERS, "floor ms", "of floor", "GPU"]
    return markdown(lines, headers) if lines else None


def gpu_cell(providers: dict[str, Row]) -> str:
    """The GPU a case ran on ("H100", "H200"): a table's rows may come from runs on different GPUs, and
    only the ratios within a row compare like with like. Where the row's own providers came from runs on
    different GPUs (two files measured some of them), each GPU with the providers it measured."""
    by_gpu: dict[str, list[str]] = {}
    for provider, row in providers.items():
        by_gpu.setdefault(row.source.env["device"].removeprefix("NVIDIA ").split()[0], []).append(provider)
    if len(by_gpu) == 1:
        return next(iter(by_gpu))
    return ", ".join(f"{gpu} ({' '.join(names)})" for gpu, names in by_gpu.items())


GRAPH_MODE_HEADERS = ["eager ms", "Inductor ms", "fusepass ms", "vs eager", "vs Inductor", "vs Inductor, rounds",
                      "Inductor + graphs ms", "fusepass + graphs ms", "+ graphs vs eager",
                      "+ graphs vs Inductor + graphs", "+ graphs vs Inductor + graphs, rounds"]


def graph_mode_cells(providers: dict[str, Row]) -> list[str]:
    fused, graphs = providers.get("fusepass"), providers.get("fusepass-cudagraphs")
    return [*(ms_cell(providers.get(p)) for p in ("eager", "inductor", "fusepass")),
            ratio_cell(providers.get("eager"), fused), ratio_cell(providers.get("inductor"), fused),
            rounds_cell(providers.get("inductor"), fused),
            *(ms_cell(providers.get(p)) for p in CUDA_GRAPH_PROVIDERS),
            ratio_cell(providers.get("eager"), graphs), ratio_cell(providers.get("inductor-cudagraphs"), graphs),
            rounds_cell(providers.get("inductor-cudagraphs"), graphs)]


def rounds_cell(numerator: Optional[Row], denominator: Optional[Row]) -> str:
    """The range of one row's round medians over another's, round by round: how far the ratio moved
    within one run ("-" for files without rounds)."""
    if not same_run(numerator, denominator):
        return MISSING
    return rounds_range(numerator.result.get("round_medians_ms"), denominator.result.get("round_medians_ms"))


def small_table(rows: list[Row]) -> Optional[str]:
    lines = []
    for measure, what in (("small-shapes", "forward"), ("small-shapes-training", "training step")):
        for case, providers in by_case(r for r in rows if r.measure == measure).items():
            lines.append([problem_cell(case[0], None), what, case[2], case[3], *time_cells(providers),
                          gpu_cell(providers)])
    return markdown(lines, ["problem", "measure", "mode", "precision", *TIME_HEADERS, "GPU"]) if lines else None


def cuda_graph_table(rows: list[Row]) -> Optional[str]:
    lines = []
    for measure, what in (("small-shapes", "forward"), ("small-shapes-training", "training step")):
        for (problem, _, mode, precision), providers in by_case(r for r in rows if r.measure == measure).items():
            if not any(p in providers for p in CUDA_GRAPH_PROVIDERS):
                continue
            graphs = providers.get("fusepass-cudagraphs")
            lines.append([problem, what, mode, precision,
                          *(ms_cell(providers.get(p)) for p in ("inductor", "inductor-cudagraphs", "fusepass",
                                                                "fusepass-cudagraphs")),
                          ratio_cell(providers.get("inductor-cudagraphs"), graphs),
                          ratio_cell(providers.get("inductor"), graphs)])
    headers = ["problem", "measure", "mode", "precision", "Inductor ms", "Inductor + graphs ms", "fusepass ms",
               "fusepass + graphs ms", "fusepass + graphs vs Inductor + graphs", "vs Inductor"]
    return markdown(lines, headers) if lines else None


def compile_rows(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.measure in ("forward", "compile-only")]


def compile_table(rows: list[Row]) -> Optional[str]:
    groups: dict[tuple, dict[str, Row]] = {}
    for row in sorted(compile_rows(rows), key=lambda r: r.source.env["date"]):  # the newer row wins
        groups.setdefault((*row.case, caches_label(row.source)), {})[row.provider] = row
    lines = []
    for key in sorted(groups, key=lambda k: (PRECISIONS.index(k[3]) if k[3] in PRECISIONS else 9,
                                             case_order(k[:4]), k[4])):
        providers, fused = groups[key], groups[key].get("fusepass")
        lines.append([problem_cell(key[0], key[1]), key[2], key[3], key[4],
                      *(ms_cell(providers.get(p), "compile_s", 2) for p in PROVIDERS),
                      ratio_cell(providers.get("inductor"), fused, "compile_s"),
                      ratio_cell(providers.get("max-autotune"), fused, "compile_s")])
    headers = ["problem", "mode", "precision", "caches", "eager s", "Inductor s", "max-autotune s", "fusepass s",
               "vs Inductor", "vs max-autotune"]
    return markdown(lines, headers) if lines else None


def memory_table(rows: list[Row]) -> Optional[str]:
    """Each call's own peak (rows measured before the bench recorded it are left out), and fusepass's
    over eager's and Inductor's: below 1, fusepass holds less."""
    lines = []
    for measure in ("forward", "training-step"):
        measured = (r for r in rows if r.measure == measure and r.result.get("own_peak_mb") is not None)
        for (problem, size, mode, precision), providers in by_case(measured).items():
            fused = providers.get("fusepass")
            lines.append([measure, problem_cell(problem, size), mode, precision,
                          *(ms_cell(providers.get(p), "own_peak_mb", 0) for p in PROVIDERS),
                          ratio_cell(fused, providers.get("eager"), "own_peak_mb"),
                          ratio_cell(fused, providers.get("inductor"), "own_peak_mb"), gpu_cell(providers)])
    headers = ["measure", "problem", "mode", "precision", "eager MB", "Inductor MB", "max-autotune MB", "fusepass MB",
               "fusepass ÷ eager", "fusepass ÷ Inductor", "GPU"]
    return markdown(lines, headers) if lines else None


# --------------------------------------------------------------------------- the document


def regenerate_block() -> str:
    calls = []
    for sections in DEVICE_CALLS:
        minutes = sum(s.estimate_s for s in SPECS if s.section in sections or s.name in sections) / 60
        calls.append(f"{THIS} run --only {' '.join(sections):<38} # ~{minutes:.0f} min")
    total = sum(s.estimate_s for s in SPECS) / 60
    return "\n".join([
        "Regenerate, from the repository root, on a machine with a CUDA GPU and fusepass installed "
        "(`pip install -e .`):", "",
        "```bash", f"{THIS}            # every section (~{total:.0f} min on an H200), then this file", "```", "",
        "or in device calls of under 9 minutes each (estimated H200 wall times), then the file alone "
        "(no GPU needed):", "",
        "```bash", *calls, f"{THIS} write", "```", "",
        "`run --dry-run` prints the fusepass-bench commands; `--out DIR` writes the JSON elsewhere "
        "(copy it into `benchmarks/` before `write`).", "",
        "The section \"Several GPUs\" comes from `demos/ddp_train.py` on two GPUs (~2 min each):", "",
        "```bash", *multi_gpu_commands(), "```",
    ])


def environments_line(sources: list[Source]) -> str:
    envs = sorted({(s.env["device"], s.env["torch"], s.env["triton"]) for s in sources})
    dates = sorted(s.env["date"] for s in sources)
    what = "; ".join(f"{device}, torch {torch}, triton {triton}" for device, torch, triton in envs)
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    return f"**Measured on:** {what}; {when} (UTC, as each JSON file records it)."


def sources_table(sources: list[Source]) -> str:
    lines = []
    for s in sources:
        config = s.payload["config"]
        lines.append([f"`{shown_path(s.path)}`", s.env["device"], s.env["torch"], s.env["triton"], s.env["date"],
                      s.report.get("commit") or MISSING, str(config.get("seeds", MISSING)),
                      str(config.get("rep_ms", MISSING)), caches_label(s)])
    return markdown(lines, ["file", "GPU", "torch", "triton", "date", "commit", "seeds", "rep ms", "caches"])


def shown_path(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def caches_notes(sources: list[Source]) -> list[str]:
    notes = dict.fromkeys(f"- **{caches_label(s)}**: {s.report['caches_note']}"
                          for s in sources if s.report.get("caches_note"))
    return list(notes)


def rates_line() -> str:
    parts = []
    for model, rates in RATES.items():
        gemm = ", ".join(f"{p} {r / 1e12:.0f} TFLOP/s" for p, r in rates["gemm"].items())
        parts.append(f"{model}: GEMMs {gemm} (fp32 is 3xTF32, three TF32 products: the data sheet's TF32 "
                     "peak over three; the others are the best measured); copy "
                     f"{rates['copy'] / 1e12:.1f} TB/s")
    return "; ".join(parts)


METHOD = """\
Each provider runs its own copy of the same model; fusepass-bench first checks each one against a
float64 copy on fresh input draws (a provider that is wrong, or whose graphs fell back to plain
Inductor, shows "wrong" and is not timed), then times it with `triton.testing.do_bench` (CUDA events,
L2 flushed between calls), in rounds interleaved across the providers where a file records them
(`--rounds`, 3 by default since 2026-11-27). Times are medians in ms, over every round. Train-mode
forwards run with grad enabled (a training step's forward); eval-mode forwards run under
`torch.no_grad()`. max-autotune is Inductor's `mode="max-autotune-no-cudagraphs"`. "vs X" is X's
median over fusepass's, both from one run (one JSON file; "-" where the newest rows of the two come
from different runs): above 1, fusepass is faster.
A median whose 20th and 80th percentiles are more than 1.5× apart has them beside it in parentheses:
it is noise, not a result. A "rounds" column gives the lowest and highest of a ratio taken round by
round: how far it moved within the run ("-" for a file without rounds). "-" means not measured."""


def floor_text() -> str:
    return "\n".join([
        "Floor: the longer of (a) 2·N·K·F FLOP per GEMM — one in a forward, three in a training step — at "
        "the GPU's best measured rate for the precision and (b) a forward's unavoidable memory traffic (x "
        "and W read as the fp32 the model holds, the output written once) at the measured copy "
        "bandwidth; a training step's floor counts its GEMMs only. \"of floor\" is the floor over "
        "fusepass's median.",
        f"Rates: {rates_line()}. No best rates have been measured on an H100, so an H100's rows have no floor.",
    ])


def section(title: str, intro: str, table: Optional[str]) -> list[str]:
    return [f"## {title}", "", intro, "", table or "Not measured (no JSON in `benchmarks/` has these rows).", ""]


MULTI_GPU_DIR = "multi-gpu"  # under the JSON directory: demos/ddp_train.py's JSON
MULTI_GPU_RUNS = (("ddp-bn-fp32", "batch_norm", "fp32"), ("ddp-sync-fp32", "sync_batch_norm", "fp32"),
                  ("ddp-sync-bf16", "sync_batch_norm", "bf16-autocast"))
MULTI_GPU_INTRO = (
    "The three reference problems' training step (forward, backward, SGD step) under DistributedDataParallel on "
    "two GPUs, each rank with half the reference batch, by `demos/ddp_train.py` (CUDA events, median; a fixed "
    "count of steps, as the ranks' collectives pair up: 20 after 5 warm-up steps, or, in files that record "
    "rounds, three rounds of 20 interleaved across the providers, whose per-round \"vs Inductor\" range is "
    "shown: \"-\" where a file has no rounds). Plain BatchNorm1d chains, and "
    "the same models after `nn.SyncBatchNorm.convert_sync_batchnorm`: Inductor DDP runs eager SyncBatchNorm "
    "there (its graph break), fusepass one fused op per chain. \"fused chains\" is fusepass's count per rank.")


def multi_gpu_commands() -> list[str]:
    problems = " ".join(f"demos/problems/{p}.py" for p in ("gemm_scale_batchnorm", "gemm_batchnorm_scale_softmax",
                                                            "mlp_batchnorm"))
    return [f"torchrun --nproc-per-node 2 demos/ddp_train.py --problems {problems} --norms {norm} "
            f"--precision {precision} --json benchmarks/{MULTI_GPU_DIR}/{name}.json" for name, norm, precision
            in MULTI_GPU_RUNS]


def load_multi_gpu(json_dir: Path) -> list[tuple[Path, dict]]:
    return [(path, json.loads(path.read_text())) for path in sorted((json_dir / MULTI_GPU_DIR).glob("*.json"))]


def multi_gpu_table(runs: list[tuple[Path, dict]]) -> Optional[str]:
    rows = []
    for _, run in runs:
        for r in run["results"]:
            ms = r["ms"]
            rows.append([r["problem"], "×".join(map(str, r["size"])), r["norm"], r["precision"],
                         *(f"{ms[p]:.3f}" for p in ("eager", "inductor", "fusepass")),
                         f"{ms['eager'] / ms['fusepass']:.2f}×", f"{ms['inductor'] / ms['fusepass']:.2f}×",
                         rounds_range(*(r.get("round_ms", {}).get(p) for p in ("inductor", "fusepass"))),
                         str(r["fused"].get("rewrites", 0))])
    if not rows:
        return None
    return markdown(sorted(rows), ["problem", "batch per rank×in×out", "norm", "precision", "eager DDP ms",
                                   "Inductor DDP ms", "fusepass DDP ms", "vs eager", "vs Inductor",
                                   "vs Inductor, rounds", "fused chains"])


def rounds_range(numerator: Optional[list[float]], denominator: Optional[list[float]]) -> str:
    """The lowest and highest of the rounds' ratios (one provider's round medians over another's, round by
    round), or "-" where either has no rounds."""
    if not numerator or not denominator:
        return MISSING
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return f"{min(ratios):.2f}–{max(ratios):.2f}×"


def multi_gpu_sources(runs: list[tuple[Path, dict]]) -> str:
    rows = [[f"`{shown_path(path)}`", env["device"], str(env["world_size"]), env["torch"], env["triton"],
             env["date"], env.get("commit", "-")] for path, env in ((p, run["environment"]) for p, run in runs)]
    return markdown(rows, ["file", "GPU", "GPUs", "torch", "triton", "date", "commit"])


SHAPE_CHANGES_KEY = "shape_changes"
SHAPE_CHANGES_INTRO = (
    "`fusepass-bench --batch-sequence`: one loop over a sequence of batch sizes (a training step with an SGD step, "
    "or an eval forward under `no_grad`), each step's wall seconds with compilation and tuning included, each "
    "provider in a process of its own. Cold: empty Inductor, Triton and fusepass caches; warm: a second process "
    "over the caches a first one filled. \"compile+tune\" sums each step's time beyond its size's steady step "
    "time (the median of five more steps).")


def command_size(source: Source) -> str:
    """The N,K,F of the bench command's --size, or "default"."""
    command = source.env["command"]
    return command.split("--size ")[1].split()[0] if "--size " in command else "default"


def shape_changes_tables(sources: list[Source]) -> Optional[str]:
    parts = []
    for source in sources:
        for run in source.payload[SHAPE_CHANGES_KEY]:
            results, sequence = run["results"], run["sequence"]
            columns = [f"{r['provider']} ({r['caches']}) s" for r in results]
            rows = [[str(i + 1), str(batch), *(f"{r['steps'][i]:.2f}" for r in results)]
                    for i, batch in enumerate(sequence)]
            rows.append(["", "total", *(f"{sum(r['steps']):.2f}" for r in results)])
            rows.append(["", "compile+tune", *(f"{r['compile_and_tune']:.2f}" for r in results)])
            parts += [f"{run['problem']} at {command_size(source)}, {run['mode']}, "
                      f"{run['precision']} ({source.env['device']}, {source.env['date'][:10]}, "
                      f"`{shown_path(source.path)}`):", "", markdown(rows, ["step", "batch", *columns]), ""]
    return "\n".join(parts).rstrip() or None


BUCKET_KEY = "bucket_vs_exact"
BUCKET_INTRO = (
    f"The steady step (`{BUCKET_TOOL}`, do_bench's median, L2 flushed, compilation excluded) of fusepass's "
    "bucketed choices against choices tuned for each exact size. Static exact: `dynamic=False`, tuned at that "
    "size; symbolic exact: the batch marked dynamic, tuned at that size; bucketed: the graph a loop over the "
    "first two sizes leaves (the second compiles a symbolic batch, whose choice is its bucket's and then serves "
    "every size). \"bucketed / symbolic exact\" is the choice's cost alone; \"bucketed / static exact\" adds "
    "the cost of a symbolic batch, shown for Inductor too (static, and after the same loop). Train: forward and "
    "backward of the output's sum; eval: a forward under `no_grad`.")


def bucket_vs_exact_row(r: dict) -> list[str]:
    fusepass = [f"{r[name]:.3f}" for name in ("static_exact_ms", "symbolic_exact_ms", "bucketed_ms")]
    ratios = [f"{r['bucketed_ms'] / r[name]:.3f}" for name in ("symbolic_exact_ms", "static_exact_ms")]
    return [str(r["rows"]), *fusepass, *ratios, f"{r['inductor_static_ms']:.3f}", f"{r['inductor_symbolic_ms']:.3f}"]


def bucket_vs_exact_tables(sources: list[Source]) -> Optional[str]:
    parts = []
    for source in sources:
        for run in source.payload[BUCKET_KEY]:
            rows = [bucket_vs_exact_row(r) for r in run["rows"]]
            size = ",".join(map(str, run["size"])) if run["size"] else "default"
            parts += [f"{run['problem']} at {size}, {run['mode']}, {run['precision']}, symbolic graph traced at "
                      f"{run['traced_at']} rows ({source.env['device']}, {source.env['date'][:10]}, "
                      f"`{shown_path(source.path)}`):", "",
                      markdown(rows, ["rows", "static exact ms", "symbolic exact ms", "bucketed ms",
                                      "bucketed / symbolic exact", "bucketed / static exact", "Inductor static ms",
                                      "Inductor symbolic ms"]), ""]
    return "\n".join(parts).rstrip() or None


GEMM_KEY = "gemm_alone"
GEMM_INTRO = (
    f"`{GEMM_TOOL}`: y = x @ W^T alone, no epilogue, against cuBLAS, for M×K→N at the seed chains' shapes and "
    "the MLP's three layers. bf16: both operands bf16, against cuBLAS bf16; bf16-autocast: x bf16 and W fp32, as a "
    "model under autocast holds it, against eager's cast of W and cuBLAS bf16 (fusepass: its native GEMM after the "
    "same cast, or `cast_w`, W's tiles cast in the kernel); tf32: fp32 operands rounded to "
    "TF32 on tensor cores (an operand rounded in memory, `round_w`/`round_x`, included where that variant is "
    "fastest), against cuBLAS with TF32 allowed; tf32x3: fp32-accurate 3xTF32 (an operand split in "
    "memory included where that variant is fastest), against cuBLAS's IEEE fp32, eager's fp32. fusepass's "
    "column is its fastest tile config (every candidate of the full search; a `tma` config serves only calls the "
    "op runs opaquely, as traced launches cannot carry host-made TMA descriptors; a `persistent` one makes "
    "its descriptors in the kernel and serves both; a `warp-specialized` one is the Gluon kernel the linear "
    "op runs behind an opaque custom op, W or x split (split_w, split_x; 3xTF32) or rounded (round_w, round_x; "
    "TF32), in the linear op's blocks or in the kernel, the preparation included). Each side is timed launched "
    "from Python, one call after another (where a call's host work outlasts its kernels, as the warp-specialized "
    "kernel's does at the MLP's last layer, that is host time), and, where the file records it, by GPU time. "
    "\"of peak\": fusepass's TFLOP/s over the data sheet's dense peak (bf16 989 with or without the cast, "
    "TF32 495, 3xTF32 a third of TF32's: 165). Issue 26's targets: bf16 ≥ 0.95× cuBLAS, TF32 ≥ 0.90×, "
    "3xTF32 ≥ 130 TFLOP/s.")


GEMM_GPU_TIME_NOTE = (
    "By GPU time (`tuning.gpu_time`: each call replayed from a CUDA graph, L2 flushed before it, the flush's own "
    "time taken off; the way the tuner times candidates and the way a step under CUDA graphs runs them), both "
    "sides from the same run, fusepass's fastest candidate by this measure:")
GEMM_HEADERS = ["M×K→N", "precision", "cuBLAS ms", "cuBLAS TFLOP/s", "fusepass ms", "fusepass TFLOP/s",
                "fusepass config", "vs cuBLAS", "of peak", "cuBLAS error", "fusepass error"]


def gemm_alone_rows(rows: list[dict], by: str) -> list[list[str]]:
    """The table's cells by one timing method: `by` is "" (launched from Python) or "gpu_"."""
    return [[f"{r['m']}×{r['k']}→{r['n']}", r["precision"], f"{r[f'cublas_{by}ms']:.3f}",
             f"{r[f'cublas_{by}tflops']:.0f}", f"{r[f'fusepass_{by}ms']:.3f}", f"{r[f'fusepass_{by}tflops']:.0f}",
             r[f"fusepass_{by}config"], f"{r[f'{by}vs_cublas']:.2f}×", f"{r[f'{by}of_peak']:.0%}",
             f"{r['cublas_rel_err']:.1e}", f"{r[f'fusepass_{by}rel_err']:.1e}"] for r in rows]


def gemm_alone_table(sources: list[Source]) -> Optional[str]:
    parts = []
    for source in sources:
        rows = source.payload[GEMM_KEY]
        parts += [f"{source.env['device']}, torch {source.env['torch']}, triton {source.env['triton']}, "
                  f"{source.env['date'][:10]} (`{shown_path(source.path)}`), launched from Python (do_bench):", "",
                  markdown(gemm_alone_rows(rows, ""), GEMM_HEADERS), ""]
        if all("fusepass_gpu_ms" in r for r in rows):
            parts += [GEMM_GPU_TIME_NOTE, "", markdown(gemm_alone_rows(rows, "gpu_"), GEMM_HEADERS), ""]
    return "\n".join(parts).rstrip() or None


LARGEST_BATCH_KEY = "largest_batch"
LARGEST_BATCH_INTRO = (
    "`fusepass-bench --largest-batch`: the largest batch whose training step (forward, backward, an SGD step) "
    "fits in the GPU's memory, each provider in a process of its own: the batch doubles from the problem's own "
    "until a step runs out of memory, then is bisected to within 1/32. \"vs Inductor\" is fusepass's largest "
    "batch over Inductor's.")


def largest_batch_table(sources: list[Source]) -> Optional[str]:
    rows = []
    for source in sources:
        for run in source.payload[LARGEST_BATCH_KEY]:
            found = {r["provider"]: r for r in run["results"]}
            cells = [f"{found[p]['largest_batch']}" + (" (limit)" if found[p]["limit_reached"] else "")
                     if p in found else "-" for p in ("eager", "inductor", "fusepass")]
            ratio = (f"{found['fusepass']['largest_batch'] / found['inductor']['largest_batch']:.2f}×"
                     if {"fusepass", "inductor"} <= found.keys() and found["inductor"]["largest_batch"] else "-")
            rows.append([run["problem"], command_size(source), run["precision"], *cells, ratio, source.env["device"],
                         f"`{shown_path(source.path)}`"])
    return markdown(rows, ["problem", "size", "precision", "eager", "Inductor", "fusepass", "vs Inductor", "GPU",
                           "file"]) if rows else None


FORWARD_GEMM_NOTE = {"fp32": " On Hopper the chain's forward GEMM on the warp-specialized kernel (launched from "
                             "Python) is offered without CUDA graphs for GEMMs of at least "
                             "`choice.TF32X3_MIN_FLOP` (3e10 FLOP), and at any size for a matmul head, whose "
                             "(in, out) W the Triton GEMM would copy.",
                     "tf32": " On Hopper the chain's forward GEMM on the warp-specialized kernel (launched from "
                             "Python) is offered without CUDA graphs for GEMMs of at least "
                             "`choice.UNGRAPHED_MIN_FLOP` (2.5e11 FLOP), with a backward or without."}


def render(sources: list[Source], kept: str, multi_gpu: list[tuple[Path, dict]],
           shape_changes: Optional[list[Source]] = None, largest_batch: Optional[list[Source]] = None,
           bucket_vs_exact: Optional[list[Source]] = None, gemm_alone: Optional[list[Source]] = None) -> str:
    rows = newest_rows(sources)
    sources = shown_sources(sources, rows)
    parts = ["# Benchmarks", "", "fusepass's current performance, generated by `tools/benchmark_report.py` from the "
             "fusepass-bench JSON in `benchmarks/`; edit only the section \"Tried and rejected\" by hand.", "",
             regenerate_block(), "", environments_line(sources) if sources else "No measurements yet.", "",
             METHOD, "", floor_text(), ""]
    for precision, title in (("fp32", "fp32"), ("tf32", "tf32"), ("bf16-autocast", "bf16 autocast")):
        parts += section(f"Forward, {title}", f"Forward of the model, `--precision {precision}`, train and eval "
                         "modes." + FORWARD_GEMM_NOTE.get(precision, ""), forward_table(rows, precision))
    parts += section("Training step", "Forward + backward in train mode (`--backward`), in Inductor's default mode "
                     "and with CUDA graphs (`mode=\"reduce-overhead\"`; each call a new step, as a training loop "
                     "runs it); the floor counts three GEMMs per linear (forward, dX, dW) at fusepass's precision, "
                     "and \"of floor\" is against fusepass's default mode. In fp32 and TF32 on Hopper, fusepass's "
                     "mode decides candidates: a GEMM on the warp-specialized kernel (launched from Python) is "
                     "offered with CUDA graphs; without them, in 3xTF32 to the backward's GEMMs from "
                     "`warp_specialized_gemm.UNHIDDEN_MIN_FLOP` (4e9; preparing an operand in memory only from "
                     "`choice.UNGRAPHED_MIN_FLOP`, 2.5e11 FLOP, else in the kernel) and to a chain's forward from "
                     "`choice.TF32X3_MIN_FLOP` (3e10), in TF32 from `choice.UNGRAPHED_MIN_FLOP`, and to matmul "
                     "heads. A linear GEMM whose output tiles leave SMs idle (the MLP's last layer and its weight "
                     "gradient) is also offered it with K split across programs.",
                     training_table(rows))
    parts += section("GEMM alone", GEMM_INTRO, gemm_alone_table(gemm_alone or []))
    parts += section("Small shapes, 128×1024→512", "Both problems at `--size 128,1024,512`, forwards and training "
                     "steps. Their floor is a few microseconds: these times are launch and host overhead.",
                     small_table(rows))
    graphs = cuda_graph_table(rows)
    if graphs:
        parts += ["With CUDA graphs (`mode=\"reduce-overhead\"`), from the same runs:", "", graphs, ""]
    parts += section("Compile time", "The first call of each provider, compilation included (the bench's "
                     "`compile_s`), from the forward runs; \"vs X\" is X's seconds over fusepass's. Caches:\n\n"
                     + "\n".join(caches_notes(sources)), compile_table(rows))
    parts += section("Peak memory", "Each call's own peak: `torch.cuda.max_memory_allocated` over one call "
                     "less what was allocated just before it, every model's gradients dropped first (so a "
                     "training step's includes the gradients it makes, its saved activations and its "
                     "transients, and none of the models and copies the bench process holds). Issue 27's "
                     "target: a training step's at most 0.9× Inductor's and at most eager's. Rows come from the "
                     "forward and training-step runs that recorded it. What a single chain's step holds bounds "
                     "it: the output (the call returns it), its gradient (held through the whole compiled "
                     "backward), the gradient at the linear output that the weight gradient's GEMM reads, and "
                     "the weight gradient; at 1024 rows of 8192 features in and out, in fp32, 32 + 32 + 32 + 256 "
                     "= 352 MB, Inductor's own peak there. Made a block of features at a time, the gradient at "
                     "the linear output would leave 320 MB and a block, 0.91× Inductor's: 0.9× is out of reach "
                     "at that shape (docs/design.md, \"The backward\").", memory_table(rows))
    parts += section("Largest batch that trains", LARGEST_BATCH_INTRO, largest_batch_table(largest_batch or []))
    parts += section("Shape changes", SHAPE_CHANGES_INTRO, shape_changes_tables(shape_changes or []))
    steady = bucket_vs_exact_tables(bucket_vs_exact or [])
    if steady:
        parts += [BUCKET_INTRO, "", steady, ""]
    parts += section("Several GPUs", MULTI_GPU_INTRO, multi_gpu_table(multi_gpu))
    parts += ["## Sources", "", sources_table(sources), ""]
    if multi_gpu:
        parts += ["Several GPUs:", "", multi_gpu_sources(multi_gpu), ""]
    return "\n".join(parts) + "\n" + kept


def shown_sources(sources: list[Source], rows: list[Row]) -> list[Source]:
    """The files some shown row comes from; the others are named on stderr, to be deleted."""
    used = {id(row.source) for row in rows}
    for source in sources:
        if id(source) not in used:
            print(f"{source.path}: every row superseded by a newer file; not shown (delete it)", file=sys.stderr)
    return [source for source in sources if id(source) in used]


def kept_section(report: Path) -> str:
    """The hand-written part of the report: from KEPT_HEADING to the end, verbatim."""
    text = report.read_text() if report.exists() else ""
    start = text.find(f"\n{KEPT_HEADING}\n")
    if start < 0:
        return f"{KEPT_HEADING}\n\nNothing recorded yet.\n"
    return text[start + 1:]


def write(json_dir: Path, output: Path) -> None:
    text = render(load_sources(json_dir), kept_section(output), load_multi_gpu(json_dir), load_shape_changes(json_dir),
                  load_largest_batch(json_dir), load_bucket_vs_exact(json_dir), load_gemm_alone(json_dir))
    output.write_text(text)
    print(f"wrote {shown_path(output)}")


# --------------------------------------------------------------------------- command line


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    sections = "; ".join(f"{name} (~{sum(s.estimate_s for s in SPECS if s.section == name) / 60:.1f} min)"
                         for name in SECTIONS)
    parser = argparse.ArgumentParser(prog=THIS, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"sections, with estimated H200 wall times: {sections}")
    parser.add_argument("step", nargs="?", choices=("all", "run", "write"), default="all")
    parser.add_argument("--only", nargs="+", metavar="SECTION", help="run these sections (or specs) only")
    parser.add_argument("--out", type=Path, default=JSON_DIR, help="where run writes its JSON (default benchmarks/)")
    parser.add_argument("--dry-run", action="store_true", help="print the fusepass-bench commands, run nothing")
    parser.add_argument("--json-dir", type=Path, default=JSON_DIR, help="where write reads JSON (default benchmarks/)")
    parser.add_argument("--output", type=Path, default=REPORT, help="the report (default BENCHMARKS.md)")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.step in ("all", "run"):
        run(args.only, args.out, args.dry_run)
    if args.step in ("all", "write") and not args.dry_run:
        write(args.json_dir, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
