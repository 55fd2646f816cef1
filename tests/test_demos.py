"""The demos run on a CPU-only machine (they shrink the problems themselves) and show what they promise."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEMOS = Path(__file__).parent.parent / "demos"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the demos run at full size")


def run_demo(name, *args):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, str(DEMOS / name), *args], capture_output=True, text=True,
                            timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_quickstart():
    out = run_demo("quickstart.py", "--problem", "gemm_batchnorm_scale_softmax")
    assert "No GPU in use" in out and "linear_batch_norm_scale_softmax" in out
    assert out.count("fusepass ") >= 2 and "Relative error to the float64 model" in out


def test_compare_runs_every_problem_shrunk():
    out = run_demo("compare.py")
    assert "--shrink 32" in out and "WRONG" not in out
    for problem in ("gemm_scale_batchnorm", "gemm_scale_batchnorm_1024", "gemm_batchnorm_scale_softmax"):
        assert f"{problem} (sizes / 32)" in out
    assert out.count(" ok ") == 3 * 2 * 3  # problems x modes x providers


def test_explain_and_dump():
    out = run_demo("explain_and_dump.py")
    assert "1 rewrite(s), 0 miss(es)" in out
    for part in ("before.py", "after.py", "report.txt"):
        assert f"_{part} =====" in out
    assert "torch.ops.fusepass.linear_scale_batch_norm.default" in out
