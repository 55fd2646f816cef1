"""Every reference problem in demos/problems/ through eager, Inductor and fusepass, train and eval, and
the 1024 x 8192 -> 8192 case of gemm_scale_batchnorm (the same file at --size 1024,8192,8192).

    python demos/compare.py [extra fusepass-bench options, e.g. --precision fp32 bf16-autocast]

Prints fusepass-bench's tables: correctness against a float64 copy of each model, then timings.
Without a GPU every size is divided by 32 (--shrink 32) so that the run stays short, and it says so.
"""

import sys
from pathlib import Path

import torch

from fusepass import bench

PROBLEM_DIR = Path(__file__).parent / "problems"
PROBLEMS = sorted(str(p) for p in PROBLEM_DIR.glob("*.py"))
# (problem files, extra bench arguments) per fusepass-bench run
RUNS = [(PROBLEMS, []), ([str(PROBLEM_DIR / "gemm_scale_batchnorm.py")], ["--size", "1024,8192,8192"])]
CPU_ARGS = ["--device", "cpu", "--shrink", "32", "--seeds", "2", "--rep", "100"]


def main() -> int:
    extra = ["--mode", "train", "eval", *sys.argv[1:]]
    if not torch.cuda.is_available() and "--shrink" not in extra:
        print("No GPU: running on CPU with every problem size divided by 32 (--shrink 32).\n")
        extra += CPU_ARGS
    statuses = [bench.main([*problems, *sizes, *extra]) for problems, sizes in RUNS]
    return max(statuses)


if __name__ == "__main__":
    sys.exit(main())
