"""Compile time of one problem under Inductor and fusepass, and what the compile caches did (Inductor's
FX-graph cache, AOTAutograd's cache: hits, misses, bypasses). Run it twice in fresh processes: the
second run shows the "once tuned" compile, with the caches that the first filled. GPU only.

    python tools/compile_cache.py demos/problems/gemm_scale_batchnorm.py --size 1024,8192,8192 --mode train \
        --precision bf16-autocast
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch._dynamo.utils import counters

from fusepass.bench import add_problem_arguments
from fusepass.providers import make_provider, model_and_inputs, provider_call

CACHE_COUNTERS = ("inductor", "aot_autograd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_problem_arguments(parser, ["inductor", "fusepass"])
    parser.add_argument("--profile", type=int, metavar="N", default=0,
                        help="print the N costliest functions (cumulative) of each provider's first call")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")

    # Pays the process's one-time costs (imports, CUDA context, Triton's driver) before any timing, so
    # that the first provider timed is not charged for them.
    torch.compile(lambda t: (t * 2).relu())(torch.ones(8, device="cuda"))
    base, inputs = model_and_inputs(args.problem, args.mode, "cuda", args.size)
    for provider in args.providers:
        torch._dynamo.reset()
        for group in CACHE_COUNTERS:  # only these: fusepass's backend keeps a reference to counters["fusepass"]
            counters[group].clear()
        call = provider_call(make_provider(provider, base), inputs, mode=args.mode, precision=args.precision,
                             device="cuda", backward=args.backward)
        torch.cuda.synchronize()
        profiler = cProfile.Profile() if args.profile else None
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        call()
        torch.cuda.synchronize()
        if profiler:
            profiler.disable()
        caches = {f"{group}.{key}": value for group in CACHE_COUNTERS for key, value in counters[group].items()
                  if "cache" in key or "bypass" in key}
        print(f"{provider}: first call {time.perf_counter() - start:.2f} s; {caches}")
        if profiler:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.profile)
            print(text.getvalue())


if __name__ == "__main__":
    main()
