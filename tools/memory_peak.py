"""What is live on the GPU at the peak of one compiled forward (or training step), per provider: the
peak above what was allocated before the call, and the allocations made during the call that are
still live at that peak, largest first, with the Python line that made each (for compiled graphs, a
line of Inductor's generated code). GPU only.

    python tools/memory_peak.py demos/problems/gemm_scale_batchnorm.py --size 1024,8192,8192 --mode eval \
        --precision bf16-autocast [--backward] [--providers eager inductor fusepass] [--timeline 8]
"""

from __future__ import annotations

import argparse
import copy
import linecache
import shutil
from typing import Iterator

import torch

from fusepass.bench import add_problem_arguments
from fusepass.providers import make_provider, model_and_inputs, provider_call


def replay(trace: list[dict]) -> Iterator[tuple[dict, bool, int, dict]]:
    """One device's allocator trace, allocation by allocation and free by free, in order: (the block's
    allocation event, whether this is its free, the net bytes allocated after it, the blocks live then)."""
    live, net = {}, 0
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            net += event["size"]
            yield event, False, net, live
        elif event["action"] == "free_completed" and event["addr"] in live:
            allocation = live.pop(event["addr"])
            net -= allocation["size"]
            yield allocation, True, net, live


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """(highest net bytes allocated, the blocks live then, largest first)."""
    peak, at_peak = 0, []
    for _, _, net, live in replay(trace):
        if net > peak:
            peak, at_peak = net, list(live.values())
    return peak, sorted(at_peak, key=lambda e: -e["size"])


def timeline(trace: list[dict], min_bytes: int) -> list[str]:
    """Every allocation and free of at least min_bytes, in order, with the net MB allocated after it (a
    free named by the line that allocated the block)."""
    return [f"{net / 2**20:8.0f} MB  {'-' if freed else '+'}{block['size'] / 2**20:6.1f}  {where(block)}"
            for block, freed, net, _ in replay(trace) if block["size"] >= min_bytes]


def user_frames(event: dict) -> list[dict]:
    return [f for f in event.get("frames", []) if f["filename"].endswith(".py")
            and "/torch/" not in f["filename"] and "/triton/" not in f["filename"]]


def where(event: dict) -> str:
    frames = user_frames(event)
    if not frames:
        return "?"
    first = frames[0]
    code = linecache.getline(first["filename"], first["line"]).strip()
    where = " <- ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames[:3])
    return where + f"\n{'':14}{code}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_problem_arguments(parser, ["eager", "inductor", "fusepass"])
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--dump", help="copy the generated code that made the largest blocks into this folder")
    parser.add_argument("--timeline", type=float, metavar="MB",
                        help="also print every allocation and free of at least this many MB, in order")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")

    base, inputs = model_and_inputs(args.problem, args.mode, "cuda", args.size)
    print(f"{args.problem} {args.mode} {args.precision} backward={args.backward} {torch.cuda.get_device_name()}")
    for provider in args.providers:
        model = make_provider(provider, copy.deepcopy(base))
        call = provider_call(model, inputs, mode=args.mode, precision=args.precision,
                             device="cuda", backward=args.backward)

        for _ in range(3):
            call()
        for param in model.parameters():  # as fusepass-bench measures a step: its gradients new
            param.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        out = call()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        traced_peak, blocks = live_at_peak(trace)
        print(f"\n=== {provider}: {before / 2**20:.0f} MB allocated before the call; peak +{peak_mb:.0f} MB "
              f"(trace: +{traced_peak / 2**20:.0f} MB); output {tuple(out.shape)} {out.dtype}")
        for event in blocks[:args.top]:
            print(f"  {event['size'] / 2**20:8.1f} MB  {where(event)}")
        if args.timeline is not None:
            print(f"--- {provider}: timeline, net MB after each event")
            print("\n".join(timeline(trace, int(args.timeline * 2**20))))
        if args.dump:
            for source in {user_frames(e)[0]["filename"] for e in blocks[:args.top] if user_frames(e)}:
                shutil.copy(source, f"{args.dump}/{provider}_{args.mode}_{source.rsplit('/', 1)[-1]}")
        del model, out


if __name__ == "__main__":
    main()
