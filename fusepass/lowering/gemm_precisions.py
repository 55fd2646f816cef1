"""The Triton GEMM's precisions (gemm.py's PRECISION), and the fp32 ones that read one operand prepared once
in memory: split into tf32 hi + lo for 3xTF32 (split_w, split_x), or rounded to tf32 for TF32 (round_w,
round_x).

Why prepare an operand: wgmma reads its second operand from shared memory only. An operand split or
rounded in registers has to go back to shared memory every K block, and the compiler then waits for
each wgmma before the next (sm_90 PTX from triton 3.6: `wgmma.wait_group 0` only). Rounded once in
memory, the operand goes straight from its TMA load to the tensor cores, the other is rounded in
registers as the first operand, and the wgmmas pipeline (`wait_group 3` in the PTX of a TF32 loop). The
prepared operand is the smaller of the two: the copy costs a read and a write of it each call (splitting
W, the larger, cost up to 13% of a 3xTF32 GEMM: 0.20 ms at 1024 x 8192 -> 8192 on an H200). prepare_operands
makes the prepared operand (tf32_split.py's kernel), into a workspace a GEMM in blocks reuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton.language as tl
from torch import Tensor

from fusepass.lowering.tf32_split import round_tf32, split_buffer, split_tf32

# The kernel's modes (PRECISION), gemm.py's docstring says what each multiplies.
NATIVE = tl.constexpr(0)
TF32 = tl.constexpr(1)
TF32X3 = tl.constexpr(2)
SPLIT_W = tl.constexpr(3)
SPLIT_X = tl.constexpr(4)
ROUND_W = tl.constexpr(5)
ROUND_X = tl.constexpr(6)
CAST_W = tl.constexpr(7)
PRECISIONS = {"native": NATIVE, "tf32": TF32, "tf32x3": TF32X3, "split_w": SPLIT_W, "split_x": SPLIT_X,
              "round_w": ROUND_W, "round_x": ROUND_X, "cast_w": CAST_W}


@dataclass(frozen=True)
class Prepared:
    """Which operand a precision prepares in memory, and into how many tf32 parts."""
    operand: str  # "x" or "weight"
    parts: int  # 2: hi + lo (3xTF32's three products); 1: hi alone, the operand rounded to tf32


PREPARED = {
    "split_w": Prepared("weight", 2), "split_x": Prepared("x", 2),
    "round_w": Prepared("weight", 1), "round_x": Prepared("x", 1),
}
PRE_SPLIT = tuple(p for p, how in PREPARED.items() if how.parts == 2)

# Each fp32 precision's variants that prepare x or W: (x's, W's).
_VARIANTS = {"tf32x3": ("split_x", "split_w"), "tf32": ("round_x", "round_w")}


def prepared(precision: str) -> Optional[Prepared]:
    return PREPARED.get(precision)


def variants(precision: str) -> tuple[str, ...]:
    """The variants of an fp32 precision ("tf32", "tf32x3") that prepare x or W; none for others."""
    return _VARIANTS.get(precision, ())


def preparing_weight(precision: str) -> str:
    """The variant that prepares W as `precision` prepares its operand (the same parts)."""
    return next(p for p, how in PREPARED.items() if how.operand == "weight" and how.parts == PREPARED[precision].parts)


def prepares(precision: str, operand: str) -> bool:
    """Whether the precision reads `operand` ("x" or "weight") prepared in memory."""
    how = PREPARED.get(precision)
    return how is not None and how.operand == operand


def prepared_variant(precision: str, x_elements: int, weight_elements: int, weight_k_major: bool = True
                     ) -> Optional[str]:
    """The variant of `precision` that prepares an operand in memory, or None if it has none: the smaller
    operand's, unless W is not K-major (a backward's W^T, given weight_k_major=False by the linear op,
    whose copies of W run in bounded blocks): tensor cores would read a K-major copy of it anyway, which
    its preparation makes in the same pass (H100, dX of 1024 x 8192 -> 8192 in TF32: 0.677 ms with W
    rounded, x rounded and W copied not among the eight fastest). The chain op keeps the smaller operand
    for a matmul head's W^T: it copies W whole, and W split in two would hold twice its size."""
    if precision not in _VARIANTS:
        return None
    of_x, of_weight = _VARIANTS[precision]
    return of_x if weight_k_major and x_elements < weight_elements else of_weight


def kernel_precision(precision: str, x_dtype: torch.dtype) -> int:
    """The kernel's PRECISION: 16-bit operands multiply natively, unless W is cast in the kernel."""
    return (PRECISIONS[precision] if x_dtype == torch.float32 or precision == "cast_w" else NATIVE).value


# Buffers for an operand prepared in memory: its tf32 hi, and its lo where split
Workspace = tuple[Tensor, Optional[Tensor]]


def prepare_operands(x: Tensor, weight: Tensor, precision: str,
                     workspace: Optional[Workspace] = None) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(x, weight, lo) as the kernel reads them: the operand the precision prepares in memory replaced by
    its tf32 hi, and lo its low half where split (else None), in buffers k columns wide or a little more
    (`workspace`'s, if given: its first rows). Made after the other operand exists (split_tf32's
    `after`): in a backward, after the gradient."""
    how = prepared(precision)
    if how is None:
        return x, weight, None
    of_x = how.operand == "x"
    hi, lo = prepare_operand(x if of_x else weight, weight if of_x else x, precision, workspace)
    return (hi, weight, lo) if of_x else (x, hi, lo)


def prepare_operand(operand: Tensor, other: Tensor, precision: str,
                    workspace: Optional[Workspace] = None) -> tuple[Tensor, Optional[Tensor]]:
    """(hi, lo or None): `operand`, the one `precision` prepares, split (rounded) as prepare_operands says,
    after `other`, the GEMM's other operand."""
    if prepared(precision).parts == 2:
        return split_tf32(operand, other, workspace)
    return round_tf32(operand, other, workspace[0] if workspace else None), None


def workspace(precision: str, rows: int, cols: int, like: Tensor) -> Optional[Workspace]:
    """Buffers for `rows` rows of the operand `precision` prepares in memory (hi, and lo where split), which
    the launches of one GEMM in blocks reuse: one block's copies at a time, whatever order a compiled graph
    gives their allocations. None where the precision prepares nothing."""
    how = prepared(precision)
    if how is None:
        return None
    return split_buffer(rows, cols, like), split_buffer(rows, cols, like) if how.parts == 2 else None
