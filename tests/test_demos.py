"""The demos run on a CPU-only machine (they shrink the problems themselves) and show what they promise."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEMOS = Path(__file__).parent.parent / "demos"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the demos run at full size")


def run_demo(name, *args, as_user=False):
    """The demo's (stdout, stderr). Warnings are ignored, unless `as_user`: then it runs as README's
    command does in a user's shell, with Python's default warning filters and none of the test
    suite's environment (TRITON_INTERPRET)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if as_user:
        for variable in ("PYTHONWARNINGS", "TRITON_INTERPRET"):
            env.pop(variable, None)
    result = subprocess.run([sys.executable, str(DEMOS / name), *args], capture_output=True, text=True,
                            timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, result.stderr


def test_quickstart():
    out, _ = run_demo("quickstart.py", "--problem", "gemm_batchnorm_scale_softmax")
    assert "No GPU in use" in out and "linear_batch_norm_mul_softmax" in out
    assert out.count("fusepass ") >= 2 and "Relative error to the float64 model" in out


def test_quickstart_prints_no_warnings():
    """README's first command, `python demos/quickstart.py`, as a user runs it: nothing on stderr that
    warns (torch without numpy, say, prints "Failed to initialize NumPy")."""
    out, err = run_demo("quickstart.py", as_user=True)
    assert "Relative error to the float64 model" in out
    noisy = [line for line in err.splitlines() if "warn" in line.lower() or "numpy" in line.lower()]
    assert noisy == [], err[-3000:]


@pytest.mark.slow
def test_compare_runs_every_problem_shrunk():
    out, _ = run_demo("compare.py")
    assert "--shrink 32" in out and "WRONG" not in out
    # 16384 x 4096 -> 4096, 1024 x 8192 -> 8192 (softmax; batch norm alone; with a four-op tail; a
    # matmul head), the
    # MLP 4096 x 1024 -> 256, and --size 1024,8192,8192: each size / 32
    for problem in ("gemm_scale_batchnorm@512x128x128", "gemm_batchnorm_scale_softmax@32x256x256",
                    "gemm_batchnorm@32x256x256", "gemm_batchnorm_swish@32x256x256",
                    "matmul_batchnorm_scale_softmax@32x256x256",
                    "mlp_batchnorm@128x32x8", "gemm_scale_batchnorm@32x256x256"):
        assert f"\n{problem}\n" in out
    assert out.count(" ok ") == 7 * 2 * 3  # problems x modes x providers


def test_explain_and_dump():
    out, _ = run_demo("explain_and_dump.py")
    assert "1 rewrite(s), 0 miss(es)" in out
    for part in ("before.py", "after.py", "report.txt"):
        assert f"_{part} =====" in out
    assert "torch.ops.fusepass.batch_norm_chain.default" in out


@pytest.mark.slow
def test_ddp_train_demo_runs_under_torchrun_on_cpu(tmp_path):
    """demos/ddp_train.py with two gloo ranks, shrunk: fused counts per rank, a JSON of step times (and each
    round's), rank 0's profile of the providers named (every provider is timed) and every rank's Chrome
    trace of them."""
    out = tmp_path / "ddp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             str(DEMOS / "ddp_train.py"), "--problems", str(DEMOS / "problems" / "mlp_batchnorm.py"),
                             "--steps", "2", "--rounds", "2", "--warmup", "1", "--shrink", "32", "--json", str(out),
                             "--profile", "inductor", "fusepass", "--trace", str(tmp_path / "traces"), "--verbose"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        counts = "{'graphs': 1, 'rewrites': 2, 'linears': 1, 'fallbacks': 0}"
        assert f"rank {rank}: mlp_batchnorm batch_norm fp32: fusepass {counts}" \
            in result.stdout, result.stdout
    for provider in ("inductor", "fusepass"):
        assert f"== mlp_batchnorm batch_norm fp32 {provider} ==\nhost " in result.stdout, result.stdout
    assert "fp32 eager ==" not in result.stdout
    for provider in ("eager", "inductor", "fusepass"):  # each median as soon as it is timed
        assert result.stdout.count(f"mlp_batchnorm batch_norm fp32 {provider}: ") == 1, result.stdout
    assert result.stdout.count("over 2 steps") == 2 and result.stdout.count("function calls") == 2
    for rank in (0, 1):  # every rank's times, printed by rank 0 (no CUDA kernels on CPU)
        assert result.stdout.count(f"rank {rank}: host ") == 2, result.stdout
    assert "CUDA kernels 0.000 ms/step (summed over streams), NCCL's 0.000" in result.stdout
    [case] = json.loads(out.read_text())["results"]
    assert set(case["ms"]) == {"eager", "inductor", "fusepass"} and case["fused"]["rewrites"] == 2
    assert {provider: len(rounds) for provider, rounds in case["round_ms"].items()} == \
        {"eager": 2, "inductor": 2, "fusepass": 2}  # each provider timed in each of the interleaved rounds
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())  # every rank's, of the profiled providers
    assert traces == [f"mlp_batchnorm_batch_norm_fp32_{provider}_rank{rank}.json"
                      for provider in ("fusepass", "inductor") for rank in (0, 1)]
    assert all("traceEvents" in json.loads((tmp_path / "traces" / name).read_text()) for name in traces)
