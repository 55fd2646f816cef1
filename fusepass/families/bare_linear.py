"""The family `linear` alone: a 2-D fp32 linear that no chain took (an MLP's last layer, a classifier
head), replaced by `torch.ops.fusepass.linear` (fusepass/lowering/linear.py), so that its forward and
its backward's two GEMMs run on the 3xTF32 Triton GEMM where that is faster than cuBLAS's fp32 FMA (the
op times both and keeps the faster; its error to float64 is below eager's either way).

Only where eager's linear is fp32 FMA: fp32 with TF32 disallowed (torch's default). A bf16, fp16 or
autocast linear, or an fp32 one under TF32, runs on cuBLAS at the precision eager uses, which is what
Inductor runs too; those are left alone and explain() says so. The backend option `bare_linear=False`
turns the family off.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from fusepass.lowering.schema import KernelOptions
from fusepass.families.linear import LINEAR_TARGETS, LinearArgs, parse_linear
from fusepass.matcher import ChainFamily, Match, NoMatch, Step, carry_sources, meta_value

FUSED_OP = torch.ops.fusepass.linear.default


def parse_bare_linear(node: Node) -> list[tuple[LinearArgs, Optional[Node]]]:
    """The chain family's linear step, where eager's linear is plain fp32."""
    [(args, chain_input)] = parse_linear(node)
    dtype = meta_value(node).dtype
    if dtype != torch.float32:
        raise NoMatch(f"`{node.name}` is a {str(dtype).removeprefix('torch.')} linear: cuBLAS at eager's "
                      "precision already; left to Inductor")
    if meta_value(args.x).dtype != torch.float32:
        raise NoMatch(f"`{node.name}`: the linear's input is not float32")
    if torch.backends.cuda.matmul.allow_tf32:
        raise NoMatch(f"`{node.name}`: TF32 is allowed, so the fp32 linear runs on cuBLAS's TF32 as in eager; "
                      "left to Inductor")
    return [(args, chain_input)]


LINEAR = Step("linear", "linear", LINEAR_TARGETS, parse_bare_linear)


def replace(graph: Graph, match: Match, replaced: dict[Node, Node], kernel: KernelOptions) -> Node:
    lin, last = match.get("linear"), match.last
    x = replaced.get(lin.x, lin.x)
    with graph.inserting_before(last):
        out = graph.call_function(FUSED_OP, (x, lin.weight, lin.bias, kernel.fp32_matmul, kernel.gemm, None,
                                             kernel.operand_copies, kernel.cuda_graphs))
    out.meta.update(last.meta)
    carry_sources([out], match.nodes)
    last.replace_all_uses_with(out)
    graph.erase_node(last)
    return out


def describe(match: Match) -> dict[str, Any]:
    lin = match.get("linear")
    return {"shapes": {"x": _shape(lin.x), "weight": _shape(lin.weight), "out": _shape(match.last)},
            "dtypes": {"x": "float32", "linear": "float32", "out": "float32"}, "training": None,
            "tail": "-"}


def _shape(node: Node) -> tuple:
    return tuple(meta_value(node).shape)


FAMILY = ChainFamily(head=(), anchor=LINEAR, tail=(), replace=replace, describe=describe, counter="linears")
