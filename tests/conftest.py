import os

import pytest
import torch

# Without a GPU, run the Triton kernels in Triton's interpreter on CPU tensors. Must be set before
# fusepass (and its @triton.jit kernels) is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch._dynamo.utils import counters  # noqa: E402

from fusepass.lowering import forget_choices, tuning  # noqa: E402


def pytest_configure(config):
    """A graph that falls back to plain Inductor still gives eager's results, so without this every
    end-to-end test would pass with a fused op that fails when it runs. Tests that cause a fallback on
    purpose expect the warning (pytest.warns). Added here rather than in pyproject.toml: pytest imports
    a filter's category when it reads the ini file, before this file sets TRITON_INTERPRET."""
    config.addinivalue_line("filterwarnings", "error::fusepass.FusepassFallbackWarning")
    if getattr(config.option, "maxschedchunk", "no xdist") is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run first: with -n N the longest then start at once instead of ending the run
    alone (on an H100 the CUDA suite's DINO test took 99 s of its 252, started late). pytest-xdist hands
    each worker a chunk of consecutive tests at first, which would give one worker all of them: workers
    here take one test at a time (--maxschedchunk, unless given; set in pytest_configure, where the
    controller reads it)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def untuned(tmp_path, monkeypatch):
    """Tests take each op's default implementation unless they ask for tuning (tests/lowering/
    test_tuning.py; the GPU benchmark tunes for real), never touch the user's tuning cache, and start
    with no choice remembered: a test's choices would otherwise lend themselves to the next one's
    buckets."""
    monkeypatch.setenv(tuning.TUNE_ENV, os.environ.get(tuning.TUNE_ENV, "0"))
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path / "fusepass-cache"))
    forget_choices()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch and counts only its own rewrites."""
    torch._dynamo.reset()
    counters["fusepass"].clear()
    yield
    torch._dynamo.reset()
