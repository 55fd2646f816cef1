"""fusepass under several backend options against eager and Inductor, in one process: each provider's
training step (forward + backward, do_bench median and p20-p80, L2 flushed) and its own peak memory
(fusepass.measure.peak_memory_mb). GPU only.

    python tools/options_ab.py demos/problems/mlp_batchnorm.py [--size N,K,F] [--precision fp32] \
        --options '{"operand_copies": true}' '{"operand_copies": false}'
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from fusepass.bench import parse_size
from fusepass.measure import peak_memory_mb
from fusepass.providers import model_and_inputs, provider_call


def step_figures(fn, model: torch.nn.Module, inputs: list, precision: str) -> str:
    call = provider_call(fn, inputs, mode="train", precision=precision, device="cuda", backward=True)
    params = list(model.parameters())
    times = sorted(triton.testing.do_bench(call, warmup=100, rep=500, grad_to_none=params, return_mode="all"))
    _, own_mb = peak_memory_mb(call, "cuda", params)
    p20, median, p80 = (times[min(len(times) - 1, int(q * len(times)))] for q in (0.2, 0.5, 0.8))
    return f"{median:.3f} ms [{p20:.3f}-{p80:.3f}], {own_mb:.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("problems", nargs="+")
    parser.add_argument("--size", type=parse_size, metavar="N,K,F")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16-autocast"])
    parser.add_argument("--options", nargs="+", required=True, help="one JSON object of backend options each")
    args = parser.parse_args()
    for path in args.problems:
        model, inputs = model_and_inputs(path, "train", "cuda", args.size)
        providers = {"eager": model, "inductor": torch.compile(model)}
        providers.update({f"fusepass {text}": torch.compile(model, backend="fusepass", options=json.loads(text))
                          for text in args.options})
        print(path, args.size or "", args.precision, flush=True)
        for name, fn in providers.items():
            print(f"    {name}: {step_figures(fn, model, inputs, args.precision)}", flush=True)
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
