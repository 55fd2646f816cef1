"""What fusepass does to a graph: the explain() report, then the debug dump of the rewritten graph.

    python demos/explain_and_dump.py [--problem gemm_batchnorm_scale_softmax]
"""

import argparse
import tempfile
from pathlib import Path

import torch

import fusepass
from fusepass.problems import load_problem, problem_size

PROBLEMS = Path(__file__).parent / "problems"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", default="gemm_batchnorm_scale_softmax")
    args = parser.parse_args()
    problem = load_problem(PROBLEMS / f"{args.problem}.py", (64, 128, 96))  # matching does not depend on size
    batch, in_features, _ = problem_size(problem)
    model, x = problem.Model(*problem.get_init_inputs()), torch.rand(batch, in_features)

    print("fusepass.explain(model, x):\n")
    print(fusepass.explain(model, x))

    with tempfile.TemporaryDirectory() as debug_dir:
        torch.compile(model, backend="fusepass", options={"debug_dir": debug_dir})(x)
        order = {"before": 0, "after": 1, "report": 2}
        for path in sorted(Path(debug_dir).iterdir(), key=lambda p: order[p.stem.rsplit("_", 1)[-1]]):
            print(f"\n===== {path.name} =====")
            print(path.read_text())


if __name__ == "__main__":
    main()
