"""Data-parallel training with fused chains: DistributedDataParallel, plain BatchNorm1d chains and
SyncBatchNorm chains (the user's own convert_sync_batchnorm), eager DDP / Inductor DDP / fusepass DDP.

    torchrun --nproc-per-node 2 demos/ddp_train.py [--problems demos/problems/gemm_scale_batchnorm.py ...]
        [--precision fp32 bf16-autocast] [--steps 20] [--rounds 3] [--json results.json] [--profile [PROVIDER ...]]

Each rank trains on its own batch of the problem's batch size over the world size (the reference batch
split across the GPUs). Every provider's model is compiled and warmed up (--warmup steps: forward,
backward, SGD step), then the providers are timed in --rounds interleaved rounds of --steps steps each, so
that a drift of the machine during the case falls on all of them alike (compiled DDP steps are host-bound,
and a process's host speed moves). Every rank prints what fusepass fused; rank 0 prints each provider's
median step time over its rounds, with each round's median beside it, and all of them in a table at the
end. Steps are timed with CUDA events over a fixed number of steps (all ranks must run the same steps:
their collectives pair up, so do_bench's own choice of repetitions cannot be used). --profile: after
timing, rank 0 also prints the named providers' (every provider's if none is named) host time per step
(the steps queued without synchronizing), every rank's host, wall and CUDA kernel times (NCCL's apart: a
rank that waits for another shows it there), the CUDA kernels of --steps steps (torch.profiler; with
--trace DIR, every rank also writes their Chrome trace there) and the Python functions taking the host's
time (cProfile); every rank runs the profiled steps, so that the collectives pair up. On a machine without
GPUs it runs on CPU with gloo, shrunk (--shrink), plain batch norm only: DDP refuses SyncBatchNorm on CPU.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import logging
import os
import pstats
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from tabulate import tabulate
from torch._dynamo.utils import counters
from torch.autograd import DeviceType
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from fusepass.measure import source_commit
from fusepass.providers import build_model, precision_context, problem_inputs, start_compile_workers
from fusepass.problems import load_problem, problem_size, shrunk_size

PROBLEMS = Path(__file__).parent / "problems"
REFERENCE = [str(PROBLEMS / f"{name}.py") for name in
             ("gemm_scale_batchnorm", "gemm_batchnorm_scale_softmax", "mlp_batchnorm")]
PROVIDERS = ("eager", "inductor", "fusepass")
warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores", category=UserWarning)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", nargs="+", default=REFERENCE)
    parser.add_argument("--norms", nargs="+", default=["batch_norm", "sync_batch_norm"],
                        choices=["batch_norm", "sync_batch_norm"])
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16-autocast"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds per provider, interleaved across the providers")
    parser.add_argument("--shrink", type=int, default=16, help="on CPU: divide the problem's sizes by this")
    parser.add_argument("--json", help="rank 0 writes the results here")
    parser.add_argument("--profile", nargs="*", choices=PROVIDERS,
                        help="rank 0 prints host time and kernels of these providers (every one if none is named)")
    parser.add_argument("--verbose", action="store_true", help="every rank logs fusepass's tuning choices")
    parser.add_argument("--trace", help="with --profile: every rank writes the profiled steps' Chrome trace into "
                                        "this folder, one file per case, provider and rank")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.verbose:
        logging.basicConfig(format=f"rank {os.environ.get('RANK', 0)}: %(message)s")
        logging.getLogger("fusepass").setLevel(logging.INFO)
    cuda = torch.cuda.is_available()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    norms = args.norms if cuda else ["batch_norm"]
    results = []
    for path in args.problems:
        for norm in norms:
            for precision in args.precision:
                results.append(run_case(path, norm, precision, args, device, rank, world))
    if rank == 0:
        print_table(results, world)
        if args.json:
            Path(args.json).write_text(json.dumps({"environment": environment(world), "results": results}, indent=2))
    dist.destroy_process_group()


def run_case(path: str, norm: str, precision: str, args, device: torch.device, rank: int, world: int) -> dict:
    size = problem_size(load_problem(path))
    if device.type == "cpu":
        size = shrunk_size(size, args.shrink)
    size = (max(2, size[0] // world), *size[1:])  # the reference batch, split across the ranks
    problem = load_problem(path, size)
    base = build_model(problem, "train", str(device))
    if norm == "sync_batch_norm":
        base = nn.SyncBatchNorm.convert_sync_batchnorm(base)
    inputs = problem_inputs(problem, str(device), seed=rank)  # each rank its own batch
    case = {"problem": Path(path).stem, "size": list(size), "norm": norm, "precision": precision, "ms": {},
            "round_ms": {}}
    steps = {}
    for provider in PROVIDERS:  # each compiled and warmed up, then all timed in interleaved rounds
        counters["fusepass"].clear()
        steps[provider] = training_step(provider, copy.deepcopy(base), inputs, precision, device)
        for _ in range(max(1, args.warmup)):  # at least the step that compiles, before fusepass's counts
            steps[provider]()
        if provider == "fusepass":
            fused = {key: counters["fusepass"][key] for key in ("graphs", "rewrites", "linears", "fallbacks")}
            case["fused"] = fused
            print(f"rank {rank}: {case['problem']} {norm} {precision}: fusepass {fused}", flush=True)
    for provider, rounds in timed_rounds(steps, args.rounds, args.steps, device).items():
        case["ms"][provider] = statistics.median(ms for round_times in rounds for ms in round_times)
        case["round_ms"][provider] = [statistics.median(round_times) for round_times in rounds]
        if rank == 0:
            medians = ", ".join(f"{ms:.3f}" for ms in case["round_ms"][provider])
            print(f"{case['problem']} {norm} {precision} {provider}: {case['ms'][provider]:.3f} ms a step "
                  f"(rounds' medians {medians})", flush=True)
    for provider in PROVIDERS:
        if args.profile is not None and provider in (args.profile or PROVIDERS):
            trace = None
            if args.trace:
                trace = Path(args.trace) / f"{case['problem']}_{norm}_{precision}_{provider}_rank{rank}.json"
            report = profile_steps(steps[provider], args.steps, device, trace)
            if rank == 0:
                print(f"\n== {case['problem']} {norm} {precision} {provider} ==\n{report}", flush=True)
    return case


def training_step(provider: str, model: nn.Module, inputs: list, precision: str, device: torch.device):
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    backend = "inductor" if provider == "inductor" else "fusepass"
    start_compile_workers()
    fn = ddp if provider == "eager" else torch.compile(ddp, backend=backend)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    def step() -> None:
        with precision_context(precision, device.type):
            out = fn(*inputs)
        out.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def timed_rounds(steps: dict, rounds: int, per_round: int, device: torch.device) -> dict[str, list[list[float]]]:
    """Each provider's step times, round by round: the providers take turns within each round."""
    times = {provider: [] for provider in steps}
    for _ in range(rounds):
        for provider, step in steps.items():
            step()  # untimed: the previous provider's step left the caches to it
            times[provider].append(timed(step, per_round, device))
    return times


def timed(step, steps: int, device: torch.device) -> list[float]:
    """Per-step milliseconds of `steps` steps (CUDA events on a GPU)."""
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            step()
            times.append((time.perf_counter() - begin) * 1e3)
    return times


def profile_steps(step, steps: int, device: torch.device, trace: Path | None = None) -> str:
    """Host milliseconds per step (queued without synchronizing: the CPU's own work, and any wait the
    step forces on it), every rank's host, wall and kernel times (a rank that waits on another shows it as
    NCCL kernel time), the CUDA kernels of `steps` steps, and a cProfile of `steps` more."""
    cuda = device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    synchronize()
    begin = time.perf_counter()
    for _ in range(steps):
        step()
    queued = time.perf_counter()
    synchronize()
    done = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        synchronize()
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=80)
    python = cProfile.Profile()
    python.enable()
    for _ in range(steps):
        step()
    synchronize()
    python.disable()
    host = io.StringIO()
    pstats.Stats(python, stream=host).sort_stats("tottime").print_stats(25)
    timing = f"host {(queued - begin) / steps * 1e3:.3f} ms/step, wall {(done - begin) / steps * 1e3:.3f} ms/step"
    kernels, nccl = kernel_ms(prof, steps)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, f"rank {dist.get_rank()}: {timing}, CUDA kernels {kernels:.3f} ms/step "
                                  f"(summed over streams), NCCL's {nccl:.3f}")
    return f"{timing} over {steps} steps\n" + "\n".join(ranks) + f"\n{table}\n{host.getvalue()}"


def kernel_ms(prof: profile, steps: int) -> tuple[float, float]:
    """Milliseconds per step of every CUDA kernel the profile saw, and of NCCL's, whose kernels run from
    a rank's launch until every rank has joined."""
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    total = sum(e.time_range.elapsed_us() for e in kernels)
    nccl = sum(e.time_range.elapsed_us() for e in kernels if e.name.startswith("nccl"))
    return total / 1e3 / steps, nccl / 1e3 / steps


def print_table(results: list[dict], world: int) -> None:
    rows = []
    for r in results:
        ms = r["ms"]
        rows.append([r["problem"], "×".join(map(str, r["size"])), r["norm"], r["precision"],
                     *(f"{ms[p]:.3f}" for p in PROVIDERS), f"{ms['eager'] / ms['fusepass']:.2f}×",
                     f"{ms['inductor'] / ms['fusepass']:.2f}×", r["fused"].get("rewrites", 0)])
    print(f"\ntraining step per rank, {world} ranks, median ms (forward, backward, SGD step):")
    print(tabulate(rows, headers=["problem", "batch per rank × in → out", "norm", "precision", "eager DDP",
                                  "Inductor DDP", "fusepass DDP", "vs eager", "vs Inductor", "fused chains"]))


def environment(world: int) -> dict:
    import triton
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "world_size": world, "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": source_commit()}


if __name__ == "__main__":
    main()
