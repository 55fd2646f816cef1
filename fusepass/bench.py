"""fusepass-bench, the command line of measure.py: is fusepass correct on a KernelBench-format problem,
and how much faster is it? Tables, JSON and a plot of measure.run's results; and three more modes, the
shape-changes loop (shape_changes.py), the largest batch that trains (largest_batch.py) and --tune-only
(fusepass.warmup).

    python -m fusepass.bench PROBLEM.py [PROBLEM.py ...] [options]      (or: fusepass-bench ...)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from tabulate import tabulate

from fusepass import largest_batch, shape_changes
from fusepass.lowering.tuning import TUNER
from fusepass.measure import Config, Result, environment, run
from fusepass.problems import MIN_SHRUNK, ProblemSizeError, Size, check_size
from fusepass.providers import PRECISIONS, PROVIDERS, BenchError, build_model, load, precision_context, problem_inputs
from fusepass.warmup import warmup


def format_table(results: list[Result], problem: str, backward: bool) -> str:
    headers = ["mode", "precision", "provider", "verdict", "max abs err", "rel err", "allclose"]
    headers += ["grad rel err", "grad allclose"] if backward else []
    headers += ["stats = eager", "median ms", "p20-p80 ms", "compile s", "peak MB", "own MB", "vs eager", "vs inductor"]
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
                f"{r.compile_s:.1f}", _mb(r.peak_mb), _mb(r.own_peak_mb),
                _fmt_ratio(r.speedup_vs_eager), _fmt_ratio(r.speedup_vs_inductor)]
        rows.append(row)
    return tabulate(rows, headers=headers, disable_numparse=True, maxcolwidths=[None, None, None, 36])


def _mb(value: float) -> str:
    return f"{value:.0f}" if not math.isnan(value) else "-"


def _yes_no(value: Optional[bool]) -> str:
    return {None: "-", True: "yes", False: "NO"}[value]


def _fmt_ratio(value: Optional[float]) -> str:
    return f"{value:.2f}x" if value is not None else "-"


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
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing rounds per provider, interleaved across the providers (--rep shared among them)")
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
    parser.add_argument("--largest-batch", action="store_true",
                        help="the largest batch whose training step (with an SGD step) fits in memory, per "
                             "provider and precision, each provider in a process of its own")
    args = parser.parse_args(argv)
    if args.tune_only and not args.batch_sizes:
        raise BenchError("--tune-only needs --batch-sizes")
    if args.largest_batch and args.device != "cuda":
        raise BenchError("--largest-batch measures GPU memory: it needs --device cuda")
    # eager first: running statistics and the float64 criterion are judged against it
    args.providers = ["eager", *(p for p in args.providers if p != "eager")]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda, but no CUDA GPU is available (use --device cpu)")
    if args.shrink < 1:
        raise BenchError(f"--shrink must be at least 1, not {args.shrink}")
    if args.seeds < 1:
        raise BenchError(f"--seeds must be at least 1, not {args.seeds}")
    if args.rounds < 1:
        raise BenchError(f"--rounds must be at least 1, not {args.rounds}")
    cfg = Config(args.device, args.mode, args.precision, args.providers, args.backward, args.seeds,
                 list(args.size) if args.size else None, args.shrink, args.atol, args.rtol, args.warmup, args.rep,
                 args.rounds)
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
    if args.largest_batch:
        return run_largest_batch(paths, cfg, args.json, env)
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


def run_largest_batch(paths: list[str], cfg: Config, json_path: Optional[str], env: dict) -> int:
    """The largest-batch mode: every problem and precision, each provider in a process of its own."""
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}")
    runs = []
    for path in paths:
        for precision in cfg.precisions:
            results = largest_batch.compare(path, precision, cfg.providers, cfg.device, cfg.size, cfg.shrink)
            print(f"\n{Path(path).stem}, train, {precision}: the largest batch whose training step fits")
            print(largest_batch.format_table(results))
            runs.append({"problem": Path(path).stem, "precision": precision, "results": results})
    if json_path:
        Path(json_path).write_text(json.dumps({"environment": env, "largest_batch": runs}, indent=2))
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
