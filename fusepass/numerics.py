"""The project's correctness criterion: no further from a float64 reference than eager PyTorch is."""

import torch

# A result's relative error to float64 may exceed eager's by this factor, plus a floor of a few units of
# fp32 roundoff (reductions accumulate in fp32; two equally exact summation orders land a few ulps
# apart). The floor is far below eager's own error for bf16/fp16 results.
SLACK = 1.5
FLOOR = 4 * torch.finfo(torch.float32).eps


def rel_error(value: torch.Tensor, ref: torch.Tensor) -> float:
    """||value - ref|| / ||ref||, in float64."""
    ref = ref.double()
    return ((value.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def no_further_than_eager(error: float, eager_error: float) -> bool:
    return error <= SLACK * eager_error + FLOOR
