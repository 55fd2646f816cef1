"""fusepass's start of Inductor's compile workers: with static launching of user-defined kernels set for
the workers alone, only on CUDA machines, never over a running pool or the user's own setting; on a GPU, the
fused ops' kernels of a compiled model end up on Inductor's static launcher."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fusepass import compile_workers
from fusepass.compile_workers import STATIC_USER_KERNELS_ENV


@pytest.fixture
def pool_starts(monkeypatch):
    """Records, for each start of the pool, the variable's value while it started."""
    seen = []
    monkeypatch.setattr(compile_workers, "maybe_warm_pool",
                        lambda: seen.append(os.environ.get(STATIC_USER_KERNELS_ENV)))
    monkeypatch.setattr(compile_workers, "running", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(STATIC_USER_KERNELS_ENV, raising=False)
    return seen


def test_the_pool_starts_with_static_user_kernels_and_the_variable_is_restored(pool_starts):
    compile_workers.start()
    assert pool_starts == ["1"]
    assert STATIC_USER_KERNELS_ENV not in os.environ


def test_the_variable_is_restored_when_the_pool_fails_to_start(pool_starts, monkeypatch):
    def fails():
        pool_starts.append(os.environ.get(STATIC_USER_KERNELS_ENV))
        raise RuntimeError("no workers")
    monkeypatch.setattr(compile_workers, "maybe_warm_pool", fails)
    with pytest.raises(RuntimeError, match="no workers"):
        compile_workers.start()
    assert pool_starts == ["1"]
    assert STATIC_USER_KERNELS_ENV not in os.environ


def test_the_users_own_setting_is_kept(pool_starts, monkeypatch):
    monkeypatch.setenv(STATIC_USER_KERNELS_ENV, "0")
    compile_workers.start()
    assert pool_starts == ["0"]
    assert os.environ[STATIC_USER_KERNELS_ENV] == "0"


def test_a_running_pool_is_left_alone(pool_starts, monkeypatch):
    monkeypatch.setattr(compile_workers, "running", lambda: True)
    compile_workers.start()
    assert pool_starts == []


def test_no_pool_without_a_gpu(pool_starts, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    compile_workers.start()
    assert pool_starts == []


@pytest.mark.parametrize("static", [True, False])
def test_the_backend_starts_the_workers_only_when_fused_kernels_launch_statically(monkeypatch, static):
    starts = []
    monkeypatch.setattr(compile_workers, "start", lambda: starts.append(True))
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.BatchNorm1d(10))
    compiled = torch.compile(model, backend="fusepass",
                             options={"static_launch_user_defined_triton_kernels": static})
    compiled(torch.randn(6, 12))
    assert starts == ([True] if static else [])


FRESH_PROCESS = """
import gc, json, torch
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.runtime.hints import HeuristicType
from torch._inductor.runtime.triton_heuristics import CachingAutotuner
from fusepass import compile_workers
compile_workers.start()
AsyncCompile.wait_pool_ready()  # so that every kernel compiles in a worker, none in this process
model = torch.nn.Sequential(torch.nn.Linear(96, 80), torch.nn.BatchNorm1d(80), torch.nn.ReLU()).cuda()
compiled = torch.compile(model, backend="fusepass")
for _ in range(2):
    compiled(torch.randn(64, 96, device="cuda")).sum().backward()
# type(), not isinstance(): isinstance() asks a dead weak proxy among the objects for its class, which raises
kernels = [k for k in gc.get_objects() if issubclass(type(k), CachingAutotuner) and k.compile_results]
user = sorted((k.fn.__name__, k.is_statically_launchable()) for k in kernels
              if k.heuristic_type == HeuristicType.USER_AUTOTUNE)
print(json.dumps({"user": user, "inductor": len(kernels) - len(user)}))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_kernels_compiled_in_the_workers_launch_statically():
    """A fresh process whose compile workers fusepass started, and which waits for them so that every
    kernel compiles there: each fused-op kernel is on Inductor's static launcher (each of this model's
    kernels can be; with the workers Inductor starts on its own, none is)."""
    env = {k: v for k, v in os.environ.items() if k != STATIC_USER_KERNELS_ENV}
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    kernels = json.loads(result.stdout.strip().splitlines()[-1])
    assert kernels["inductor"] > 0  # the graph's other kernels compiled too
    assert ["normalize_kernel", True] in kernels["user"], kernels
    assert all(static for _, static in kernels["user"]), kernels
