"""fusepass-bench on CPU with --shrink: verdicts, the JSON schema, wrong providers (bad output, drifting
statistics, fallbacks, dropped parameters), error paths; the GPU tools built on its public functions."""

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fusepass
import fusepass.backend
import fusepass.bench as bench
import fusepass.largest_batch as largest_batch
import fusepass.measure as measure
import fusepass.providers as providers

ROOT = Path(__file__).parent.parent
PROBLEMS = ROOT / "demos" / "problems"
TIMING = ["--seeds", "2", "--warmup", "5", "--rep", "20"]
FAST = ["--device", "cpu", "--shrink", "32", *TIMING]


def test_cli_reports_verdicts_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    status = bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), str(PROBLEMS / "gemm_batchnorm_scale_softmax.py"),
                         *FAST, "--mode", "train", "eval", "--json", str(out_json)])
    assert status == 0
    printed = capsys.readouterr()
    # 16384 x 4096 -> 4096 and 1024 x 8192 -> 8192, each size / 32; the name says the size that ran
    assert "\ngemm_scale_batchnorm@512x128x128\n" in printed.out and "WRONG" not in printed.out
    assert "[4/4] gemm_batchnorm_scale_softmax@32x256x256 eval fp32" in printed.err  # progress display

    payload = json.loads(out_json.read_text())
    assert set(payload["environment"]) == {"device", "torch", "triton", "date", "command"}
    assert payload["environment"]["command"].endswith(f"--json {out_json}")
    assert payload["config"]["shrink"] == 32 and payload["config"]["size"] is None
    assert payload["config"]["modes"] == ["train", "eval"]
    results = payload["results"]
    assert len(results) == 2 * 2 * 3  # problems x modes x providers
    assert all(set(r) == {f.name for f in dataclasses.fields(bench.Result)} for r in results)
    for r in results:
        assert r["correct"] is True and r["failure"] is None
        assert 0 < r["median_ms"] and r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
        assert r["rel_error"] < 1e-5 and r["stats_match_eager"] is True and r["allclose"] is True
        assert r["peak_mb"] is None and r["own_peak_mb"] is None  # not measured on CPU: null, not NaN
        expected_size = [512, 128, 128] if r["problem"].startswith("gemm_scale_batchnorm") else [32, 256, 256]
        assert r["problem"] == providers.sized_name(r["problem"].split("@")[0], expected_size)
        assert r["size"] == expected_size
        # one chain per problem, compiled once per mode; nothing of fusepass's in the other providers
        assert r["fusepass_rewrites"] == (1 if r["provider"] == "fusepass" else 0) and r["fusepass_fallbacks"] == 0
        assert len(r["round_medians_ms"]) == 3 and all(t > 0 for t in r["round_medians_ms"])  # --rounds 3
    eager = [r for r in results if r["provider"] == "eager"]
    assert all(r["speedup_vs_eager"] == 1.0 for r in eager)


def test_timing_rounds_are_interleaved_each_starting_one_provider_later(capsys):
    assert bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), *FAST, "--mode", "train", "--rounds", "3"]) == 0
    progress = capsys.readouterr().err.replace("\r", "\n")
    timed = re.findall(r"(\w+): timing, round (\d) of 3", progress)
    assert timed == [("eager", "1"), ("inductor", "1"), ("fusepass", "1"),
                     ("inductor", "2"), ("fusepass", "2"), ("eager", "2"),
                     ("fusepass", "3"), ("eager", "3"), ("inductor", "3")]


def test_size_runs_the_problem_at_that_size(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    status = bench.main([str(PROBLEMS / "gemm_batchnorm_scale_softmax.py"), "--device", "cpu", "--size", "24,40,56",
                         "--providers", "fusepass", *TIMING, "--json", str(out_json)])
    assert status == 0
    assert "\ngemm_batchnorm_scale_softmax@24x40x56\n" in capsys.readouterr().out
    payload = json.loads(out_json.read_text())
    assert payload["config"]["size"] == [24, 40, 56] and payload["config"]["shrink"] == 1
    assert [(r["problem"], r["size"]) for r in payload["results"]] == [("gemm_batchnorm_scale_softmax@24x40x56",
                                                                        [24, 40, 56])] * 2


def test_cli_backward_checks_gradients(tmp_path):
    out_json = tmp_path / "bench.json"
    status = bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), "--size", "1024,8192,8192", *FAST, "--backward",
                         "--providers", "fusepass", "--json", str(out_json)])
    assert status == 0
    results = json.loads(out_json.read_text())["results"]
    assert [r["provider"] for r in results] == ["eager", "fusepass"]  # eager is always the baseline
    assert all(r["size"] == [32, 256, 256] for r in results)  # --shrink divides --size's sizes
    assert all(r["forward_flop"] == 2 * 32 * 256 * 256 for r in results)  # the one GEMM, counted by torch
    assert all(r["correct"] and r["grad_allclose"] and 0 < r["grad_rel_error"] < 1e-4 for r in results)


def test_tolerance_too_tight_for_everyone_is_not_a_wrong_verdict(tmp_path):
    """At atol = rtol = 1e-12 no fp32 result is allclose to float64, eager's included: a provider as
    close to float64 as eager is still correct, and the allclose column says no."""
    out_json = tmp_path / "bench.json"
    status = bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), *FAST, "--atol", "1e-12", "--rtol", "1e-12",
                         "--json", str(out_json)])
    assert status == 0
    results = json.loads(out_json.read_text())["results"]
    assert all(r["correct"] and r["allclose"] is False for r in results)


def test_wrong_provider_is_reported_wrong_and_not_timed(tmp_path, monkeypatch, capsys):
    real = measure.make_provider

    def off_by_a_bit(name, model):
        fn = real(name, model)
        return (lambda *inputs: fn(*inputs) + 1e-2) if name == "fusepass" else fn

    monkeypatch.setattr(measure, "make_provider", off_by_a_bit)
    out_json = tmp_path / "bench.json"
    status = bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), *FAST, "--json", str(out_json)])
    assert status == 1
    [wrong] = [r for r in json.loads(out_json.read_text())["results"] if r["provider"] == "fusepass"]
    assert wrong["correct"] is False and "not allclose" in wrong["failure"]
    assert wrong["median_ms"] is None and wrong["speedup_vs_eager"] is None
    assert "WRONG: output not allclose" in capsys.readouterr().out


@pytest.mark.parametrize("write, message", [
    (None, "no such problem file"),
    ("import torch\n", "defines no Model"),
    ("def broken(:\n", "cannot be imported"),
    ("import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x @ x\n"
     "def get_inputs():\n    return [torch.rand(3, 4)]\ndef get_init_inputs():\n    return []\n",
     "fails in eager"),
])
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, capsys, write, message):
    path = tmp_path / "problem.py"
    if write is not None:
        path.write_text(write)
    assert bench.main([str(path), "--device", "cpu", *TIMING]) == 2
    assert_one_error_line(capsys, message)


def assert_one_error_line(capsys, message):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fusepass-bench: error:") and message in err[0], err


@pytest.mark.parametrize("args, message", [
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["--shrink", "0"], "--shrink must be at least 1"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--size", "1,2"], "argument --size: expected N,K,F"),
    (["--size", "8,0,8"], "argument --size: expected N,K,F"),
    (["--mode", "test"], "argument --mode: invalid choice"),
    (["--device", "cuda"], "no CUDA GPU is available"),
])
def test_bad_arguments_are_one_line_and_status_2(monkeypatch, capsys, args, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --device cuda is bad input on any machine
    assert bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), *args]) == 2  # returned, not raised
    assert_one_error_line(capsys, message)
    assert capsys.readouterr().out == ""


def test_no_problem_is_one_line_and_status_2(capsys):
    assert bench.main([]) == 2
    assert_one_error_line(capsys, "required: PROBLEM.py")


def test_a_problem_that_cannot_be_resized_is_one_line_and_status_2(tmp_path, capsys):
    path = tmp_path / "literal_shape.py"
    path.write_text((PROBLEMS / "gemm_scale_batchnorm.py").read_text().replace(
        "scale_shape = (out_features,)", "scale_shape = (4096,)"))
    assert bench.main([str(path), *FAST]) == 2
    assert_one_error_line(capsys, "scale_shape = (4096,) keeps the size 4096")


def test_help_returns_0(capsys):
    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--size N,K,F" in out and "--shrink F" in out


def test_plot_without_matplotlib_says_so_before_any_work(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), *FAST, "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_console_script_is_installed():
    result = subprocess.run(["fusepass-bench", "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "--precision" in result.stdout and "--size" in result.stdout


def test_drifting_running_statistics_are_reported_wrong(tmp_path, monkeypatch):
    real = measure.make_provider

    def drifting(name, model):
        fn = real(name, model)
        if name != "fusepass":
            return fn

        def call(*inputs):
            out = fn(*inputs)
            with torch.no_grad():
                model.bn.running_var.mul_(1.01)
            return out
        return call

    monkeypatch.setattr(measure, "make_provider", drifting)
    out_json = tmp_path / "bench.json"
    assert bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), *FAST, "--json", str(out_json)]) == 1
    [wrong] = [r for r in json.loads(out_json.read_text())["results"] if r["provider"] == "fusepass"]
    assert not wrong["correct"] and "running statistics" in wrong["failure"] and wrong["stats_match_eager"] is False


def test_fusepass_fallback_is_reported_wrong(tmp_path, monkeypatch):
    """A fusepass provider that fell back runs the fallback compiler's code: its speed is not fusepass's."""
    def failing_rewrite(*args, **kwargs):
        raise RuntimeError("rewrite fails for this test")

    monkeypatch.setattr(fusepass.backend, "apply", failing_rewrite)
    out_json = tmp_path / "bench.json"
    with pytest.warns(fusepass.FusepassFallbackWarning):
        status = bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), *FAST, "--json", str(out_json)])
    assert status == 1
    results = {r["provider"]: r for r in json.loads(out_json.read_text())["results"]}
    fell_back = results["fusepass"]
    assert fell_back["correct"] is False and "fallback" in fell_back["failure"]
    assert fell_back["fusepass_fallbacks"] >= 1 and fell_back["fusepass_rewrites"] == 0
    assert fell_back["median_ms"] is None and fell_back["rel_error"] < 1e-5  # its output was right
    assert all(results[p]["correct"] and results[p]["fusepass_fallbacks"] == 0 for p in ("eager", "inductor"))


def scale_batch_norm(model, x, weight, bias):
    """gemm_scale_batchnorm's forward with BatchNorm's weight and bias given, as a kernel's bug would."""
    bn = model.bn
    if model.training:
        bn.num_batches_tracked.add_(1)
    return F.batch_norm(model.gemm(x) * model.scale, bn.running_mean, bn.running_var, weight, bias,
                        model.training, bn.momentum, bn.eps)


def drop_gamma(model, x):
    return scale_batch_norm(model, x, None, model.bn.bias)


def drop_beta(model, x):
    return scale_batch_norm(model, x, model.bn.weight, None)


def drop_post_scale(model, x):
    return model.softmax(model.bn(model.gemm(x)))


@pytest.mark.parametrize("problem, buggy", [
    ("gemm_scale_batchnorm.py", drop_gamma),
    ("gemm_scale_batchnorm.py", drop_beta),
    ("gemm_batchnorm_scale_softmax.py", drop_post_scale),
])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_dropped_parameter_is_reported_wrong(tmp_path, monkeypatch, problem, buggy, mode):
    """The problems keep BatchNorm's gamma = 1, beta = 0 and the softmax problem's scale = 1, under which
    a provider that ignores one of them is right; the bench perturbs them, so it is not."""
    real = measure.make_provider
    monkeypatch.setattr(measure, "make_provider", lambda name, model: (
        (lambda x: buggy(model, x)) if name == "fusepass" else real(name, model)))
    out_json = tmp_path / "bench.json"
    assert bench.main([str(PROBLEMS / problem), *FAST, "--mode", mode, "--providers", "fusepass",
                       "--json", str(out_json)]) == 1
    [wrong] = [r for r in json.loads(out_json.read_text())["results"] if r["provider"] == "fusepass"]
    assert wrong["correct"] is False and "not allclose" in wrong["failure"]


def test_perturbed_parameters_are_seeded_and_nontrivial():
    module = providers.load(str(PROBLEMS / "gemm_batchnorm_scale_softmax.py"), (16, 24, 32))
    first, second = (module.Model(*module.get_init_inputs()) for _ in range(2))
    second.load_state_dict(first.state_dict())
    rng_state = torch.get_rng_state()
    providers.perturb_parameters(first)
    assert torch.equal(torch.get_rng_state(), rng_state)  # its own generator: input draws are unchanged
    providers.perturb_parameters(second)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name  # the same values for every provider
    bn = first.bn
    assert (bn.weight != 1).all() and (bn.bias != 0).all() and (first.scale != 1).all()
    assert (bn.running_mean != 0).all() and (bn.running_var > 0).all() and (bn.running_var != 1).all()
    assert bn.num_batches_tracked.item() == 0


@pytest.mark.parametrize("tool", ["profile_host.py", "memory_peak.py", "compile_cache.py", "options_ab.py"])
def test_gpu_tools_parse_arguments_on_any_machine(tool):
    """`--help` works without a GPU: the tools import only the fusepass package and do GPU work after parsing."""
    result = subprocess.run([sys.executable, f"tools/{tool}", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--size N,K,F" in result.stdout and "--precision" in result.stdout


def test_memory_peak_replays_the_allocator_trace_in_order():
    """tools/memory_peak.py: the peak is the highest net of allocations less completed frees (a requested
    free does not count), with the blocks live then; the timeline lists each block above the size."""
    spec = importlib.util.spec_from_file_location("memory_peak", ROOT / "tools" / "memory_peak.py")
    memory_peak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory_peak)
    mb = 1 << 20
    trace = [{"action": "alloc", "addr": 1, "size": 10 * mb}, {"action": "alloc", "addr": 2, "size": 5 * mb},
             {"action": "free_requested", "addr": 1, "size": 10 * mb},
             {"action": "alloc", "addr": 4, "size": mb // 2},
             {"action": "free_completed", "addr": 1, "size": 10 * mb},
             {"action": "alloc", "addr": 3, "size": 7 * mb}, {"action": "free_completed", "addr": 3, "size": 7 * mb}]
    peak, blocks = memory_peak.live_at_peak(trace)
    assert peak == 15 * mb + mb // 2 and [b["addr"] for b in blocks] == [1, 2, 4]
    nets = [line.split()[0] for line in memory_peak.timeline(trace, mb)]
    assert nets == ["10", "15", "6", "12", "6"]


def test_cuda_graph_providers_begin_a_step_per_call(monkeypatch):
    """As a training loop does: each call marks a new CUDA-graph step and drops the last step's
    gradients, so that back-to-back training steps may overwrite the previous step's graph-owned memory."""
    steps = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    model = torch.nn.Linear(4, 3)
    for provider in ("inductor-cudagraphs", "fusepass-cudagraphs"):
        fn = providers.make_provider(provider, model)
        for _ in range(3):
            fn(torch.randn(2, 4)).sum().backward()
            assert model.weight.grad is not None
        fn(torch.randn(2, 4))
        assert model.weight.grad is None
    assert len(steps) == 8
    providers.make_provider("inductor", model)(torch.randn(2, 4))
    assert len(steps) == 8


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_training_steps_are_checked_and_timed(tmp_path):
    out_json = tmp_path / "bench.json"
    status = bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), "--device", "cuda", "--shrink", "32", *TIMING,
                         "--backward", "--providers", "eager", "inductor-cudagraphs", "fusepass-cudagraphs",
                         "--json", str(out_json)])
    assert status == 0
    results = json.loads(out_json.read_text())["results"]
    assert all(r["correct"] and r["median_ms"] > 0 for r in results)


def test_a_tf32_training_step_keeps_tf32_in_its_backward():
    """A user who allows TF32 allows it for the whole step; autocast wraps the forward only."""
    seen = {}

    class Record(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen["forward"] = (torch.get_float32_matmul_precision(), torch.is_autocast_enabled("cpu"))
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen["backward"] = (torch.get_float32_matmul_precision(), torch.is_autocast_enabled("cpu"))
            return grad

    x = torch.randn(3, requires_grad=True)
    for precision, forward, backward in (("tf32", ("high", False), ("high", False)),
                                         ("bf16-autocast", ("highest", True), ("highest", False))):
        providers.provider_call(Record.apply, [x], mode="train", precision=precision, device="cpu", backward=True)()
        assert seen == {"forward": forward, "backward": backward}
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.slow
def test_shape_changes_mode_times_every_step_of_each_provider(tmp_path, capsys):
    """--batch-sequence: each provider in a process of its own, every step's wall time, the counters."""
    out_json = tmp_path / "shapes.json"
    status = bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), "--device", "cpu", "--shrink", "256",
                         "--batch-sequence", "8,8,6", "--mode", "train", "--caches", "cold",
                         "--providers", "eager", "fusepass", "--json", str(out_json)])
    assert status == 0
    [run] = json.loads(out_json.read_text())["shape_changes"]
    assert run["sequence"] == [8, 8, 6] and [r["provider"] for r in run["results"]] == ["eager", "fusepass"]
    for result in run["results"]:
        assert len(result["steps"]) == 3 and all(t > 0 for t in result["steps"])
        assert set(result["steady"]) == {"6", "8"} and result["compile_and_tune"] >= 0
    fused = run["results"][1]["counters"]
    assert fused["rewrites"] == 2 and fused["graphs"] == 2 and "fallbacks" not in fused  # static 8, symbolic 6
    assert "compile+tune" in capsys.readouterr().out


def test_tune_only_warms_each_batch_size(capsys):
    status = bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), "--device", "cpu", "--shrink", "256",
                         "--tune-only", "--batch-sizes", "4,9", "--mode", "eval"])
    assert status == 0
    assert "batch sizes [4, 9], 0 bucket(s) timed, 2 graph(s) compiled" in capsys.readouterr().out  # CPU times none


def test_tune_only_needs_batch_sizes(capsys):
    assert bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), "--device", "cpu", "--tune-only"]) == 2
    assert "--tune-only needs --batch-sizes" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_drops_every_models_gradients_first():
    """An earlier provider's gradients do not count against the provider measured: its 4 MB gradient is
    dropped before the call. The call's own peak leaves out what was held before it, the models'
    parameters, and keeps what the call makes, its gradients."""
    earlier, measured = (torch.nn.Linear(1024, 1024, device="cuda") for _ in range(2))
    x = torch.randn(64, 1024, device="cuda")

    def step():
        measured(x).sum().backward()
    earlier(x).sum().backward()
    kept, _ = measure.peak_memory_mb(step, "cuda", list(measured.parameters()))
    earlier(x).sum().backward()
    dropped, own = measure.peak_memory_mb(step, "cuda", [*earlier.parameters(), *measured.parameters()])
    assert earlier.weight.grad is None
    assert kept - dropped >= 4.0
    assert 4.0 <= own < dropped - 8.0  # its 4 MB weight gradient, not the two models' 8 MB of weights


@pytest.mark.parametrize("threshold", [0, 1, 37, 1000])
def test_largest_batch_search_finds_the_threshold_within_its_resolution(threshold):
    tried = []

    def trains(batch):
        tried.append(batch)
        return batch <= threshold
    found = largest_batch.search(trains, start=32)
    assert threshold * (1 - largest_batch.RESOLUTION) <= found <= threshold
    assert found in tried or found == 0
    assert largest_batch.search(lambda batch: True, start=32, limit=100) == 100


def test_largest_batch_run_stops_below_the_first_out_of_memory(monkeypatch):
    """A provider that runs out of memory above 37 rows: 37 is found, and a failed step does not stop the
    next."""
    def make_provider(name, model):
        def step(x):
            if x.shape[0] > 37:
                raise torch.OutOfMemoryError("simulated")
            return model(x)
        return step
    monkeypatch.setattr(largest_batch, "make_provider", make_provider)
    result = largest_batch.run(str(PROBLEMS / "gemm_scale_batchnorm.py"), "eager", "fp32", "cpu", shrink=256)
    assert result["largest_batch"] == 37 and not result["limit_reached"]
    assert result["tried"]["37"] is True and result["tried"]["38"] is False


def test_largest_batch_mode_runs_each_provider_in_a_process_of_its_own():
    [result] = largest_batch.compare(str(PROBLEMS / "gemm_scale_batchnorm.py"), "fp32", ["eager"], "cpu",
                                     shrink=256, limit=40)
    assert result["provider"] == "eager" and result["largest_batch"] == 40 and result["limit_reached"]
    assert "limit" in largest_batch.format_table([result])
    assert bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), "--device", "cpu", "--largest-batch"]) == 2
