"""Training code as people write it (tests/real_models.py), eager against fusepass against float64: three
training steps (ten for MoCo v3 on a GPU) and an eval forward, every loss, gradient, parameter and buffer
by the project's criterion, with the exact number of rewrites and no fallback."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import fusepass
from fusepass.numerics import rel_error
from fusepass.lowering import tuning
from fusepass.lowering.linear import LINEAR
from fusepass.lowering.op import CHAIN
from tests.chains import assert_fused, requires_cuda
from tests.real_models import CPU_SIZES, CUDA_SIZES, SYSTEMS, DinoHead, TrainingRun, Trajectory

# system -> (graphs, fused chains, bare linears), the same on CPU and CUDA:
# - dino: the multi-crop wrapper graph-breaks on unique_consecutive and on the loop over its counts; the
#   head sees 2 crops (teacher) and 4 (student), so its graph recompiles with a symbolic batch: 3 head
#   graphs (teacher, student, eval) of 2 chains and 2 linears.
# - moco_v3: one training graph, one eval graph; per graph 2 views x (projector 2 + predictor 1) chains and
#   the momentum encoder's 2 x 2, and 3 linears per view pair (backbone, momentum backbone, predictor's last).
# - barlow_twins: per graph 2 views x (2 projector chains + the shared batch norm's) and 2 backbone linears.
# - pointnet: training fuses fc1 -> bn1 -> relu (the dropout before bn2 is random: fc2 stays a bare linear);
#   eval fuses fc2 -> dropout -> bn2 -> relu too.
# DINO's head is weight-normed as DINO writes it, with the deprecated nn.utils.weight_norm.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")

COUNTS = {"dino": (13, 6, 6), "moco_v3": (2, 20, 12), "barlow_twins": (2, 12, 4), "pointnet": (2, 3, 3)}
# MoCo v3 trains 10 steps on a GPU, and there each gradient is judged on all its steps as one vector
# (TrainingRun's gradients_over_steps). Step by step, the criterion fails eager against itself: fed the
# same rows permuted (the same training in exact arithmetic), eager's per-step gradient errors went past
# 1.5x its own in 4 of 8 input draws on an H100 (predictor.1.weight's 3.2e-4 against 1.5e-4), over the
# steps in none (tools/equally_exact.py moco_v3). Every step some relu outputs differ in sign from
# float64's, and a flipped mask moves a gradient by the element's whole contribution, not a rounding: in
# a one-off run, a step's predictor.1.weight gradient was 1.1e-4 from float64 in eager and 7.7e-7 on the
# permuted rows, the run with the larger error having one more flip at the relu after that batch norm.
CUDA_STEPS = {"moco_v3": 10}


def _train_and_evaluate(system: str, sizes, device: str, steps: int) -> TrainingRun:
    torch.manual_seed(0)
    run = TrainingRun.of(lambda: SYSTEMS[system](sizes), device, gradients_over_steps=steps > 3)
    counters["fusepass"].clear()
    try:
        for step in range(steps):
            run.train_step(step, device)
        run.eval_forward(device)
        run.finish()
    except AssertionError as error:  # which implementations ran: with tuning on they vary from run to run
        raise AssertionError(f"{error}\nthe fused ops' choices:\n{_choices()}") from None
    graphs, rewrites, linears = COUNTS[system]
    assert_fused(rewrites=rewrites, graphs=graphs, linears=linears)
    return run


def _choices() -> str:
    return "\n".join(f"  {problem.describe()} traced={traced}: {impl.name if impl else None}"
                     for op in (CHAIN, LINEAR) for (problem, traced), impl in op._chosen.items())


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_real_model_trains_like_eager_on_cpu(system):
    _train_and_evaluate(system, CPU_SIZES, "cpu", steps=3)


def test_moco_v3_gradients_judged_over_ten_steps_on_cpu():
    """The CUDA run's criterion, on CPU sizes: every gradient's trajectory checked, none step by step."""
    run = _train_and_evaluate("moco_v3", CPU_SIZES, "cpu", steps=CUDA_STEPS["moco_v3"])
    grads = [key for key, p in run.copies["ref"].named_parameters() if p.requires_grad]
    assert sorted(run.trajectories) == sorted(f"grad {key}" for key in grads)
    assert all(t.steps == CUDA_STEPS["moco_v3"] for t in run.trajectories.values())


def test_trajectory_is_the_relative_error_of_the_steps_as_one_vector():
    steps = [[torch.randn(n, dtype=torch.float64) for _ in range(3)] for n in (7, 7, 7)]
    trajectory = Trajectory()
    for ref, eager, fused in steps:
        trajectory.add("x", fused.float(), eager.float(), ref)
    ref, eager, fused = (torch.cat(values) for values in zip(*steps))
    assert trajectory.errors() == pytest.approx((rel_error(fused.float(), ref), rel_error(eager.float(), ref)))
    assert trajectory.steps == 3


@requires_cuda
@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_real_model_trains_like_eager_on_cuda(system):
    """Batch 1024 per view or crop, widths 1024-4096 (DINO's head 2048 -> 4096 -> 1024 -> 2048)."""
    _train_and_evaluate(system, CUDA_SIZES, "cuda", steps=CUDA_STEPS.get(system, 3))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.slow
def test_moco_v3_trains_like_eager_on_cuda_with_tuning(monkeypatch):
    """As users run it, every op's implementation timed and chosen: the tuner's choices change the
    rounding of every step (and, judged step by step, failed here in about 2 runs of 5: see CUDA_STEPS)."""
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    _train_and_evaluate("moco_v3", CUDA_SIZES, "cuda", steps=CUDA_STEPS["moco_v3"])


def test_explain_reports_a_weight_normed_model_and_changes_nothing():
    """explain() copies nothing (a weight-normed module refuses deepcopy) and puts back what the forward
    changed: running statistics here, the parameters' values, the random state."""
    torch.manual_seed(0)
    head = DinoHead(40, 40, 80, 20)
    x = torch.randn(16, 40)
    state = {k: v.clone() for k, v in head.state_dict().items()}
    rng = torch.get_rng_state()
    report = fusepass.explain(head, x)
    assert [m["pattern"] for m in report.matches] == ["linear_batch_norm_gelu", "linear_batch_norm_gelu",
                                                      "linear", "linear"]
    assert torch.equal(rng, torch.get_rng_state())
    for key, value in head.state_dict().items():
        assert torch.equal(value, state[key]), f"explain() changed {key}"


def test_explain_puts_back_parameters_replaced_through_data():
    """MoCo v3's forward replaces the momentum encoder's parameters' `.data`: explain() gives each its own
    storage and value back."""
    torch.manual_seed(0)
    moco = SYSTEMS["moco_v3"](CPU_SIZES).moco
    x1, x2 = moco_inputs = SYSTEMS["moco_v3"](CPU_SIZES).inputs("cpu")
    params = {name: (p, p.data_ptr(), p.detach().clone()) for name, p in moco.named_parameters()}
    report = fusepass.explain(moco, *moco_inputs, 0.5)
    assert len(report.matches) == 10 + 6 and x1.shape == x2.shape
    now = dict(moco.named_parameters())
    for name, (p, pointer, value) in params.items():
        assert now[name] is p and p.data_ptr() == pointer and torch.equal(p.detach(), value), name


@pytest.mark.parametrize("system", ["moco_v3", "barlow_twins"])
def test_equally_exact_runs_meet_the_criterion_over_steps_on_cpu(system):
    """tools/equally_exact.py: eager fed permuted rows trains as eager does (the same loss in exact
    arithmetic) and, each gradient judged over its steps, is no further from float64."""
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "tools/equally_exact.py", system, "--seeds", "2", "--steps", "4",
                             "--size", "cpu"], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "gradients over steps 0 of 2" in result.stdout, result.stdout
    ratios = [float(line.rsplit(" ", 3)[-3].rstrip("x")) for line in result.stdout.splitlines()
              if "the furthest gradient" in line]
    assert len(ratios) == 2 and all(r != 1.0 for r in ratios), result.stdout  # another rounding: not eager's
