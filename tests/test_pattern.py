"""The matcher and the rewrite on Dynamo graphs: ops before/after and exact match counts."""

import operator
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusepass.backend import mutated_input_positions
from fusepass.families import linear_batch_norm
from fusepass.families.linear_batch_norm import FUSED_OP
from fusepass.lowering.schema import KernelOptions
from fusepass.matcher import find_chains
from fusepass.options import Options
from fusepass.rewrite import apply
from tests.chains import Between, ChainModel, SecondUser, ThreeD, TwoChains, make_input

# The chain family alone: what these tests match and count (tests/test_bare_linear.py has the linears
# a chain leaves over).
CHAINS = (linear_batch_norm.FAMILY,)


def rewrite(gm, kernel=KernelOptions(), families=CHAINS):
    """The backend's find and apply stages on gm: (matches, misses)."""
    matches, misses = find_chains(gm.graph, families)
    apply(gm, matches, kernel)
    return matches, misses


def dynamo_graphs(model, *inputs):
    """The FX graphs Dynamo hands a backend for model(*inputs), as the backend sees them: with each input's
    `grapharg` (its source), which Dynamo drops from the nodes once the backend has returned."""
    graphs, graph_args = [], {}

    def capture(gm, _example_inputs):
        graphs.append(gm)
        graph_args.update({n: n.meta["grapharg"] for n in gm.graph.nodes if "grapharg" in n.meta})
        return gm.forward

    torch.compile(model, backend=capture)(*inputs)
    for node, graph_arg in graph_args.items():
        node.meta["grapharg"] = graph_arg
    return graphs


def single_graph(model, *inputs):
    [gm] = dynamo_graphs(model, *inputs)
    return gm


def count_calls(gm, targets):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def count_methods(gm, name):
    return sum(1 for n in gm.graph.nodes if n.op == "call_method" and n.target == name)


@pytest.mark.parametrize("kwargs", [
    {}, {"bias": False}, {"scale_first": True}, {"torch_mul": True}, {"scale": "single"},
    {"scale": "zero_dim", "torch_mul": True, "scale_first": True}, {"scale": "number"},
    {"affine": False}, {"track_running_stats": False},
])
@pytest.mark.parametrize("training", [True, False])
def test_rewrite_replaces_the_chain(kwargs, training):
    model = ChainModel(**kwargs).train(training)
    gm = single_graph(model, make_input(8, 32))
    assert count_calls(gm, (F.batch_norm,)) == 1

    matches, misses = rewrite(gm, families=CHAINS)

    assert [m.pattern for m in matches] == ["linear_scale_batch_norm"] and misses == []
    assert count_calls(gm, (FUSED_OP,)) == 1
    assert count_calls(gm, (torch._C._nn.linear, F.batch_norm, operator.mul, torch.mul)) == 0
    updates_stats = model.bn.track_running_stats and training
    # Both running statistics and the incremented counter are stored by one foreach copy (one kernel under
    # Inductor); the counter's add_ is gone.
    [store] = [n for n in gm.graph.nodes if n.target is torch._foreach_copy_] if updates_stats else [None]
    assert count_calls(gm, (torch._foreach_copy_,)) == (1 if updates_stats else 0)
    assert count_methods(gm, "copy_") == 0 and count_methods(gm, "add_") == 0
    if store is not None:
        assert [re.sub(r".*buffers_|_$", "", n.name) for n in store.args[0]] == [
            "running_mean", "running_var", "num_batches_tracked"]
    # What the backend restores if the fused graph's first call fails: the buffers both calls write.
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    restored = sorted(re.sub(r".*buffers_|_$", "", placeholders[i]) for i in mutated_input_positions(gm))
    assert restored == (["num_batches_tracked", "running_mean", "running_var"] if updates_stats else [])


def test_python_number_and_tensor_scale_are_normalized():
    gm = single_graph(ChainModel(scale="number"), make_input(8, 32))
    [match], _ = find_chains(gm.graph, CHAINS)
    assert match.get("scale_before").scale == pytest.approx(1.7)
    gm = single_graph(ChainModel(scale="single", scale_first=True), make_input(8, 32))
    [match], _ = find_chains(gm.graph, CHAINS)
    assert match.get("scale_before").scale.op == "placeholder"
    assert match.get("linear").bias is not None and match.get("batch_norm").training is True


def test_two_chains_two_rewrites():
    gm = single_graph(TwoChains(), make_input(8, 32))
    matches, misses = rewrite(gm, families=CHAINS)
    assert len(matches) == 2 and misses == []
    assert count_calls(gm, (FUSED_OP,)) == 2


@pytest.mark.parametrize("reuse, node", [("linear", "y"), ("scaled", "z")])
def test_intermediate_with_second_user_is_left_alone(reuse, node):
    gm = single_graph(SecondUser(reuse), make_input(8, 32))
    before = gm.code
    matches, [miss] = rewrite(gm, families=CHAINS)
    assert matches == [] and gm.code == before
    assert f"intermediate `{node}` has other users" in miss.reason


@pytest.mark.parametrize("op, reason", [
    ("relu", "expected linear, found `relu`"),
    ("add", "`add` is not a matmul's output plus a bias"),
    ("full_tensor_scale", "multiplies by something other than"),
])
def test_chains_that_must_not_be_rewritten(op, reason):
    gm = single_graph(Between(op), make_input(8, 32))
    matches, [miss] = rewrite(gm, families=CHAINS)
    assert matches == [] and count_calls(gm, (FUSED_OP,)) == 0
    assert reason in miss.reason, miss.reason


def test_unsupported_dtype_is_left_alone_with_reason():
    gm = single_graph(ChainModel().double(), make_input(8, 32).double())
    matches, [miss] = rewrite(gm, families=CHAINS)
    assert matches == [] and "float64" in miss.reason


def test_three_d_input_is_left_alone():
    gm = single_graph(ThreeD(), torch.randn(3, 4, 32))
    matches, [miss] = rewrite(gm, families=CHAINS)
    assert matches == [] and "3-D" in miss.reason


# --------------------------------------------------------------------------- the whole family

MEMBERS = {
    "linear_batch_norm": dict(scale=None),
    "linear_scale_batch_norm": dict(),
    "linear_batch_norm_mul": dict(scale=None, scale_after="single"),
    "linear_batch_norm_softmax": dict(scale=None, softmax="module"),
    "linear_batch_norm_mul_softmax": dict(scale=None, scale_after="single", softmax="module"),
    "linear_scale_batch_norm_mul": dict(scale_after="per_feature"),
    "linear_scale_batch_norm_softmax": dict(scale="number", softmax="functional"),
    "linear_scale_batch_norm_mul_softmax": dict(scale="zero_dim", scale_after="number", softmax="method"),
}


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("member", MEMBERS)
def test_every_family_member_becomes_one_fused_op(member, training):
    gm = single_graph(ChainModel(**MEMBERS[member]).train(training), make_input(8, 32))
    matches, misses = rewrite(gm, families=CHAINS)
    assert [m.pattern for m in matches] == [member] and misses == []
    assert count_calls(gm, (FUSED_OP,)) == 1
    leftovers = (torch._C._nn.linear, F.batch_norm, operator.mul, torch.mul, F.softmax, torch.softmax)
    assert count_calls(gm, leftovers) == 0 and count_methods(gm, "softmax") == 0
    [fused] = [n for n in gm.graph.nodes if n.target is FUSED_OP]
    assert op_arguments(fused)["softmax"] is ("softmax" in member)
    assert (op_arguments(fused)["kernel_fp32_matmul"], op_arguments(fused)["kernel_gemm"]) == ("tf32x3", "auto")


def op_arguments(node):
    return dict(zip([a.name for a in FUSED_OP._schema.arguments], node.args))


def test_kernel_options_become_op_arguments():
    gm = single_graph(ChainModel(), make_input(8, 32))
    rewrite(gm, KernelOptions(fp32_matmul="ieee", gemm="cublas", operand_copies=False, cuda_graphs=True), CHAINS)
    [fused] = [n for n in gm.graph.nodes if n.target is FUSED_OP]
    arguments = op_arguments(fused)
    assert (arguments["kernel_fp32_matmul"], arguments["kernel_gemm"], arguments["kernel_operand_copies"],
            arguments["kernel_cuda_graphs"]) == ("ieee", "cublas", False, True)


@pytest.mark.parametrize("x_grad", [False, True])
def test_the_op_is_told_whether_x_gets_a_gradient(x_grad):
    """input_grad follows x's requires_grad in the captured graph: a first layer's input (data) has none,
    and its op keeps no cast of W for a dX GEMM; the output's own need of a backward is save_linear_out."""
    gm = single_graph(ChainModel().train(), make_input(8, 32).requires_grad_(x_grad))
    rewrite(gm)
    [fused] = [n for n in gm.graph.nodes if n.target is FUSED_OP]
    arguments = op_arguments(fused)
    assert arguments["input_grad"] is x_grad and arguments["save_linear_out"] is True


@pytest.mark.parametrize("mode, options, cuda_graphs", [
    (None, {}, False), ("reduce-overhead", {}, True), ("max-autotune", {}, True),
    ("max-autotune-no-cudagraphs", {}, False), (None, {"triton.cudagraphs": True}, True)])
def test_the_kernel_options_know_whether_the_graph_runs_from_cuda_graphs(mode, options, cuda_graphs):
    assert Options.parse(mode, dict(options)).kernel.cuda_graphs is cuda_graphs


@pytest.mark.parametrize("spelling", ["module", "functional", "torch", "method", "dtype"])
def test_softmax_spellings(spelling):
    gm = single_graph(ChainModel(scale=None, scale_after="single", softmax=spelling), make_input(8, 32))
    [match], misses = rewrite(gm, families=CHAINS)
    assert match.pattern == "linear_batch_norm_mul_softmax" and misses == []


def test_softmax_over_batch_dim_is_left_out_with_reason():
    gm = single_graph(ChainModel(scale=None, scale_after="single", softmax="dim0"), make_input(8, 32))
    [match], [miss] = rewrite(gm, families=CHAINS)
    assert match.pattern == "linear_batch_norm_mul"
    assert "softmax over dim 0" in miss.reason
    assert count_calls(gm, (F.softmax,)) == 1 and count_calls(gm, (FUSED_OP,)) == 1


class TailWithSecondUser(nn.Module):
    """An intermediate of the tail is used twice: the chain stops before it is consumed."""

    def __init__(self, reused):
        super().__init__()
        self.linear, self.bn, self.reused = nn.Linear(32, 48), nn.BatchNorm1d(48), reused
        self.scale = nn.Parameter(torch.randn(1))

    def forward(self, x):
        b = self.bn(self.linear(x))
        u = b * self.scale
        extra = b if self.reused == "batch_norm" else u
        return torch.softmax(u, dim=1) + extra


@pytest.mark.parametrize("reused, pattern, reason", [
    ("batch_norm", "linear_batch_norm", "`b` would keep a user outside it"),
    ("scaled", "linear_batch_norm_mul", "not fused after `u`: it has other users")])
def test_tail_stops_at_an_intermediate_with_another_user(reused, pattern, reason):
    """Also a miss for the add of two full tensors, which is no tail step."""
    gm = single_graph(TailWithSecondUser(reused), make_input(8, 32))
    [match], misses = rewrite(gm, families=CHAINS)
    assert match.pattern == pattern and count_calls(gm, (FUSED_OP,)) == 1
    assert sorted(m.node.name for m in misses) == sorted(["add", "u" if reused == "batch_norm" else "softmax"])
    assert any(reason in m.reason for m in misses), [m.reason for m in misses]
    assert any("only numbers and tensors of shape" in m.reason for m in misses)


class DropoutBetween(nn.Module):
    """Linear -> Dropout -> [* s ->] BatchNorm1d (PointNet's classifier: bn(dropout(fc(x)))), or the
    dropout right after the linear and a scale after it."""

    def __init__(self, p: float, where: str):
        super().__init__()
        self.linear, self.dropout, self.bn, self.where = nn.Linear(32, 48), nn.Dropout(p), nn.BatchNorm1d(48), where

    def forward(self, x):
        y = self.linear(x)
        if self.where == "before_scale":
            return self.bn(self.dropout(y) * 2.0)
        return self.bn(self.dropout(y))


@pytest.mark.parametrize("where, pattern", [("before_batch_norm", "linear_dropout_batch_norm"),
                                            ("before_scale", "linear_dropout_scale_batch_norm")])
@pytest.mark.parametrize("p, training", [(0.4, False), (0.0, True), (0.0, False)])
def test_identity_dropout_joins_the_chain(p, training, where, pattern):
    """In eval, or with p = 0, dropout passes its input through: it joins the chain and the fused op
    leaves it out."""
    gm = single_graph(DropoutBetween(p, where).train(training), make_input(8, 32))
    matches, misses = rewrite(gm, families=CHAINS)
    assert [m.pattern for m in matches] == [pattern] and misses == []
    assert count_calls(gm, (F.dropout, F.batch_norm)) == 0 and count_calls(gm, (FUSED_OP,)) == 1


def test_random_dropout_ends_the_chain_with_the_reason():
    gm = single_graph(DropoutBetween(0.4, "before_batch_norm").train(), make_input(8, 32))
    matches, misses = rewrite(gm, families=CHAINS)
    assert matches == [] and count_calls(gm, (F.dropout,)) == 1
    [miss] = misses
    assert "dropout with p = 0.4 in training is random" in miss.reason
