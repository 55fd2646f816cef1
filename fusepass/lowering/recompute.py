"""What a compiled training step rebuilds in its backward instead of saving: a chain's output.

A chain's backward reads its linear output and per-feature statistics (backward.py). Its output is read
again only by what follows: the next layer's weight gradient (an MLP's hidden layer is the next one's
input) or, with a single ReLU tail, the ReLU's mask. Saved, it is one more (N, F) tensor per chain held
from the forward to the backward, the one tensor a fused chain could hold less than Inductor's code for
the same layers. Rebuilt, it is one output pass in the backward (a read of y and a write of the output),
the kernel that made it in the forward, on the linear output and statistics that are saved anyway.

The rebuild is asked of the partitioner, which decides what the forward saves: a pass over the joint
graph (`joint_custom_pre_pass`, which Inductor runs before partitioning) tags the output pass's kernel,
its output and the buffer it writes with `CheckpointPolicy.MUST_RECOMPUTE`, the tag selective activation
checkpointing sets. Only where the op's body is traced are its kernels in that graph; an opaque call
(CPU, `FUSEPASS_OPAQUE`) saves its output as before. The softmax pass is left alone: its probabilities,
which its backward reads, would cost a second exponential pass to rebuild.

Only 16-bit outputs (autocast) are rebuilt. Measured on an H100, torchvision's MLP(1024, [4096, 4096,
256]) with BatchNorm1d, 4096 rows: under bf16 autocast the step's own peak fell from 206 to 179 MB; in
fp32 it stayed at 365-366 MB (the peak is in the backward, past the point where the rebuilt output is
made and held) while the step took 1.4% longer (5.867 -> 5.950 ms: two more passes over an (N, F)
tensor). In TF32 it fell from 332 to 301 MB, 0.91x Inductor's 329, while the step took 4% longer (2.10-2.14
-> 2.19-2.20 ms): short of issue 27's 0.9x and past its 2% (BENCHMARKS.md, tried and rejected).
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node
from torch.utils.checkpoint import CheckpointPolicy

from fusepass.lowering.normalize_kernels import normalize_kernel
from fusepass.lowering.schema import FLOAT16_DTYPES
from fusepass.lowering.tuning import source_hash

# The output pass's output pointer: the functional kernel call returns its copy under this name.
OUTPUT_ARGUMENT = "out_ptr"
REBUILT_DTYPES = FLOAT16_DTYPES
_BUFFER_FACTORIES = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                     torch.ops.aten.empty_like.default)


def rebuilt_outputs(graph: Graph) -> list[Node]:
    """Tags, in a joint forward-backward graph, every non-softmax output pass with a 16-bit output for
    recomputation; returns the tagged outputs (the nodes standing for the passes' output tensors)."""
    outputs = []
    for node in graph.find_nodes(op="call_function", target=triton_kernel_wrapper_functional):
        if kernel_side_table.get_kernel(node.kwargs["kernel_idx"]) is not normalize_kernel:
            continue
        output = _output_of(node)
        if output is None or getattr(output.meta.get("val"), "dtype", None) not in REBUILT_DTYPES:
            continue
        buffer = node.kwargs["kwargs"][OUTPUT_ARGUMENT]
        for tagged in (node, output, buffer if _is_own_buffer(buffer, node) else None):
            if tagged is not None:
                tagged.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        outputs.append(output)
    return outputs


def _output_of(kernel_call: Node) -> Optional[Node]:
    """The node that takes the output pointer's tensor out of the functional kernel call's results."""
    for user in kernel_call.users:
        if user.target is operator.getitem and user.args[1] == OUTPUT_ARGUMENT:
            return user
    return None


def _is_own_buffer(buffer: Any, kernel_call: Node) -> bool:
    """Whether `buffer` is an allocation made for this kernel alone: rebuilt with it, never saved."""
    return isinstance(buffer, Node) and buffer.target in _BUFFER_FACTORIES and set(buffer.users) == {kernel_call}


class RebuildChainOutputs(CustomGraphPass):
    """The joint-graph pass, after the user's own `joint_custom_pre_pass` if one is set. Its uuid keys
    Inductor's caches on fusepass's source (and the user's pass's uuid: None, uncacheable, if it has
    none)."""

    def __init__(self, user_pass: Optional[Any] = None):
        self.user_pass = user_pass

    def __call__(self, graph: Graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)
        rebuilt_outputs(graph)

    def uuid(self) -> Optional[Any]:
        if self.user_pass is None:
            return ("fusepass rebuilds chain outputs", source_hash())
        user_uuid = getattr(self.user_pass, "uuid", lambda: None)()
        return None if user_uuid is None else ("fusepass rebuilds chain outputs", source_hash(), user_uuid)
