"""The KernelBench-format reference problems (copies in demos/problems/), train and eval, judged
against float64 with non-trivial batch-norm parameters and scales: resized on CPU, at full size and at
1024 x 8192 -> 8192 on a GPU. And the one resizer, problems.resize_problem."""

from pathlib import Path

import pytest
import torch

import fusepass
from fusepass.problems import ProblemSizeError, load_problem, problem_size, resize_problem, shrunk_size, sized_name
from tests.chains import Trio, fusepass_stats, randomize_batch_norm, requires_cuda

PROBLEMS_DIR = Path(__file__).parent.parent / "demos" / "problems"
# Each reference problem, the size it runs at (None: the file's own), and the rewrite explain() must report.
CASES = {
    "gemm_scale_batchnorm": ("gemm_scale_batchnorm", None, "linear_scale_batch_norm"),
    "gemm_scale_batchnorm@1024x8192x8192": ("gemm_scale_batchnorm", (1024, 8192, 8192), "linear_scale_batch_norm"),
    "gemm_batchnorm_scale_softmax": ("gemm_batchnorm_scale_softmax", None, "linear_batch_norm_mul_softmax"),
    "gemm_batchnorm": ("gemm_batchnorm", None, "linear_batch_norm"),
    "gemm_batchnorm_swish": ("gemm_batchnorm_swish", None, "linear_batch_norm_add_div_sigmoid_mul"),
    "matmul_batchnorm_scale_softmax": ("matmul_batchnorm_scale_softmax", None, "matmul_batch_norm_mul_softmax"),
}
CPU_SIZE = (64, 96, 40)  # batch, in_features, out_features


def problem_model(case, device, size=None):
    """The case's problem module and its model with random batch-norm parameters and scale, on `device`."""
    name, case_size, _ = CASES[case]
    problem = load_problem(PROBLEMS_DIR / f"{name}.py", size or case_size)
    torch.manual_seed(0)
    model = problem.Model(*problem.get_init_inputs())
    randomize_batch_norm(model.bn)
    if hasattr(model, "scale"):
        with torch.no_grad():
            model.scale.copy_(torch.randn_like(model.scale) * 0.5 + 1.0)
    return problem, model.to(device)


def check_problem(case, device, *, size=None, steps=8):
    problem, model = problem_model(case, device, size)
    batch, in_features, _ = problem_size(problem)
    trio = Trio.of(model)
    for training in (True, False):
        trio.train(training)
        for _ in range(steps if training else 1):
            # The problems draw inputs with torch.rand: non-negative, so the linear output has a large mean.
            trio.step(torch.rand(batch, in_features, device=device))
    trio.finish()
    assert fusepass_stats() == {"graphs": 2, "rewrites": 2}


@pytest.mark.parametrize("case", CASES)
def test_problem_resized_on_cpu(case):
    check_problem(case, "cpu", size=CPU_SIZE)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("case", CASES)
def test_problem_full_size_on_cuda(case):
    check_problem(case, "cuda")
    check_explain(case, "cuda")


def check_explain(case, device, size=None):
    problem, model = problem_model(case, device, size)
    batch, in_features, _ = problem_size(problem)
    report = fusepass.explain(model, torch.rand(batch, in_features, device=device))
    assert [m["pattern"] for m in report.matches] == [CASES[case][2]] and report.misses == []


@pytest.mark.parametrize("case", CASES)
def test_explain_reports_one_rewrite_per_problem(case):
    check_explain(case, "cpu", CPU_SIZE)


def test_resize_follows_derived_sizes_when_in_equals_out():
    """gemm_scale_batchnorm is 16384 x 4096 -> 4096: its scale_shape (out_features,) must follow
    out_features, not in_features, which had the same value."""
    problem = load_problem(PROBLEMS_DIR / "gemm_scale_batchnorm.py")
    assert problem_size(problem) == (16384, 4096, 4096)
    resize_problem(problem, (24, 40, 56))
    assert problem_size(problem) == (24, 40, 56)
    assert problem.get_init_inputs() == [40, 56, (56,)]
    [x] = problem.get_inputs()
    assert x.shape == (24, 40)
    model = problem.Model(*problem.get_init_inputs())
    assert model.scale.shape == (56,) and model(x).shape == (24, 56)


def test_resize_keeps_values_that_are_not_sizes():
    problem = load_problem(PROBLEMS_DIR / "gemm_batchnorm_scale_softmax.py", (16, 24, 32))
    assert problem.get_init_inputs() == [24, 32, 1e-5, 0.1, (1,)]
    assert problem.get_inputs()[0].shape == (16, 24)


def test_resize_refuses_a_literal_size(tmp_path):
    path = tmp_path / "literal.py"
    path.write_text((PROBLEMS_DIR / "gemm_scale_batchnorm.py").read_text().replace(
        "scale_shape = (out_features,)", "scale_shape = (4096,)"))
    with pytest.raises(ProblemSizeError, match=r"scale_shape = \(4096,\) keeps the size 4096"):
        load_problem(path, (24, 40, 56))


def test_resize_needs_the_size_names(tmp_path):
    path = tmp_path / "unsized.py"
    path.write_text("import torch\nbatch_size = 8\ndef get_inputs():\n    return [torch.rand(batch_size, 4)]\n")
    with pytest.raises(ProblemSizeError, match="in_features, out_features"):
        load_problem(path, (4, 4, 4))


def test_shrunk_size_and_sized_name():
    assert shrunk_size((1024, 8192, 8192), 32) == (32, 256, 256)
    assert shrunk_size((128, 1024, 4), 64) == (8, 16, 4)  # not below 8, nor below the size itself
    assert shrunk_size((16384, 4096, 4096), 1) == (16384, 4096, 4096)
    assert sized_name("gemm_scale_batchnorm", (1024, 8192, 8192)) == "gemm_scale_batchnorm@1024x8192x8192"
