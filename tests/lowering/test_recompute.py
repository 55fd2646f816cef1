"""The joint-graph pass that has the partitioner rebuild chains' outputs in the backward (recompute.py),
on graphs built by hand the way AOTAutograd's functionalization writes a traced op's kernels. What it
saves end to end is checked on a GPU (tests/test_memory.py): only there are the op's kernels traced."""

import operator

import torch
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional
from torch.fx import Graph
from torch.utils.checkpoint import CheckpointPolicy

from fusepass.lowering.normalize_kernels import normalize_kernel, normalize_softmax_kernel
from fusepass.lowering.recompute import RebuildChainOutputs, rebuilt_outputs

aten = torch.ops.aten


def add_output_pass(graph: Graph, kernel, y, buffer, dtype=torch.bfloat16) -> dict:
    """A functional call of an output-pass kernel reading y and writing `buffer`, with its results taken
    out by name: {"call", "out", "mean"} nodes, the output of `dtype` (in its meta, as traced)."""
    call = graph.call_function(triton_kernel_wrapper_functional, kwargs=dict(
        kernel_idx=kernel_side_table.add_kernel(kernel), constant_args_idx=0, grid=[(1, 1, 1)],
        tma_descriptor_metadata={}, kwargs={"y_ptr": y, "out_ptr": buffer, "mean_ptr": y},
        tensors_to_clone=["out_ptr", "mean_ptr"]))
    out = graph.call_function(operator.getitem, (call, "out_ptr"))
    out.meta["val"] = torch.empty(37, 19, dtype=dtype, device="meta")
    return {"call": call, "out": out, "mean": graph.call_function(operator.getitem, (call, "mean_ptr"))}


def tag(node) -> object:
    return node.meta.get("recompute")


def test_the_output_pass_its_output_and_its_own_buffer_are_tagged_for_recomputation():
    graph = Graph()
    y = graph.placeholder("y")
    buffer = graph.call_function(aten.empty.memory_format, ([37, 19],), {"dtype": torch.float32})
    output_pass = add_output_pass(graph, normalize_kernel, y, buffer)
    graph.output((output_pass["out"], output_pass["mean"]))
    assert rebuilt_outputs(graph) == [output_pass["out"]]
    for node in (output_pass["call"], output_pass["out"], buffer):
        assert tag(node) == CheckpointPolicy.MUST_RECOMPUTE
    # the statistics it also writes are saved (F values), not rebuilt with an (N, F) pass; its input too
    assert tag(output_pass["mean"]) is None and tag(y) is None


def test_softmax_passes_fp32_outputs_and_shared_buffers_are_left_alone():
    graph = Graph()
    y = graph.placeholder("y")
    shared = graph.call_function(aten.empty.memory_format, ([37, 19],), {"dtype": torch.float32})
    softmax = add_output_pass(graph, normalize_softmax_kernel, y, shared)
    output_pass = add_output_pass(graph, normalize_kernel, y, shared)  # a buffer another kernel also writes
    fp32_output_pass = add_output_pass(graph, normalize_kernel, y, y, dtype=torch.float32)
    graph.output((softmax["out"], output_pass["out"], fp32_output_pass["out"]))
    assert rebuilt_outputs(graph) == [output_pass["out"]]
    assert tag(softmax["call"]) is None and tag(softmax["out"]) is None
    assert tag(shared) is None
    assert tag(fp32_output_pass["call"]) is None and tag(fp32_output_pass["out"]) is None


def test_the_pass_runs_the_users_pass_first_and_keys_caches_on_both():
    graph = Graph()
    y = graph.placeholder("y")
    output_pass = add_output_pass(graph, normalize_kernel, y, y)
    graph.output(output_pass["out"])
    tags_seen_by_user_pass = []

    class UserPass:
        def __call__(self, graph):
            tags_seen_by_user_pass.append(tag(output_pass["out"]))

        def uuid(self):
            return "user's"

    combined = RebuildChainOutputs(UserPass())
    combined(graph)
    assert tags_seen_by_user_pass == [None] and tag(output_pass["out"]) == CheckpointPolicy.MUST_RECOMPUTE
    assert combined.uuid()[-1] == "user's" and RebuildChainOutputs().uuid() != combined.uuid()
    assert RebuildChainOutputs(lambda graph: None).uuid() is None  # a user's pass without uuid: uncacheable
