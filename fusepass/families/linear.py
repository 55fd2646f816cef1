"""The linear step both families share: `nn.Linear` / `F.linear`, or a matmul head `x @ W`, its
arguments normalized; and the checks of a tensor fusepass can fuse at all."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from fusepass.matcher import NoMatch, bind_arguments, is_call, meta_value, under_autocast

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_DEVICES = ("cpu", "cuda")

LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
MATMUL_TARGETS = (operator.matmul, torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm)


@dataclass(frozen=True)
class LinearArgs:
    x: Node
    weight: Node  # (out, in) for a linear; (in, out) for a matmul head (weight_in_out)
    bias: Optional[Node]
    weight_in_out: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return ("matmul",) if self.weight_in_out else ("linear",)


def check_tensor(node: Node, what: str, ndim: Optional[int] = None) -> torch.Tensor:
    value = meta_value(node)
    if not isinstance(value, torch.Tensor):
        raise NoMatch(f"{what} `{node.name}` has no recorded tensor metadata")
    if ndim is not None and value.dim() != ndim:
        raise NoMatch(f"{what} `{node.name}` is {value.dim()}-D; only {ndim}-D is fused")
    if value.dtype not in SUPPORTED_DTYPES:
        raise NoMatch(f"{what} `{node.name}` has dtype {value.dtype}; fused dtypes are float32, bfloat16, float16")
    if value.device.type not in SUPPORTED_DEVICES:
        raise NoMatch(f"{what} `{node.name}` is on {value.device.type}; fused devices are cpu and cuda")
    return value


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scale_like(operand: Any, n_features: int) -> bool:
    if is_number(operand):
        return True
    value = meta_value(operand)
    return (
        isinstance(value, torch.Tensor)
        and value.dtype in SUPPORTED_DTYPES
        and tuple(value.shape) in ((n_features,), (1,), ())
    )


def parse_linear(node: Node) -> list[tuple[LinearArgs, Optional[Node]]]:
    args = bind_arguments(node, ("input", "weight", "bias"), {"bias": None})
    check_tensor(args["input"], "linear input", ndim=2)
    check_tensor(node, "linear output", ndim=2)
    linear = LinearArgs(args["input"], args["weight"], args["bias"])
    check_operand_dtypes(node, linear)
    return [(linear, None)]


def check_operand_dtypes(node: Node, args: LinearArgs) -> None:
    """Outside autocast, eager's linear and matmul refuse operands of different dtypes; the fused op casts
    them to the linear's dtype as autocast would, so such a call is left to eager's error."""
    dtypes = {meta_value(n).dtype for n in (args.x, args.weight, args.bias) if isinstance(meta_value(n), torch.Tensor)}
    if len(dtypes) > 1 and not under_autocast(node):
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise NoMatch(f"`{node.name}` multiplies {names} operands outside autocast: eager raises, and so will it")


def parse_head(node: Node) -> list[tuple[LinearArgs, Optional[Node]]]:
    """A linear, or a matmul of a 2-D input by a 2-D weight in (in, out) layout (x @ W)."""
    if is_call(node, LINEAR_TARGETS):
        return parse_linear(node)
    args = bind_arguments(node, ("input", "other"), {})
    check_tensor(args["input"], "matmul input", ndim=2)
    check_tensor(args["other"], "matmul weight", ndim=2)
    check_tensor(node, "matmul output", ndim=2)
    head = LinearArgs(args["input"], args["other"], None, weight_in_out=True)
    check_operand_dtypes(node, head)
    return [(head, None)]
