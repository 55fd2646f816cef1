"""Inductor's compile workers, started by fusepass as Inductor's own backend starts them (at the first
compile, so that they are ready by the time the graph's kernels are generated), but set to launch
user-defined Triton kernels, which is what fusepass's kernels are to Inductor, with Inductor's static
launcher. The backend starts them; so do the benchmark providers, before whichever compiles first.

Where a Triton kernel compiles decides which launcher it gets: in the compiling process, Inductor reads its
config there, and the backend's patch (options.py) gives fusepass's kernels the static launcher; in a compile
worker, the worker's own config decides, and of the parent's config Inductor passes the workers only
`use_static_triton_launcher`, not `static_launch_user_defined_triton_kernels`, whose default is off. Once the
pool is ready every kernel compiles there, so fusepass's kernels ran on Triton's Python launcher (an H200,
bf16 MLP training step: 9 such launches a step, 31 us a launch on average under cProfile against 23 with
every kernel static). A worker reads the setting's environment variable when it starts, so the pool is
started with it set (only while it starts: the variable is restored after). A pool already running, started
by an earlier Inductor compile in the same process, is left as it is, and fusepass's kernels compiled there
keep Triton's launcher. A kernel the static launcher cannot take keeps Triton's either way: Inductor
decides per kernel. The workers serve the whole process: another model's own Triton kernels, compiled by
Inductor there later, are launched statically too.
"""

from __future__ import annotations

import os

import torch
from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool

STATIC_USER_KERNELS_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def start() -> None:
    """Starts Inductor's compile workers with static launching of user-defined kernels, on a machine with
    a CUDA GPU, unless they are running already. A value the user gave the variable is kept."""
    if not torch.cuda.is_available() or running():
        return
    if STATIC_USER_KERNELS_ENV in os.environ:
        maybe_warm_pool()
        return
    os.environ[STATIC_USER_KERNELS_ENV] = "1"
    try:
        maybe_warm_pool()
    finally:
        del os.environ[STATIC_USER_KERNELS_ENV]


def running() -> bool:
    """Whether this process has started Inductor's compile-worker pool."""
    return AsyncCompile.process_pool.cache_info().currsize > 0

