"""The Triton GEMM with its epilogues (under TRITON_INTERPRET=1 on CPU, natively on CUDA), and the op's
two implementations (Triton GEMM, cuBLAS GEMM) against the unfused chain in eager and float64."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fusepass.lowering import gemm, gemm_configs, limits
from fusepass.lowering.implementations import Implementation, on_cublas, on_triton_gemm
from fusepass.lowering.schema import Linear
from fusepass.lowering.tf32_split import round_tf32, split_tf32
from fusepass.numerics import rel_error
from tests.chains import assert_no_further_from_float64, requires_cuda
from tests.lowering.cases import HALF_DTYPES, KERNEL_DEVICE, assert_like_eager, make_args, record_launches

# Small tiles keep the interpreter fast; on a GPU the same tiles exercise masking and several row tiles.
SMALL = gemm_configs.GemmConfig(16, 32, 16, group_m=2, num_warps=4, num_stages=2)
FP32_ACCURATE = ["tf32x3", "split_w", "split_x"]
TF32_ROUNDED = ["tf32", "round_w", "round_x"]  # both operands rounded to tf32 (in registers or in memory)


@pytest.mark.parametrize("transposed", [False, True])
def test_tf32_split_is_exact_and_hi_fits_tf32(transposed):
    t = torch.randn(67, 93, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE) * 1e3
    t = t.t() if transposed else t  # a transposed operand comes out row-major from the same pass
    hi, lo = split_tf32(t)
    padded = (t.shape[1] + 15) // 16 * 16
    assert hi.is_contiguous() and lo.is_contiguous() and hi.shape == lo.shape == (t.shape[0], padded)
    hi, lo = hi[:, :t.shape[1]], lo[:, :t.shape[1]]
    assert torch.equal(hi + lo, t)
    assert (hi.view(torch.int32) & 0x1FFF).eq(0).all()  # 13 low mantissa bits clear: 10 remain
    assert (lo.abs() <= hi.abs() * 2.0**-11).all()  # rounded to nearest: |lo| is at most half a tf32 ulp
    rounded = round_tf32(t)
    assert rounded.shape == (t.shape[0], padded) and torch.equal(rounded[:, :t.shape[1]], hi)


def to_tf32(t: torch.Tensor) -> torch.Tensor:
    """t rounded to nearest tf32 (ties away from zero), on the host: the GEMM's rounding, independently."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & -8192).view(torch.float32).reshape(t.shape)


# Small tiles with odd edges; a K of 7 floats has rows no TMA descriptor takes.
@pytest.mark.parametrize("m, k, n", [(37, 40, 19), (21, 64, 24), (5, 7, 3)])
@pytest.mark.parametrize("precision", TF32_ROUNDED)
@pytest.mark.parametrize("config", ["program per tile", "persistent"])
@pytest.mark.parametrize("layout", ["row-major", "transposed"])
def test_tf32_gemm_is_the_product_of_rounded_operands(m, k, n, precision, config, layout):
    """Each TF32 variant multiplies x and W rounded to nearest tf32 exactly and sums in fp32: within fp32
    rounding of float64's product of the rounded operands (truncation, or an operand left unrounded,
    would be ~1e-4 off), whichever operand is rounded in memory and however the operands are laid out."""
    g = torch.Generator().manual_seed(m * k + n)
    x, w = (torch.randn(shape, generator=g).to(KERNEL_DEVICE) for shape in ((m, k), (n, k)))
    if layout == "transposed":  # a backward's dW operands: neither K-major
        x, w = x.t().contiguous().t(), w.t().contiguous().t()
    tiles = PERSISTENT if config == "persistent" else SMALL
    why = gemm.unlaunchable(x, w, precision, tiles)
    if why:
        assert config == "persistent" and ("16-byte" in why or "contiguous" in why)
        return
    y = gemm.run_gemm(Linear(x, w, None), precision, tiles).y
    exact = to_tf32(x).double() @ to_tf32(w).double().t()
    assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-6


# K of whole blocks (64) and with a partial last one: the kernel's two K variants (gemm.k_may_end_partial)
@pytest.mark.parametrize("m, k, n", [(37, 40, 19), (64, 48, 64), (5, 7, 3), (21, 64, 24)])
@pytest.mark.parametrize("precision", FP32_ACCURATE)
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("layout", ["row-major", "transposed"])
def test_fp32_accurate_gemm_no_further_from_float64_than_cublas(m, k, n, precision, tma, layout):
    g = torch.Generator().manual_seed(m + k + n)
    x, w, b = (torch.randn(shape, generator=g).to(KERNEL_DEVICE) for shape in ((m, k), (n, k), (n,)))
    if layout == "transposed":  # as a backward's dW GEMM and a matmul head pass them: neither K-major
        if tma:
            pytest.skip("TMA descriptors need contiguous rows; the tuner offers TMA configs only where they fit")
        x, w = x.t().contiguous().t(), w.t().contiguous().t()
    if tma and limits.tma_layout(x, w):
        assert k * 4 % 16 != 0 or x.is_cuda  # rows of 7 floats are not 16-byte aligned: no descriptors
        with pytest.raises(ValueError, match="TMA"):
            gemm.run_gemm(Linear(x, w, b), precision, SMALL.with_tma())
        return
    y = gemm.run_gemm(Linear(x, w, b), precision, SMALL.with_tma() if tma else SMALL).y
    assert_no_further_from_float64("linear", y, F.linear(x, w, b), F.linear(x.double(), w.double(), b.double()))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("precision, dtype, bound", [("tf32", torch.float32, 2e-3), ("round_w", torch.float32, 2e-3),
                                                     ("round_x", torch.float32, 2e-3),
                                                     ("native", torch.bfloat16, 1e-2), ("native", torch.float16, 2e-3)])
def test_reduced_precision_gemm_errors(precision, dtype, bound):
    """Same error class as cuBLAS in that precision (measured: tf32 ~5e-4, bf16 ~2.6e-3)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x, w = torch.randn(300, 512, device="cuda", generator=g), torch.randn(200, 512, device="cuda", generator=g)
    y = gemm.run_gemm(Linear(x.to(dtype), w.to(dtype), None), precision, SMALL).y
    assert y.dtype == dtype
    ref = x.double() @ w.double().t()
    assert ((y.double() - ref).norm() / ref.norm()).item() < bound


@pytest.mark.parametrize("m, k, n", [(37, 40, 19), (64, 48, 64), (5, 7, 3)])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("config", ["program per tile", "tma", "persistent"])
@pytest.mark.parametrize("layout", ["row-major", "transposed"])
def test_weight_cast_in_the_gemm_is_the_product_of_the_cast_weight(m, k, n, dtype, config, layout):
    """cast_w: an fp32 W (autocast's) cast tile by tile in the kernel multiplies exactly what the native
    GEMM multiplies from W cast in memory (round to nearest, as autocast's cast), and is as close to the
    float64 product of the cast operands, K-major or not, with partial tiles and K blocks."""
    g = torch.Generator().manual_seed(m + 3 * k + n)
    x, w, b = (torch.randn(shape, generator=g).to(KERNEL_DEVICE) for shape in ((m, k), (n, k), (n,)))
    x, b = x.to(dtype), b.to(dtype)
    if layout == "transposed":  # a matmul head's (in, out) W seen as (out, in)
        w = w.t().contiguous().t()
    tiles = {"program per tile": SMALL, "tma": SMALL.with_tma(), "persistent": PERSISTENT}[config]
    if gemm.unlaunchable(x, w, "cast_w", tiles):
        assert config != "program per tile" and layout == "transposed" or k == 7  # TMA's rows
        return
    assert not gemm.needs_k_major_copy(w, "cast_w")  # read into registers in any layout
    y = gemm.run_gemm(Linear(x, w, b), "cast_w", tiles).y
    native = gemm.run_gemm(Linear(x, w.to(dtype), b), "native", tiles).y
    assert y.dtype == dtype and y.shape == (m, n)
    exact = x.double() @ w.to(dtype).double().t() + b.double()
    assert rel_error(y, exact) <= 1.01 * rel_error(native, exact) + 1e-6
    torch.testing.assert_close(y, native, rtol=2 * torch.finfo(dtype).eps, atol=1e-3)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("tail", ["bn", "softmax"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_weight_cast_in_the_gemm_matches_eager_autocast(training, tail, dtype):
    """The chain on cast_w, its W fp32: eager's autocast result (W cast, then the chain), no further from
    float64; and no cast of W returned where no dX GEMM reads one."""
    args = make_args(45, 24, 37, dtype=dtype, scale="per_feature", softmax=tail == "softmax", training=training,
                     save_linear_out=True, momentum=0.3)
    autocast = dataclasses.replace(args, linear=dataclasses.replace(args.linear, weight=args.linear.weight.float()),
                                   input_grad=False)
    fused = Implementation("cast_w", SMALL)(autocast)
    assert_like_eager(fused, args)
    assert fused.compute_weight.numel() == 0
    kept = Implementation("cast_w", SMALL)(dataclasses.replace(autocast, input_grad=True))
    assert torch.equal(kept.compute_weight, args.linear.weight)  # cast anyway where the backward reads it


@pytest.mark.parametrize("scale", ["per_feature", "single", "number"])
def test_statistics_epilogue_per_row_tile(scale):
    args = make_args(37, 20, 19, scale=scale)
    out = gemm.run_gemm(args.linear, "tf32x3", SMALL, epilogue=gemm.EPILOGUE_STATISTICS.value,
                        scale_before=args.scale_before)
    z = out.y.double() * (args.scale_before.tensor.double() if args.scale_before.tensor is not None
                          else args.scale_before.value)
    tiles = z.split(SMALL.block_m)
    assert out.parts.n_parts == len(tiles) and out.parts.rows_per_part == SMALL.block_m
    part_mean, part_m2 = out.parts.mean_and_m2(19)
    torch.testing.assert_close(part_mean.double(), torch.stack([t.mean(0) for t in tiles]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part_m2.double(), torch.stack([((t - t.mean(0)) ** 2).sum(0) for t in tiles]),
                               rtol=1e-4, atol=1e-4)


IMPLEMENTATIONS = [("triton", "tf32x3"), ("triton", "split_w"), ("triton", "split_x"), ("triton-tma", "tf32x3"),
                   ("triton-tma", "split_w"), ("triton-tma", "split_x"), ("triton-persistent", "tf32x3"),
                   ("triton-persistent", "split_w"), ("triton-persistent", "split_x"), ("cublas", "tf32x3"),
                   ("cublas", "ieee")]


def run_implementation(args, impl, precision):
    if impl == "cublas":
        return on_cublas(args, precision)
    config = {"triton": SMALL, "triton-tma": SMALL.with_tma(), "triton-persistent": PERSISTENT}[impl]
    return on_triton_gemm(args, precision, config)


PERSISTENT = dataclasses.replace(SMALL, persistent=True)


@pytest.mark.parametrize("impl, precision", IMPLEMENTATIONS)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("tail", ["bn", "softmax"])
@pytest.mark.parametrize("save_linear_out", [True, False])
def test_implementations_match_eager_by_float64(impl, precision, training, tail, save_linear_out):
    args = make_args(45, 24, 37, scale="per_feature", scale_after="number" if tail == "softmax" else "per_feature",
                     softmax=tail == "softmax", training=training, save_linear_out=save_linear_out, momentum=0.3)
    fused = run_implementation(args, impl, precision)
    assert_like_eager(fused, args)
    lin = args.linear
    if save_linear_out:
        assert_no_further_from_float64("linear", fused.linear_out, F.linear(lin.x, lin.weight, lin.bias),
                                       F.linear(lin.x.double(), lin.weight.double(), lin.bias.double()))
    else:
        assert fused.linear_out.numel() == 0


@pytest.mark.parametrize("impl, precision", [("triton", "tf32x3"), ("triton-persistent", "split_w"),
                                             ("cublas", "ieee")])
def test_statistics_stay_exact_far_from_zero(impl, precision):
    """Features near 1e4, some constant over the batch (their rows of W 0: y is the bias there exactly), in row
    tiles of 16 rows and a short last one: statistics from the GEMM's epilogue (from the statistics pass after
    cuBLAS) and the output no further from float64 than eager's, and a constant feature's mean its value, its
    output beta. Not the running variance: test_normalize.py's strict xfail says why."""
    args = make_args(45, 24, 37, scale=None, momentum=0.3)
    constant = slice(5, 21)
    with torch.no_grad():
        args.linear.bias.add_(1e4)
        args.linear.weight[constant] = 0.0
    fused = run_implementation(args, impl, precision)
    assert_like_eager(fused, args, running=False)
    assert torch.equal(fused.mean[constant], args.linear.bias[constant])
    assert torch.equal(fused.out[:, constant], args.batch_norm.bias[constant].expand(45, -1))


@pytest.mark.parametrize("impl, precision", [("triton", "native"), ("triton-tma", "native"),
                                             ("triton-persistent", "native"), ("cublas", "native")])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_implementations(impl, precision, training, dtype):
    """Small batch and momentum 1.0: the running variance is the batch's unbiased variance alone."""
    args = make_args(7, 32, 24, dtype=dtype, training=training, momentum=1.0)
    fused = run_implementation(args, impl, precision)
    assert fused.out.dtype == dtype
    assert_like_eager(fused, args)


@pytest.mark.parametrize("training, softmax", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_persistent_programs_loop_over_every_tile(training, softmax, dtype):
    """More tiles than programs (on CPU one program walks them all; on CUDA 3 x 2 tiles of 16 x 32 with
    odd edges), through each epilogue: statistics, normalize, and the eval statistics before softmax."""
    args = make_args(45, 32, 40, dtype=dtype, training=training, softmax=softmax, tail="gelu_relu", momentum=0.3)
    assert gemm.unlaunchable(args.linear.x, args.linear.weight, "native", PERSISTENT) is None
    assert_like_eager(run_implementation(args, "triton-persistent", "native"), args)


def test_a_misaligned_weight_is_checked_itself():
    """The chain checks the weight its GEMM reads: a view starting one element into its storage cannot
    back a TMA descriptor (a stand-in for it would start aligned)."""
    args = make_args(8, 16, 24, dtype=torch.float16, device="cpu")
    storage = torch.empty(24 * 16 + 1, dtype=torch.float16)
    weight = storage[1:].view(24, 16).copy_(args.linear.weight)
    args = dataclasses.replace(args, linear=dataclasses.replace(args.linear, weight=weight))
    assert "16-byte" in Implementation("native", PERSISTENT).unlaunchable(args)
    assert Implementation("native", SMALL).unlaunchable(args) is None  # pointer loads take any offset


def test_persistent_gemm_needs_tma_rows_of_the_operands_it_reads():
    """Checked on the operands as the kernel reads them: an operand split in memory comes from aligned
    split buffers, a transposed fp32 weight from its K-major copy."""
    x, w = torch.randn(8, 12, dtype=torch.float16), torch.randn(16, 12, dtype=torch.float16)
    assert "16-byte" in gemm.unlaunchable(x, w, "native", PERSISTENT)  # rows of 24 bytes
    x, w = torch.randn(8, 16, dtype=torch.float16), torch.randn(16, 16, dtype=torch.float16)
    assert gemm.unlaunchable(x, w, "native", PERSISTENT) is None
    assert "contiguous" in gemm.unlaunchable(x.t().contiguous().t(), w, "native", PERSISTENT)
    assert "contiguous" in gemm.unlaunchable(x, w.t().contiguous().t(), "native", PERSISTENT)  # no copy in bf16
    x, w = x.float(), w.float()
    assert gemm.unlaunchable(x, w.t().contiguous().t(), "tf32x3", PERSISTENT) is None  # its K-major copy
    x_by_columns = x.t().contiguous().t()
    assert "contiguous" in gemm.unlaunchable(x_by_columns, w, "tf32x3", PERSISTENT)
    assert "contiguous" in gemm.unlaunchable(x_by_columns, w, "split_w", PERSISTENT)
    assert gemm.unlaunchable(x_by_columns, w, "split_x", PERSISTENT) is None  # read from its split halves
    x, w = torch.randn(8, 5), torch.randn(16, 5)  # rows of 20 bytes; split buffers' of 64
    assert "16-byte" in gemm.unlaunchable(x, w, "tf32x3", PERSISTENT)
    assert "16-byte" in gemm.unlaunchable(x, w, "split_x", PERSISTENT)  # the weight, as it is



@pytest.mark.parametrize("softmax", [False, True])
def test_launches_after_the_gemm(monkeypatch, softmax):
    """Eval without softmax: the GEMM epilogue normalizes, no pass after it. Otherwise one output pass,
    which in training merges the GEMM's per-tile statistics itself (few row tiles here), except a softmax
    pass, which reads them from a finalize launch (normalize.normalize_training says why). After cuBLAS: the
    statistics pass (training) and the output pass, likewise."""
    launched = record_launches(monkeypatch)
    output_kernel = "normalize_softmax_kernel" if softmax else "normalize_kernel"
    for training in (False, True):
        args = make_args(20, 16, 12, softmax=softmax, training=training)
        finalize = ["finalize_stats_kernel"] if training and softmax else []
        launched.clear()
        on_triton_gemm(args, "tf32x3", SMALL)
        assert launched == (finalize + [output_kernel] if training or softmax else [])
        launched.clear()
        on_cublas(args, "tf32x3")
        assert launched == (["partial_stats_kernel"] if training else []) + finalize + [output_kernel]


def test_persistent_check_of_a_symbolic_batch_adds_no_guard():
    """A weight gradient traced with a dynamic batch (K): its K-major copy's alignment is unknown, so the
    persistent walk is not offered, and the check guards nothing (a guard on the batch would recompile
    the graph when the batch's alignment changes)."""
    shape_env = ShapeEnv()
    batch = shape_env.create_symintnode(shape_env.create_symbol(40, LocalSource("batch")), hint=40)
    with FakeTensorMode(shape_env=shape_env):
        g, x = torch.empty(batch, 32), torch.empty(batch, 48)
        assert "16-byte" in gemm.unlaunchable(g.t(), x.t(), "split_x", PERSISTENT)
        # the one guard: the split launch's grid bound (limits.column_grid), true of any batch that fits
        assert [guard.expr for guard in shape_env.guards if "65535" not in str(guard.expr)] == []
        assert gemm.unlaunchable(g.t(), x.t(), "split_x", SMALL) is None
