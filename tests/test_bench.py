"""fusepass-bench on CPU with --shrink: verdicts, the JSON schema, a wrong provider, error paths."""

import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import fusepass.bench as bench

PROBLEMS = Path(__file__).parent.parent / "demos" / "problems"
FAST = ["--device", "cpu", "--shrink", "32", "--seeds", "2", "--warmup", "5", "--rep", "20"]


def test_cli_reports_verdicts_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    status = bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), str(PROBLEMS / "gemm_batchnorm_scale_softmax.py"),
                         *FAST, "--mode", "train", "eval", "--json", str(out_json)])
    assert status == 0
    printed = capsys.readouterr()
    assert "gemm_scale_batchnorm (sizes / 32)" in printed.out and "WRONG" not in printed.out
    assert "[4/4] gemm_batchnorm_scale_softmax eval fp32" in printed.err  # progress display

    payload = json.loads(out_json.read_text())
    assert set(payload["environment"]) == {"device", "torch", "triton", "date", "command"}
    assert payload["config"]["shrink"] == 32 and payload["config"]["modes"] == ["train", "eval"]
    results = payload["results"]
    assert len(results) == 2 * 2 * 3  # problems x modes x providers
    assert all(set(r) == {f.name for f in dataclasses.fields(bench.Result)} for r in results)
    for r in results:
        assert r["correct"] is True and r["failure"] is None
        assert 0 < r["median_ms"] and r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
        assert r["rel_error"] < 1e-5 and r["stats_match_eager"] is True and r["allclose"] is True
        assert r["peak_mb"] is None  # not measured on CPU: null, not NaN
    eager = [r for r in results if r["provider"] == "eager"]
    assert all(r["speedup_vs_eager"] == 1.0 for r in eager)


def test_cli_backward_checks_gradients(tmp_path):
    out_json = tmp_path / "bench.json"
    status = bench.main([str(PROBLEMS / "gemm_scale_batchnorm_1024.py"), *FAST, "--backward",
                         "--providers", "fusepass", "--json", str(out_json)])
    assert status == 0
    results = json.loads(out_json.read_text())["results"]
    assert [r["provider"] for r in results] == ["eager", "fusepass"]  # eager is always the baseline
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
    real = bench.make_provider

    def off_by_a_bit(name, model):
        fn = real(name, model)
        return (lambda *inputs: fn(*inputs) + 1e-2) if name == "fusepass" else fn

    monkeypatch.setattr(bench, "make_provider", off_by_a_bit)
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
    assert bench.main([str(path), *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fusepass-bench: error:") and message in err[0]


def test_plot_without_matplotlib_says_so_before_any_work(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), *FAST, "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_shrink_divides_every_size():
    module = types.SimpleNamespace(batch_size=1024, in_features=8192, scale_shape=(8192,), single=(1,),
                                   bn_eps=1e-5, flag=True, name="x")
    bench.shrink_sizes(module, 64)
    assert (module.batch_size, module.in_features, module.scale_shape) == (16, 128, (128,))
    assert module.single == (1,) and module.bn_eps == 1e-5 and module.flag is True


def test_console_script_is_installed():
    result = subprocess.run(["fusepass-bench", "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "--precision" in result.stdout and "--shrink" in result.stdout


def test_drifting_running_statistics_are_reported_wrong(tmp_path, monkeypatch):
    real = bench.make_provider

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

    monkeypatch.setattr(bench, "make_provider", drifting)
    out_json = tmp_path / "bench.json"
    assert bench.main([str(PROBLEMS / "gemm_scale_batchnorm.py"), *FAST, "--json", str(out_json)]) == 1
    [wrong] = [r for r in json.loads(out_json.read_text())["results"] if r["provider"] == "fusepass"]
    assert not wrong["correct"] and "running statistics" in wrong["failure"] and wrong["stats_match_eager"] is False
