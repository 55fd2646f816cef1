"""Every reference problem in demos/problems/ through eager, Inductor and fusepass, train and eval.

    python demos/compare.py [extra fusepass-bench options, e.g. --precision fp32 bf16-autocast]

Prints fusepass-bench's table: correctness against a float64 copy of each model, then timings.
Without a GPU the problems are shrunk (every size / 32) so that the run stays short, and it says so.
"""

import sys
from pathlib import Path

import torch

from fusepass import bench

PROBLEMS = sorted(str(p) for p in (Path(__file__).parent / "problems").glob("*.py"))


def main() -> int:
    args = [*PROBLEMS, "--mode", "train", "eval", *sys.argv[1:]]
    if not torch.cuda.is_available() and "--shrink" not in args:
        print("No GPU: running on CPU with every problem size divided by 32 (--shrink 32).\n")
        args += ["--device", "cpu", "--shrink", "32", "--seeds", "2", "--rep", "100"]
    return bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
