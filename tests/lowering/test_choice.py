"""The chain op's problem and candidates: GEMM precision from torch's flags, the candidates per option,
the size bucket, and the op's per-process memory of what was chosen."""

import dataclasses

import torch

from fusepass.lowering import choice, gemm_configs, gemm_precisions, op, tuned_op
from fusepass.lowering.implementations import Implementation
from fusepass.lowering.schema import KernelOptions, Linear
from tests.lowering.cases import assert_like_eager, make_args


def with_operands(args, x, weight, gemm_option="auto", fp32_matmul="tf32x3"):
    return dataclasses.replace(args, linear=Linear(x, weight, None), kernel=KernelOptions(fp32_matmul, gemm_option))


def candidates(args, traced=False):
    return choice.candidates(args, choice.problem(args, traced), traced)


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
    auto = candidates(square)
    assert "cublas" in auto and any(name.startswith("triton tf32x3") for name in auto)
    assert any(name.startswith("triton split_w") for name in auto)  # x as large as W: W is split
    wide = make_args(8, 16, 32).linear.weight  # W larger than x: x is split, in memory
    names = candidates(with_operands(args, x, wide, "triton"))
    triton = [name for name in names if "warp-specialized" not in name]  # (Hopper's splits either operand)
    assert {name.split()[1] for name in triton} == {"tf32x3", "split_x"}
    assert list(candidates(with_operands(args, x, x, "cublas"))) == ["cublas"]
    copies = with_operands(args, x, wide, "triton")
    no_copies = dataclasses.replace(copies, kernel=KernelOptions(gemm="triton", operand_copies=False))
    assert {name.split()[1] for name in candidates(no_copies)} == {"tf32x3"}  # nothing split in memory
    assert choice.problem(no_copies, False).family != choice.problem(copies, False).family
    assert list(candidates(with_operands(args, x, x, "triton", fp32_matmul="ieee"))) == ["cublas"]
    assert any(name.endswith(" tma") for name in auto)  # 16 fp32 per row: 16-byte aligned rows
    unaligned = make_args(8, 17, 4).linear.x[:, 1:]
    assert not any(name.endswith(" tma") for name in candidates(with_operands(args, unaligned, unaligned)))
    # 2^31 outputs and more: the kernels' offsets are int64, so the GEMM and the passes still take them
    meta = make_args(8, 16, 4, device="meta")
    huge = torch.empty(2**16 + 1, 2**15, device="meta")
    assert any(name.startswith("triton") for name in candidates(with_operands(meta, huge, huge)))


def test_the_prepared_operand_is_the_smaller_unless_w_is_not_k_major():
    assert gemm_precisions.prepared_variant("tf32", 10, 20) == "round_x"
    assert gemm_precisions.prepared_variant("tf32", 20, 10) == "round_w"
    assert gemm_precisions.prepared_variant("tf32x3", 10, 20) == "split_x"
    # a W^T would be copied K-major anyway: preparing it makes that copy
    assert gemm_precisions.prepared_variant("tf32", 10, 20, weight_k_major=False) == "round_w"
    assert gemm_precisions.prepared_variant("tf32x3", 10, 20, weight_k_major=False) == "split_w"
    assert gemm_precisions.prepared_variant("native", 10, 20) is None


def test_tf32_triton_only_offers_no_cublas():
    args = make_args(8, 16, 4)
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = candidates(with_operands(args, args.linear.x, args.linear.weight, "triton"))
        assert tf32 and "cublas" not in tf32
        # TF32 itself, and with W (here smaller than x: 4 x 16 against 8 x 16) rounded in memory
        assert {name.split()[1] for name in tf32} == {"tf32", "round_w"}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def test_problem_buckets_the_rows_and_keeps_the_rest():
    """Rows rounded up to a power of two: every batch of 513 to 1024 rows is one problem. The features, a
    flag, a dtype or a tensor's kind make another family."""
    base = choice.problem(make_args(777, 24, 40), traced=False)
    assert base.sizes == (1024,)
    assert choice.problem(make_args(1000, 24, 40), traced=False) == base
    assert choice.problem(make_args(513, 24, 40), traced=False) == base
    assert choice.problem(make_args(512, 24, 40), traced=False) == base._replace(sizes=(512,))
    for other in (make_args(777, 24, 40, training=False), make_args(777, 24, 40, scale="single"),
                  make_args(777, 24, 40, dtype=torch.float16), make_args(777, 20, 40), make_args(777, 24, 33)):
        assert choice.problem(other, traced=False).family != base.family
    assert choice.problem(make_args(777, 24, 40), traced=True).family != base.family
    assert "1.3" not in base.family  # float values change no kernel


def test_candidates_are_the_same_for_every_call_of_a_bucket():
    """Decided from the bucket: 777 and 1000 rows (both in 1024's) are offered the same, though the
    exact sizes would split x for one and W for the other."""
    small, large = make_args(777, 24, 1000), make_args(1000, 24, 1000)
    assert list(candidates(small)) == list(candidates(large))


def test_every_candidate_computes_the_op():
    """What the tuner may choose among: each candidate's result is no further from float64 than eager."""
    for training in (True, False):
        args = make_args(33, 16, 20, training=training, save_linear_out=True)
        for name, run in candidates(args).items():
            assert_like_eager(run(args), args)


def test_choice_is_remembered_per_problem(monkeypatch):
    """With tuning off the default (first) candidate is chosen once per problem, then looked up."""
    monkeypatch.setattr(op.CHAIN, "_chosen", {})
    args = make_args(12, 16, 8)
    chosen = op.CHAIN.choose(args, traced=False)
    assert chosen == Implementation("tf32x3", gemm_configs.candidates("tf32x3", torch.float32)[0])
    assert list(op.CHAIN._chosen) == [(choice.problem(args, False), False)]
    assert op.CHAIN.choose(make_args(10, 16, 8), traced=False) is chosen  # the same bucket
    op.CHAIN.choose(dataclasses.replace(args, kernel=KernelOptions(gemm="cublas")), traced=False)
    assert len(op.CHAIN._chosen) == 2


def synced(args, group="ranks"):
    return dataclasses.replace(args, batch_norm=dataclasses.replace(args.batch_norm, group_name=group))


def test_a_sync_batch_norm_chain_is_timed_without_its_collective():
    args = make_args(12, 16, 8)
    assert choice.without_collectives(args) is args
    alone = choice.without_collectives(synced(args))
    assert alone.batch_norm.group_name == "" and not alone.batch_norm.synced
    assert alone == args  # the same chain, unsynced: every other argument as it was


def test_the_tuner_runs_candidates_on_the_call_without_collectives(monkeypatch):
    """Traced (on stand-ins) and not (on the call): what each timed candidate runs on is this rank's chain
    alone, so that a rank that times issues no collective another rank, which found the choice cached,
    would never join."""
    timed = []

    def time_each(problem, device, runners, **kwargs):
        for run in runners.values():
            run()
        return next(iter(runners))
    monkeypatch.setattr(tuned_op, "_run", lambda impl, timed_call: timed.append(timed_call()))
    monkeypatch.setattr(tuned_op.TUNER, "choose", time_each)
    for traced in (False, True):
        monkeypatch.setattr(op.CHAIN, "_chosen", {})
        timed.clear()
        op.CHAIN.choose(synced(make_args(12, 16, 8, save_linear_out=True)), traced=traced)
        assert timed and all(a.batch_norm.group_name == "" and a.batch_norm.training for a in timed)


def test_stand_ins_have_the_shapes_and_a_positive_variance():
    args = make_args(10, 6, 5, training=False)
    real = choice.stand_ins(args)
    assert real.linear.x.shape == args.linear.x.shape and real.batch_norm.weight.shape == (5,)
    assert (real.batch_norm.running_var > 0).all() and real.batch_norm.training is False


def test_an_autocast_weight_is_offered_cast_in_the_gemm_unless_its_cast_is_kept():
    """Under autocast (x 16-bit, W fp32 as the model holds it) the Triton GEMM may cast W's tiles as it
    reads them (cast_w), where no cast of the whole W is made anyway: not for a training call whose
    backward makes x's gradient (the op returns the cast for that dX GEMM)."""
    args = make_args(8, 16, 24, dtype=torch.float16, save_linear_out=True)
    autocast = dataclasses.replace(args, linear=dataclasses.replace(args.linear, weight=args.linear.weight.float()))

    def offered(**changes):
        names = candidates(dataclasses.replace(autocast, **changes))
        return {name.split()[1] for name in names if name.startswith("triton")}

    assert offered(input_grad=False) == {"native", "cast_w"}
    assert offered(input_grad=True) == {"native"}
    assert offered(input_grad=True, save_linear_out=False) == {"native", "cast_w"}  # inference
    assert {name.split()[1] for name in candidates(args) if name.startswith("triton")} == {"native"}  # W 16-bit
    assert "cublas" in candidates(dataclasses.replace(autocast, input_grad=False))
    assert choice.problem(dataclasses.replace(autocast, input_grad=False), False).family != \
        choice.problem(autocast, False).family
