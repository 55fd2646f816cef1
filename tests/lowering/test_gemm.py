"""The Triton GEMM with its epilogues (under TRITON_INTERPRET=1 on CPU, natively on CUDA), and the op's
two implementations (Triton GEMM, cuBLAS GEMM) against the reference and float64."""

import pytest
import torch
import torch.nn.functional as F

import fusepass.lowering.linear_scale_batch_norm as lowering
from fusepass.lowering import gemm
from tests.chains import assert_no_further_from_float64, requires_cuda
from tests.lowering.test_linear_scale_batch_norm import KERNEL_DEVICE, float64_chain, make_case, record_launches

# Small tiles keep the interpreter fast; on a GPU the same tiles exercise masking and several row tiles.
SMALL = gemm.GemmConfig(16, 32, 16, group_m=2, num_warps=4, num_stages=2)
FP32_ACCURATE = ["tf32x3", "split_w", "split_x"]


def test_tf32_split_is_exact_and_hi_fits_tf32():
    t = torch.randn(4099, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE) * 1e3
    hi, lo = gemm.split_tf32(t)
    assert torch.equal(hi + lo, t)
    assert (hi.view(torch.int32) & 0x1FFF).eq(0).all()  # 13 low mantissa bits clear: 10 remain
    assert (lo.abs() <= hi.abs() * 2.0**-11).all()  # rounded to nearest: |lo| is at most half a tf32 ulp


@pytest.mark.parametrize("m, k, n", [(37, 40, 19), (64, 48, 64), (5, 7, 3)])
@pytest.mark.parametrize("precision", FP32_ACCURATE)
@pytest.mark.parametrize("tma", [False, True])
def test_fp32_accurate_gemm_no_further_from_float64_than_cublas(m, k, n, precision, tma):
    g = torch.Generator().manual_seed(m + k + n)
    x, w, b = (torch.randn(shape, generator=g).to(KERNEL_DEVICE) for shape in ((m, k), (n, k), (n,)))
    if tma and not gemm.tma_usable(x, w):
        assert k * 4 % 16 != 0 or x.is_cuda  # rows of 7 floats are not 16-byte aligned: no descriptors
        with pytest.raises(ValueError, match="TMA"):
            gemm.linear_epilogue(x, w, b, precision, SMALL.with_tma())
        return
    y = gemm.linear_epilogue(x, w, b, precision, SMALL.with_tma() if tma else SMALL).y
    assert_no_further_from_float64("linear", y, F.linear(x, w, b), F.linear(x.double(), w.double(), b.double()))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("precision, dtype, bound", [("tf32", torch.float32, 2e-3), ("native", torch.bfloat16, 1e-2),
                                                     ("native", torch.float16, 2e-3)])
def test_reduced_precision_gemm_errors(precision, dtype, bound):
    """Same error class as cuBLAS in that precision (measured: tf32 ~5e-4, bf16 ~2.6e-3)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x, w = torch.randn(300, 512, device="cuda", generator=g), torch.randn(200, 512, device="cuda", generator=g)
    y = gemm.linear_epilogue(x.to(dtype), w.to(dtype), None, precision, SMALL).y
    assert y.dtype == dtype
    ref = x.double() @ w.double().t()
    assert ((y.double() - ref).norm() / ref.norm()).item() < bound


@pytest.mark.parametrize("scale", ["per_feature", "single", "number"])
def test_statistics_epilogue_per_row_tile(scale):
    case = make_case(37, 20, 19, scale=scale)
    out = gemm.linear_epilogue(case["x"], case["weight"], case["bias"], "tf32x3", SMALL,
                               epilogue=gemm.STATISTICS, scale=case["scale"], scale_value=case["scale_value"])
    z = out.y * (case["scale"] if case["scale"] is not None else case["scale_value"])
    tiles = z.split(SMALL.block_m)
    assert out.part_mean.shape == (len(tiles), 19) and out.rows_per_part == SMALL.block_m
    torch.testing.assert_close(out.part_mean, torch.stack([t.mean(0) for t in tiles]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.part_m2, torch.stack([((t - t.mean(0)) ** 2).sum(0) for t in tiles]),
                               rtol=1e-4, atol=1e-4)


IMPLEMENTATIONS = [("triton", "tf32x3"), ("triton", "split_w"), ("triton", "split_x"), ("triton-tma", "tf32x3"),
                   ("triton-tma", "split_w"), ("triton-tma", "split_x"), ("cublas", "tf32x3"), ("cublas", "ieee")]


def run_implementation(case, impl, precision, training, keep_linear, tail, out_dtype=torch.float32):
    args = (*case.values(), training, 0.1, 1e-5, out_dtype, keep_linear, *tail)
    if impl == "cublas":
        return lowering.cublas_batch_norm(*args, precision)
    return lowering.gemm_batch_norm(*args, precision, SMALL.with_tma() if impl == "triton-tma" else SMALL)


@pytest.mark.parametrize("impl, precision", IMPLEMENTATIONS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("tail", [(None, 1.0, False), (None, 0.7, True)], ids=["bn", "softmax"])
@pytest.mark.parametrize("keep_linear", [True, False])
def test_implementations_match_reference_and_float64(impl, precision, training, tail, keep_linear):
    case = make_case(45, 24, 37, scale="per_feature")
    out, new_mean, new_var, linear_out, mean, invstd = run_implementation(
        case, impl, precision, training, keep_linear, tail)
    ref_out, ref_new_mean, ref_new_var, ref_linear, ref_mean, ref_invstd = lowering.reference(
        *case.values(), training, 0.1, 1e-5, torch.float32, keep_linear, *tail)
    y64 = F.linear(case["x"].double(), case["weight"].double(), case["bias"].double())
    assert_no_further_from_float64("output", out, ref_out, float64_chain(y64, case, training, tail))
    torch.testing.assert_close(mean, ref_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(invstd, ref_invstd, rtol=1e-5, atol=0)
    torch.testing.assert_close(new_mean, ref_new_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_var, ref_new_var, rtol=1e-5, atol=0)
    assert linear_out.shape == ref_linear.shape
    if keep_linear:
        assert_no_further_from_float64("linear", linear_out, ref_linear, y64)


# Triton's interpreter multiplies bf16 tiles as raw bit patterns (measured: errors of 4e10), so bf16
# dots run on a GPU only; fp16 takes its place on CPU.
HALF_DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=[pytest.mark.cuda, requires_cuda])]


@pytest.mark.parametrize("impl, precision", [("triton", "native"), ("triton-tma", "native"), ("cublas", "native")])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_implementations(impl, precision, training, dtype):
    case = make_case(40, 32, 24, dtype=dtype)
    out, new_mean, new_var, _, _, _ = run_implementation(case, impl, precision, training, False,
                                                         (None, 1.0, False), dtype)
    ref_out, ref_new_mean, ref_new_var, *_ = lowering.reference(
        *case.values(), training, 0.1, 1e-5, dtype, False, None, 1.0, False)
    assert out.dtype == dtype and new_mean.dtype == case["running_mean"].dtype
    y64 = F.linear(*(case[k].double() for k in ("x", "weight", "bias")))
    assert_no_further_from_float64("output", out, ref_out, float64_chain(y64, case, training, (None, 1.0, False)))
    if training:
        torch.testing.assert_close(new_var.float(), ref_new_var.float(), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("softmax", [False, True])
def test_launches_after_the_gemm(monkeypatch, softmax):
    """Eval without softmax: the GEMM epilogue normalizes, no pass after it. Otherwise one output pass,
    which in training merges the GEMM's per-tile statistics itself (few row tiles here). After cuBLAS:
    the statistics pass (training) and the output pass, which finishes the statistics itself."""
    launched = record_launches(monkeypatch)
    case = make_case(20, 16, 12)
    output_kernel = "_normalize_softmax_kernel" if softmax else "_normalize_kernel"
    for training in (False, True):
        launched.clear()
        lowering.gemm_batch_norm(*case.values(), training, 0.1, 1e-5, torch.float32, False, None, 1.0, softmax,
                                 "tf32x3", SMALL)
        assert launched == ([output_kernel] if training or softmax else [])
        launched.clear()
        lowering.cublas_batch_norm(*case.values(), training, 0.1, 1e-5, torch.float32, False, None, 1.0, softmax,
                                   "tf32x3")
        assert launched == (["_partial_stats_kernel"] if training else []) + [output_kernel]


def test_matmul_precision_follows_torch_tf32_flag():
    assert lowering.matmul_precision(torch.bfloat16, "tf32x3") == "native"
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:  # set and restored by hand: pytest's monkeypatch fails to restore this module attribute
        torch.backends.cuda.matmul.allow_tf32 = False
        assert lowering.matmul_precision(torch.float32, "tf32x3") == "tf32x3"
        assert lowering.matmul_precision(torch.float32, "ieee") == "ieee"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert lowering.matmul_precision(torch.float32, "tf32x3") == "tf32"
        assert lowering.matmul_precision(torch.float32, "ieee") == "ieee"  # the option forces FMA
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def test_candidates_per_choice():
    x = make_case(8, 16, 4)["x"]
    auto = lowering.implementations(x, x, "tf32x3", "auto")
    assert "cublas" in auto and any(name.startswith("triton tf32x3") for name in auto)
    assert any(name.startswith("triton split_w") for name in auto)  # x as large as W: W is split
    wide = make_case(8, 16, 32)["weight"]  # W larger than x: x is split, in memory
    assert {name.split()[1] for name in lowering.implementations(x, wide, "tf32x3", "triton")} == {"tf32x3", "split_x"}
    assert list(lowering.implementations(x, x, "tf32x3", "cublas")) == ["cublas"]
    assert "cublas" not in lowering.implementations(x, x, "tf32", "triton")
    assert list(lowering.implementations(x, x, "ieee", "triton")) == ["cublas"]
    assert any(name.endswith(" tma") for name in auto)  # 16 fp32 per row: 16-byte aligned rows
    unaligned = make_case(8, 17, 4)["x"][:, 1:]
    assert not any(name.endswith(" tma") for name in lowering.implementations(unaligned, unaligned, "tf32x3", "auto"))
    huge = torch.empty(2**16, 2**15, device="meta")
    assert list(lowering.implementations(huge, huge, "tf32x3", "auto")) == ["cublas"]  # 2^32 outputs


@pytest.mark.parametrize("training", [True, False])
def test_every_candidate_computes_the_op(training):
    """What the tuner may choose among: each candidate's result matches the reference."""
    case = make_case(33, 16, 20)
    args = (*case.values(), training, 0.1, 1e-5, torch.float32, True, None, 1.0, False)
    ref = lowering.reference(*args)
    for name, run in lowering.implementations(case["x"], case["weight"], "tf32x3", "auto").items():
        for got, want in zip(run(*args), ref):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)


def test_choice_is_remembered_per_problem(monkeypatch):
    """With tuning off the default (first) candidate is chosen once per problem, then looked up."""
    monkeypatch.setattr(lowering, "_CHOSEN", {})
    case = make_case(12, 16, 8)
    args = (*case.values(), True, 0.1, 1e-5, torch.float32, False, None, 1.0, False)
    chosen = lowering.choose_implementation(args, "tf32x3", "auto")
    assert chosen.keywords == {"precision": "tf32x3", "config": gemm.gemm_configs("tf32x3", torch.float32)[0]}
    assert list(lowering._CHOSEN) == [lowering.Problem.of(args, "tf32x3", "auto")]
    assert lowering.choose_implementation(args, "tf32x3", "auto") is chosen
    lowering.choose_implementation(args, "tf32x3", "cublas")
    assert len(lowering._CHOSEN) == 2
