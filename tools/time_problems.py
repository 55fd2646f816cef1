"""Times eager, Inductor and fusepass on the reference problems (GPU).

Forward in training and eval mode, fp32 and bf16 autocast; triton.testing.do_bench medians (it
flushes L2 between runs). A development measurement until the benchmark CLI exists."""

import copy
from pathlib import Path

import torch
import triton
from tabulate import tabulate

from fusepass.problems import load_problem

PROBLEMS = Path(__file__).parent.parent / "demos" / "problems"


def main():
    rows = []
    for name in ("gemm_scale_batchnorm", "gemm_scale_batchnorm_1024", "gemm_batchnorm_scale_softmax"):
        problem = load_problem(PROBLEMS / f"{name}.py")
        torch.manual_seed(0)
        base = problem.Model(*problem.get_init_inputs()).cuda()
        x = problem.get_inputs()[0].cuda()
        providers = {"eager": copy.deepcopy(base)}
        providers["inductor"] = torch.compile(copy.deepcopy(base))
        providers["fusepass"] = torch.compile(copy.deepcopy(base), backend="fusepass")
        for mode in ("train", "eval"):
            for precision in ("fp32", "bf16-autocast"):
                times = {}
                for provider, fn in providers.items():
                    (fn._orig_mod if hasattr(fn, "_orig_mod") else fn).train(mode == "train")
                    def run():
                        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=precision != "fp32"):
                            return fn(x)
                    run()
                    times[provider] = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
                rows.append([name, mode, precision, *(f"{times[p]:.3f}" for p in providers),
                             f"{times['eager'] / times['fusepass']:.2f}", f"{times['inductor'] / times['fusepass']:.2f}"])
                print(rows[-1], flush=True)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print(tabulate(rows, headers=["problem", "mode", "precision", "eager ms", "inductor ms", "fusepass ms",
                                  "vs eager", "vs inductor"]))


if __name__ == "__main__":
    main()
