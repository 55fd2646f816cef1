"""The KernelBench-format reference problems (copies in demos/problems/), train and eval, judged
against float64: shrunk on CPU, at full size on a GPU."""

import filecmp
import importlib.util
from pathlib import Path

import pytest
import torch

from tests.chains import Trio, fusepass_stats, requires_cuda

PROBLEMS_DIR = Path(__file__).parent.parent / "demos" / "problems"
SHARED_PROBLEMS_DIR = Path(__file__).parent.parent.parent / "shared" / "problems"
LINEAR_SCALE_BN_PROBLEMS = ["gemm_scale_batchnorm", "gemm_scale_batchnorm_1024"]


def load_problem(name):
    spec = importlib.util.spec_from_file_location(f"problem_{name}", PROBLEMS_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_problem(name, device, *, shrink_to=None, steps=2):
    problem = load_problem(name)
    init = problem.get_init_inputs()
    batch = problem.get_inputs()[0].shape[0]
    if shrink_to is not None:  # (batch, in, out): the same model at a CPU-friendly size
        batch, in_features, out_features = shrink_to
        init = [in_features, out_features, (out_features,), *init[3:]]
    torch.manual_seed(0)
    trio = Trio.of(problem.Model(*init).to(device))
    in_features = init[0]
    for training in (True, False):
        trio.train(training)
        for _ in range(steps if training else 1):
            # The problems draw inputs with torch.rand: non-negative, so the linear output has a large mean.
            trio.step(torch.rand(batch, in_features, device=device))
    assert fusepass_stats() == {"graphs": 2, "rewrites": 2}


@pytest.mark.parametrize("name", LINEAR_SCALE_BN_PROBLEMS)
def test_problem_shrunk_on_cpu(name):
    check_problem(name, "cpu", shrink_to=(64, 96, 40))


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("name", LINEAR_SCALE_BN_PROBLEMS)
def test_problem_full_size_on_cuda(name):
    check_problem(name, "cuda")


@pytest.mark.skipif(not SHARED_PROBLEMS_DIR.is_dir(), reason="no ../shared/problems beside this checkout")
def test_demo_copies_match_shared_problems():
    for path in PROBLEMS_DIR.glob("*.py"):
        assert filecmp.cmp(path, SHARED_PROBLEMS_DIR / path.name, shallow=False), path.name
