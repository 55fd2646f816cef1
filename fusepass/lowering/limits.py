"""What a launch of the fused kernels needs of its call, checked on every call before anything launches.

Each check returns None when the call can run, else the reason it cannot. A call that cannot run on the
Triton kernels runs the unfused math instead (reference.py for the chain, cuBLAS for the linear op):
eager's results, never a failed launch or a wrong offset.

- Devices: every tensor the kernels read lives on the device of x. Eager lets a 0-d CPU tensor join a
  CUDA op; a kernel given its host pointer fails ("CUDA driver error: invalid argument" from Inductor's
  static launcher).
- Rows: at least one. The GEMM wraps row indices modulo the row count; the linear op's Triton GEMM also
  needs an output of at least one column and a reduction of at least one element (a 0-row batch's weight
  gradient has none), and sizes its blocks by them.
- Grids: the passes and the split launch 2-D grids whose second dimension covers the columns in blocks of
  64, and CUDA allows at most 65535 there.
- TMA: a descriptor needs Hopper or newer, a contiguous last dimension and 16-byte aligned base and row
  stride: checked on the call's own tensors, since a choice made for one call serves others of the same
  shape whose storage may start elsewhere.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch
import triton
from torch import Tensor
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import is_fake

log = logging.getLogger(__name__)

MAX_GRID_Y = 65535
COLUMN_BLOCK = 64  # the widest column block of a 2-D grid's second dimension (normalize.py, tf32_split.py)


def off_device(device: torch.device, tensors: Iterable[Optional[Tensor]]) -> Optional[str]:
    for t in tensors:
        if t is not None and t.device != device:
            return f"a {tuple(t.shape)} operand is on {t.device}, the call on {device}"
    return None


def some_rows(n_rows: int) -> Optional[str]:
    return None if n_rows > 0 else "no rows"


def column_grid(n_cols: int) -> Optional[str]:
    if triton.cdiv(n_cols, COLUMN_BLOCK) > MAX_GRID_Y:
        return f"{n_cols} columns need more than {MAX_GRID_Y} blocks of {COLUMN_BLOCK} in a grid's 2nd dimension"
    return None


def k_major(t: Tensor) -> bool:
    """Whether a 2-D operand's rows are contiguous (a GEMM's K-major operand, as TMA and TF32 tensor cores
    read it)."""
    return t.stride(1) == 1 or t.shape[1] == 1


def tma_layout(*tensors: Tensor, device: Optional[torch.device] = None) -> Optional[str]:
    """What TMA descriptors need of their tensors, made on the host or inside a kernel: Hopper (`device`'s,
    else the first tensor's), a contiguous last dimension, a 16-byte aligned row stride and start offset,
    and the address where it is known (traced, it is not yet; Inductor's buffers and the graph inputs it
    has checked start 16-byte aligned)."""
    device = device or tensors[0].device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return "TMA needs Hopper or newer"
    for t in tensors:
        if t.dim() != 2 or not k_major(t):
            return f"a TMA operand of strides {t.stride()} has no contiguous last dimension"
        if (t.stride(0) * t.element_size()) % 16 or (t.storage_offset() * t.element_size()) % 16:
            return "a TMA operand's row stride or offset is not 16-byte aligned"
        if not is_fake(t) and t.data_ptr() % 16:
            return "a TMA operand's address is not 16-byte aligned"
    return None


def first(*reasons: Optional[str]) -> Optional[str]:
    return next((r for r in reasons if r), None)


def record_unlaunchable(op_name: str, why: str) -> None:
    """Counts a call that runs the unfused math (counters["fusepass"]["unlaunchable"]: per call where the
    op runs opaquely, per compile where its body is traced) and logs why, once per reason."""
    counters["fusepass"]["unlaunchable"] += 1
    if why not in _LOGGED:
        _LOGGED.add(why)
        log.info("fusepass: %s runs unfused for a call: %s", op_name, why)


_LOGGED: set[str] = set()
