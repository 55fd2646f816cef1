"""How the fused ops' bodies launch Triton kernels, both when they run and when torch.compile traces them.

A `torch.library.triton_op` body runs twice in a compiled model's life: traced (fake tensors, under
AOTAutograd's functionalization) and, in eager use, for real. Traced, every kernel must be called through
`wrap_triton`, so that Inductor sees it and launches it from its generated code (its launcher costs a
fraction of Triton's Python one). For real, the plain kernel is the cheapest call.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch._inductor.inductor_prims  # noqa: F401  (defines prims.inductor_force_stride_order)
from torch._library.triton import set_wrap_triton_enabled
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.library import wrap_triton
from torch.utils._python_dispatch import _disable_current_modes

# Set (to anything) to keep fusepass's ops opaque to torch.compile on CUDA too (for comparisons). Read
# inside the op's traced body, which Inductor's cache keys do not cover: options.py adds it to them.
OPAQUE_ENV = "FUSEPASS_OPAQUE"
_MODE_KEYS = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.PROXY,
              torch._C._TorchDispatchModeKey.FUNCTIONAL)


def hint(size) -> int:
    """A size as an int: itself, or a symbolic size's hint (the value it has in the call being traced),
    read without a guard, so that a decision made from it does not specialize the graph."""
    if isinstance(size, int):
        return size
    node = size.node
    return int(node.hint) if node.has_hint() else int(node.shape_env.size_hint(node.expr))


def ceil_div(a, b: int):
    """triton.cdiv's formula, for ints and SymInts, without its cost: triton.cdiv is a Triton constexpr
    function (a few microseconds a call), too dear on the host path of an op that runs on every step."""
    return (a + b - 1) // b


def tracing() -> bool:
    """Whether a dispatch mode (fake tensors, functionalization, FX tracing, a user's mode) is active,
    i.e. the tensors reaching a kernel may not be real device memory."""
    return torch._C._len_torch_dispatch_stack() > 0 or any(
        torch._C._get_dispatch_mode(key) is not None for key in _MODE_KEYS)


def launch(kernel):
    """`kernel`, ready for `[grid](...)`: wrapped for tracing while tracing, else itself."""
    return wrap_triton(kernel) if tracing() else kernel


def stored(t: torch.Tensor) -> torch.Tensor:
    """t, stored once by a compiled graph, in a buffer of t's own strides, before kernels read it (eager:
    t itself). Inductor passes a Triton kernel each tensor argument at its traced strides (its default
    layout constraint for user kernels), and copies a value it has not stored yet into a new buffer for
    every argument it is passed as. A backward's (N, F) gradient that only GEMM kernels read was copied
    once per block kernel: eight copies for a weight gradient in four blocks (split kernel and GEMM each),
    all made before the first GEMM (a swish chain, 1024 x 8192 -> 8192, fp32, on an H100)."""
    # Eager, the prim would also cut a double backward (it has no autograd formula).
    return torch.ops.prims.inductor_force_stride_order(t, t.stride()) if tracing() else t


def unused_pointer(device) -> torch.Tensor:
    """What a kernel gets for an absent optional tensor it never touches: an empty tensor of its own.
    Not one of the call's other tensors: traced, a tensor passed in several slots of which the kernel
    writes one is cloned by Inductor into each (seen in its generated code for a softmax chain: three
    F-sized copies, one more launch per call)."""
    return torch.empty(0, device=device, dtype=torch.float32)


def present_or_placeholder(tensor, placeholder: torch.Tensor) -> torch.Tensor:
    """An optional tensor argument as a kernel takes it: the tensor, or the placeholder when absent."""
    return tensor if tensor is not None else placeholder


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Leaves tracing for a moment: tensors made inside are real and kernels launch for real. Used to
    time implementations on stand-in inputs while an op is being traced."""
    with _disable_current_modes(), unset_fake_temporarily(), set_wrap_triton_enabled(False), torch.no_grad():
        yield
