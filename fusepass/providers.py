"""A KernelBench-format problem's model, inputs and providers, as every benchmark runs them: the
benchmark CLI (bench.py), its shape-changes mode (shape_changes.py), the tools and the demos."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Optional

import torch

from fusepass import compile_workers
from fusepass.problems import ProblemSizeError, Size, load_problem, problem_size, resize_problem, shrunk_size, \
    sized_name

PROVIDERS = ("eager", "inductor", "fusepass", "max-autotune", "inductor-cudagraphs", "fusepass-cudagraphs")
PRECISIONS = ("fp32", "tf32", "bf16-autocast", "fp16-autocast")
# Weights and inputs must come from unrelated random streams: re-seeding with the init seed before
# drawing inputs replays the weights' uniforms (x[i] = W[i] up to an affine map), which makes y[i, i] a
# 30-sigma outlier and the softmax one-hot.
INIT_SEED, INPUT_SEED = 0, 1_000_003
PERTURB_SEED = 2_000_003


class BenchError(Exception):
    """Bad input: reported as one line, exit status 2."""


# --------------------------------------------------------------------------- problems


def load(path: str, size: Optional[Size] = None, shrink: int = 1):
    """The problem file as a module, checked to be a KernelBench problem, at `size` (batch,
    in_features, out_features; default the file's own) divided by `shrink` (problems.shrunk_size)."""
    if not Path(path).is_file():
        raise BenchError(f"no such problem file: {path}")
    try:
        module = load_problem(path)
    except Exception as exc:
        raise BenchError(f"{path}: cannot be imported: {exc!r}") from exc
    for name in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(module, name):
            raise BenchError(f"{path}: defines no {name} (a KernelBench problem needs Model, get_inputs, "
                             "get_init_inputs)")
    if size is not None or shrink > 1:
        try:
            resize_problem(module, shrunk_size(size or problem_size(module), shrink))
        except ProblemSizeError as exc:
            raise BenchError(f"{path}: {exc}") from exc
    return module


def problem_name(path: str, module, resized: bool) -> str:
    """The file's name; with the size it runs at when resized, so that no two sizes share a name."""
    name = Path(path).stem
    return sized_name(name, problem_size(module)) if resized else name


def perturb_parameters(model: torch.nn.Module, seed: int = PERTURB_SEED) -> torch.nn.Module:
    """Gives every parameter and batch-norm running statistic a value that a bug cannot hide behind,
    in place, from a seeded generator of its own (the same model gets the same values on any device;
    the global random state is not touched). A floating-point parameter or running mean gets Gaussian
    noise of half its mean magnitude (or of 0.5 where it is all zeros: a bias, BatchNorm's beta); a
    running variance is multiplied by exp(noise / 2), so it stays positive. Integer buffers (the
    batch counter) are left alone."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32).to(tensor.device, tensor.dtype)
            if name.endswith("running_var"):
                tensor.mul_(torch.exp(noise / 2))
            else:
                magnitude = tensor.abs().mean().item()
                tensor.add_(noise * 0.5 * (magnitude if magnitude > 0 else 1.0))
    return model


def build_model(module, mode: str, device: str) -> torch.nn.Module:
    """The problem's Model as every provider gets it: seeded initialization, perturbed parameters
    (perturb_parameters), on `device`, in training or eval mode."""
    torch.manual_seed(INIT_SEED)
    model = perturb_parameters(module.Model(*module.get_init_inputs()))
    return model.to(device).train(mode == "train")


def problem_inputs(module, device: str, seed: int = INPUT_SEED) -> list:
    """The problem's get_inputs() drawn under `seed`, on `device`."""
    torch.manual_seed(seed)
    return to_device(module.get_inputs(), device)


def model_and_inputs(path: str, mode: str, device: str = "cuda",
                     size: Optional[Size] = None) -> tuple[torch.nn.Module, list]:
    """A problem file's model (build_model) and inputs (problem_inputs), at `size` if given."""
    module = load(path, size)
    return build_model(module, mode, device), problem_inputs(module, device)


def to_device(values, device, dtype=None):
    return [v.to(device, dtype) if isinstance(v, torch.Tensor) and (dtype is None or v.is_floating_point())
            else v.to(device) if isinstance(v, torch.Tensor) else v for v in values]


# --------------------------------------------------------------------------- precision and providers


@contextlib.contextmanager
def precision_context(precision: str, device: str, backward: bool = False):
    """fp32 keeps PyTorch's default 'highest' matmul precision; tf32 allows TF32 everywhere. With
    `backward`, only the matmul precision, which a backward follows as much as a forward (a user who
    allows TF32 allows it for the whole step); autocast wraps forwards only, as PyTorch advises."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        if precision.endswith("-autocast") and not backward:
            dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
            with torch.autocast(device, dtype=dtype):
                yield
        else:
            yield
    finally:
        torch.set_float32_matmul_precision(previous)


def make_provider(name: str, model: torch.nn.Module) -> Callable:
    if name == "eager":
        return model
    start_compile_workers()
    if name == "inductor":
        return torch.compile(model)
    if name == "fusepass":
        return torch.compile(model, backend="fusepass")
    if name == "max-autotune":
        return torch.compile(model, mode="max-autotune-no-cudagraphs")
    if name == "inductor-cudagraphs":
        return _a_step_per_call(torch.compile(model, mode="reduce-overhead"), model)
    if name == "fusepass-cudagraphs":
        return _a_step_per_call(torch.compile(model, backend="fusepass", mode="reduce-overhead"), model)
    raise BenchError(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)}")


def start_compile_workers() -> None:
    """Providers compile in one process, whichever first: the compile workers are started as in a process
    that uses fusepass (its kernels launched statically; Inductor's own are either way), not as Inductor's
    backend would start them if it compiled first."""
    compile_workers.start()


def _a_step_per_call(compiled: Callable, model: torch.nn.Module) -> Callable:
    """A CUDA-graph model called the way a training loop calls it: each call begins a new step
    (torch.compiler.cudagraph_mark_step_begin), whose replay may overwrite the previous step's outputs,
    and first drops the previous step's gradients (as optimizer.zero_grad() does), which live in memory
    the backward's replay overwrites: accumulating into them fails (do_bench's warm-up calls keep them)."""
    def call(*inputs):
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        return compiled(*inputs)
    return call


def provider_call(fn: Callable, inputs: list, *, mode: str, precision: str, device: str, backward: bool = False,
                  upstream: Optional[torch.Tensor] = None) -> Callable[[], torch.Tensor]:
    """One call of a provider as the benchmark makes it: fn(*inputs) in `precision`, and with
    `backward` the backward of sum(out * upstream) (upstream 1 if not given). Eval without backward
    is inference and runs under no_grad; train runs with grad enabled, as a training step's forward does."""
    grad = backward or mode == "train"

    def call() -> torch.Tensor:
        with precision_context(precision, device), torch.set_grad_enabled(grad):
            out = fn(*inputs)
        if backward:
            with precision_context(precision, device, backward=True):
                (out.float() * (upstream if upstream is not None else 1.0)).sum().backward()
        return out

    return call


def training_step(fn: Callable, optimizer: torch.optim.Optimizer, inputs: list, precision: str, device: str) -> None:
    """One step of a training loop: the gradients dropped, fn(*inputs) in `precision`, the backward of
    out.sum(), the optimizer's step."""
    optimizer.zero_grad(set_to_none=True)
    with precision_context(precision, device):
        out = fn(*inputs)
    with precision_context(precision, device, backward=True):
        out.float().sum().backward()
    optimizer.step()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
