"""The KernelBench-format reference problems (copies in demos/problems/), train and eval, judged
against float64: shrunk on CPU, at full size on a GPU."""

import filecmp
from pathlib import Path

import pytest
import torch

import fusepass
from fusepass.problems import load_problem, problem_sizes
from tests.chains import Trio, fusepass_stats, requires_cuda

PROBLEMS_DIR = Path(__file__).parent.parent / "demos" / "problems"
SHARED_PROBLEMS_DIR = Path(__file__).parent.parent.parent / "shared" / "problems"
# Each reference problem and the one rewrite explain() must report for it.
PROBLEMS = {
    "gemm_scale_batchnorm": "linear_scale_batch_norm",
    "gemm_scale_batchnorm_1024": "linear_scale_batch_norm",
    "gemm_batchnorm_scale_softmax": "linear_batch_norm_scale_softmax",
}
CPU_SIZE = (64, 96, 40)  # batch, in_features, out_features


def problem_setup(name, shrink_to=None):
    problem = load_problem(PROBLEMS_DIR / f"{name}.py")
    return (problem, *problem_sizes(problem, shrink_to))


def check_problem(name, device, *, shrink_to=None, steps=8):
    problem, init, batch = problem_setup(name, shrink_to)
    torch.manual_seed(0)
    trio = Trio.of(problem.Model(*init).to(device))
    for training in (True, False):
        trio.train(training)
        for _ in range(steps if training else 1):
            # The problems draw inputs with torch.rand: non-negative, so the linear output has a large mean.
            trio.step(torch.rand(batch, init[0], device=device))
    trio.finish()
    assert fusepass_stats() == {"graphs": 2, "rewrites": 2}


@pytest.mark.parametrize("name", PROBLEMS)
def test_problem_shrunk_on_cpu(name):
    check_problem(name, "cpu", shrink_to=CPU_SIZE)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("name", PROBLEMS)
def test_problem_full_size_on_cuda(name):
    check_problem(name, "cuda")
    check_explain(name, "cuda")


def check_explain(name, device, shrink_to=None):
    problem, init, batch = problem_setup(name, shrink_to)
    report = fusepass.explain(problem.Model(*init).to(device), torch.rand(batch, init[0], device=device))
    assert [m["pattern"] for m in report.matches] == [PROBLEMS[name]] and report.misses == []


@pytest.mark.parametrize("name", PROBLEMS)
def test_explain_reports_one_rewrite_per_problem(name):
    check_explain(name, "cpu", CPU_SIZE)


@pytest.mark.skipif(not SHARED_PROBLEMS_DIR.is_dir(), reason="no ../shared/problems beside this checkout")
def test_demo_copies_match_shared_problems():
    for path in PROBLEMS_DIR.glob("*.py"):
        assert filecmp.cmp(path, SHARED_PROBLEMS_DIR / path.name, shallow=False), path.name
