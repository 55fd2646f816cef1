"""Where a compiled model's time goes, per provider: host time per call (calls queued without
synchronizing, so this is CPU work alone), wall time per call, the CUDA kernels one call launches
(torch.profiler), and for compiled providers a cProfile of the host side and which launcher each Triton
kernel of the process has: Inductor's static launcher or Triton's Python one (fusepass's kernels reach
Inductor as user-defined kernels, whose launcher depends on where they compiled: options.py).

    python tools/profile_host.py demos/problems/gemm_scale_batchnorm.py --size 1024,8192,8192 --mode train \
        --precision bf16-autocast [--backward] [--providers eager inductor fusepass]
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import gc
import io
import logging
import pstats
import time

import torch
from torch._inductor.runtime.triton_heuristics import CachingAutotuner
from torch.profiler import ProfilerActivity, profile

from fusepass.bench import add_problem_arguments
from fusepass.providers import make_provider, model_and_inputs, provider_call


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(host µs, wall µs) per call over `calls` queued calls."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (queued - start) / calls * 1e6, (done - start) / calls * 1e6


def kernel_table(fn, calls: int) -> str:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90)


def host_profile(fn, calls: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(35)
    return text.getvalue()


def launchers() -> str:
    """The process's Triton kernels loaded by Inductor, by launcher."""
    static, triton = set(), set()
    for kernel in gc.get_objects():
        # type(), not isinstance(): isinstance() asks a dead weak proxy for its class, which raises
        if issubclass(type(kernel), CachingAutotuner) and kernel.launchers:
            name = kernel.inductor_meta.get("kernel_name", "?")
            (static if kernel.is_statically_launchable() else triton).add(name)
    return (f"Inductor's static launcher: {', '.join(sorted(static)) or '-'}\n"
            f"Triton's launcher: {', '.join(sorted(triton)) or '-'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_problem_arguments(parser, ["eager", "inductor", "fusepass"])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--verbose", action="store_true", help="log fusepass's tuning choices")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if args.verbose:
        logging.basicConfig()
        logging.getLogger("fusepass").setLevel(logging.INFO)

    base, inputs = model_and_inputs(args.problem, args.mode, "cuda", args.size)
    print(f"{args.problem} {args.mode} {args.precision} backward={args.backward} {torch.cuda.get_device_name()}")
    for provider in args.providers:
        call = provider_call(make_provider(provider, copy.deepcopy(base)), inputs, mode=args.mode,
                             precision=args.precision, device="cuda", backward=args.backward)
        for _ in range(5):
            call()
        host, wall = per_call_us(call, args.calls)
        print(f"\n=== {provider}: host {host:.1f} us/call, wall {wall:.1f} us/call")
        print(kernel_table(call, 10))
        if provider != "eager":
            print(host_profile(call, args.calls))
            print(launchers())


if __name__ == "__main__":
    main()
