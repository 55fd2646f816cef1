"""The choice of implementation: GEMM precision from torch's flags, the candidates per option, and the
per-problem memory of what was chosen."""

import dataclasses

import torch

from fusepass.lowering import choice, gemm
from fusepass.lowering.implementations import Implementation
from fusepass.lowering.schema import Kernel, Linear
from tests.lowering.cases import assert_like_eager, make_args


def with_operands(args, x, weight, gemm_option="auto"):
    return dataclasses.replace(args, linear=Linear(x, weight, None), kernel=Kernel(gemm=gemm_option))


def test_matmul_precision_follows_torch_tf32_flag():
    assert choice.matmul_precision(torch.bfloat16, "tf32x3") == "native"
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:  # set and restored by hand: pytest's monkeypatch fails to restore this module attribute
        torch.backends.cuda.matmul.allow_tf32 = False
        assert choice.matmul_precision(torch.float32, "tf32x3") == "tf32x3"
        assert choice.matmul_precision(torch.float32, "ieee") == "ieee"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert choice.matmul_precision(torch.float32, "tf32x3") == "tf32"
        assert choice.matmul_precision(torch.float32, "ieee") == "ieee"  # the option forces FMA
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def test_candidates_per_choice():
    args = make_args(8, 16, 4)
    x = args.linear.x
    square = with_operands(args, x, x)
    auto = choice.implementations(square, "tf32x3")
    assert "cublas" in auto and any(name.startswith("triton tf32x3") for name in auto)
    assert any(name.startswith("triton split_w") for name in auto)  # x as large as W: W is split
    wide = make_args(8, 16, 32).linear.weight  # W larger than x: x is split, in memory
    names = choice.implementations(with_operands(args, x, wide, "triton"), "tf32x3")
    assert {name.split()[1] for name in names} == {"tf32x3", "split_x"}
    assert list(choice.implementations(with_operands(args, x, x, "cublas"), "tf32x3")) == ["cublas"]
    assert "cublas" not in choice.implementations(with_operands(args, x, x, "triton"), "tf32")
    assert list(choice.implementations(with_operands(args, x, x, "triton"), "ieee")) == ["cublas"]
    assert any(name.endswith(" tma") for name in auto)  # 16 fp32 per row: 16-byte aligned rows
    unaligned = make_args(8, 17, 4).linear.x[:, 1:]
    assert not any(name.endswith(" tma") for name in choice.implementations(
        with_operands(args, unaligned, unaligned), "tf32x3"))
    # 2^32 outputs: past the kernels' 32-bit offsets, the GEMM's and the passes' alike (the op then runs
    # the unfused math: tests/lowering/test_limits.py)
    meta = make_args(8, 16, 4, device="meta")
    huge = torch.empty(2**16, 2**15, device="meta")
    assert choice.implementations(with_operands(meta, huge, huge), "tf32x3") == {}
    wide = torch.empty(2**16 + 1, 2**15, device="meta"), torch.empty(2**10, 2**15, device="meta")
    assert list(choice.implementations(with_operands(meta, *wide), "tf32x3")) == ["cublas"]  # the GEMM's x alone


def test_every_candidate_computes_the_op():
    """What the tuner may choose among: each candidate's result is no further from float64 than eager."""
    for training in (True, False):
        args = make_args(33, 16, 20, training=training, save_linear_out=True)
        for name, run in choice.implementations(args, "tf32x3").items():
            assert_like_eager(run(args), args)


def test_choice_is_remembered_per_problem(monkeypatch):
    """With tuning off the default (first) candidate is chosen once per problem, then looked up."""
    monkeypatch.setattr(choice, "_CHOSEN", {})
    args = make_args(12, 16, 8)
    chosen = choice.choose_implementation(args)
    assert chosen == Implementation("tf32x3", gemm.gemm_configs("tf32x3", torch.float32)[0])
    assert list(choice._CHOSEN) == [choice.ChoiceKey.of(args, "tf32x3", traced=False)]
    assert choice.choose_implementation(args) is chosen
    choice.choose_implementation(dataclasses.replace(args, kernel=Kernel(gemm="cublas")))
    assert len(choice._CHOSEN) == 2


def test_stand_ins_have_the_shapes_and_a_positive_variance():
    args = make_args(10, 6, 5, training=False)
    real = choice.stand_ins(args)
    assert real.linear.x.shape == args.linear.x.shape and real.batch_norm.weight.shape == (5,)
    assert (real.batch_norm.running_var > 0).all() and real.batch_norm.training is False
