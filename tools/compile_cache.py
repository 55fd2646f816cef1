"""Compile time of one problem under Inductor and fusepass, and what the compile caches did (Inductor's
FX-graph cache, AOTAutograd's cache: hits, misses, bypasses). Run it twice in fresh processes: the
second run shows the "once tuned" compile, with the caches that the first filled. GPU only.

    python tools/compile_cache.py demos/problems/gemm_scale_batchnorm_1024.py --mode train \
        --precision bf16-autocast
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._dynamo.utils import counters

from fusepass.bench import load, make_provider, precision_context, to_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("problem")
    parser.add_argument("--mode", choices=("train", "eval"), default="train")
    parser.add_argument("--precision", default="bf16-autocast")
    parser.add_argument("--providers", nargs="+", default=["inductor", "fusepass"])
    args = parser.parse_args()

    # Pays the process's one-time costs (imports, CUDA context, Triton's driver) before any timing, so
    # that the first provider timed is not charged for them.
    torch.compile(lambda t: (t * 2).relu())(torch.ones(8, device="cuda"))
    module = load(args.problem, 1)
    torch.manual_seed(0)
    base = module.Model(*module.get_init_inputs()).cuda().train(args.mode == "train")
    inputs = to_device(module.get_inputs(), "cuda")
    for provider in args.providers:
        torch._dynamo.reset()
        counters.clear()
        model = make_provider(provider, base)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with precision_context(args.precision, "cuda"), torch.set_grad_enabled(args.mode == "train"):
            model(*inputs)
        torch.cuda.synchronize()
        caches = {f"{group}.{key}": value for group in ("inductor", "aot_autograd") for key, value in counters[group].items()
                  if "cache" in key or "bypass" in key}
        print(f"{provider}: first call {time.perf_counter() - start:.2f} s; {caches}")


if __name__ == "__main__":
    main()
