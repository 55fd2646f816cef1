"""`fusepass::linear`: its Triton GEMM on the three layouts a training step multiplies in (forward x @ W^T,
dX = g @ W, dW = g^T @ x; under TRITON_INTERPRET=1 on CPU, natively on CUDA), its candidates, and the op
with its autograd formula against eager and float64."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fusepass.lowering import blocks, gemm, gemm_configs, gemm_precisions, linear, warp_specialized_gemm
from fusepass.lowering.schema import KernelOptions
from fusepass.numerics import rel_error
from tests.chains import assert_no_further_from_float64, requires_cuda
from tests.lowering.cases import HALF_DTYPES, KERNEL_DEVICE

SMALL = gemm_configs.GemmConfig(16, 32, 16, group_m=2, num_warps=4, num_stages=2)


def _operands(layout: str, m: int, k: int, n: int, seed: int):
    """(a, b) with a @ b^T of shape (m, n) laid out as a training step's GEMMs lay them out."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(shape, generator=g).to(KERNEL_DEVICE)  # noqa: E731
    if layout == "forward":  # x (m, k) @ W (n, k)^T
        return rand(m, k), rand(n, k)
    if layout == "grad_x":  # g (m, k) @ W (k, n): W^T is a transposed view
        return rand(m, k), rand(k, n).t()
    return rand(k, m).t(), rand(k, n).t()  # grad_weight: g^T @ x, both transposed views


@pytest.mark.parametrize("layout", ["forward", "grad_x", "grad_weight"])
@pytest.mark.parametrize("precision", ["tf32x3", "split_w", "split_x"])
@pytest.mark.parametrize("m, k, n", [(37, 40, 19), (5, 33, 48)])
def test_triton_gemm_on_each_layout_no_further_from_float64_than_eager(layout, precision, m, k, n):
    a, b = _operands(layout, m, k, n, seed=m * k + n)
    for copies in (False, True):
        out = linear.LinearImplementation(precision, SMALL, copies)(linear.LinearCall(a, b, None, "tf32x3", "auto"))
        assert_no_further_from_float64(f"{layout} copies={copies}", out, F.linear(a, b),
                                       F.linear(a.double(), b.double()))


@pytest.mark.parametrize("m, k, n", [(0, 8, 5), (5, 0, 7), (5, 8, 0)], ids=["no_rows", "empty_reduction", "no_columns"])
def test_an_empty_gemm_is_left_to_cublas(m, k, n):
    """A training batch of no rows makes empty GEMMs: no output rows (forward, dX) or an empty reduction
    (dW, whose K is the batch). The Triton GEMM has nothing to tile: every config says so, instead of
    failing while it sizes its blocks, and the call runs on cuBLAS (zeros plus the bias where K = 0)."""
    for layout in ("forward", "grad_x", "grad_weight"):
        a, b = _operands(layout, m, k, n, seed=7)
        bias = torch.randn(n, device=KERNEL_DEVICE)
        call = linear.LinearCall(a, b, bias, "tf32x3", "auto")
        for precision in ("tf32x3", "split_w", "split_x"):
            assert linear.LinearImplementation(precision, SMALL).unlaunchable(call) == "no rows", (layout, precision)
        cublas = linear.LinearImplementation("tf32x3")
        assert cublas.unlaunchable(call) is None
        assert torch.equal(cublas(call), F.linear(a, b, bias))


@pytest.mark.parametrize("layout, precision, blocks", [("grad_weight", "split_w", [32, 32, 6]),
                                                       ("forward", "split_w", [32, 32, 6]),
                                                       ("grad_x", "split_x", [64, 6]), ("grad_x", "tf32x3", [64, 6]),
                                                       ("forward", "tf32x3", [70])])
def test_blocks_of_w_bound_its_copies_and_change_no_bit(layout, precision, blocks, monkeypatch):
    """Where the GEMM copies W (its split: two copies; a K-major copy of a transposed view: one), it runs
    on blocks of W's rows whose copies stay within the bound, and gives bit for bit one launch's result:
    every y tile is the same dot products in the same order. 70 columns: the last block is partial.
    A block may also take block_tiles tiles, in whole column tiles: of 3 row tiles (37 rows of 16), 9 take
    96 columns (one block), 7 take 64, 5 one column tile (32 columns: the copy's bound decides)."""
    a, b = _operands(layout, 37, 24, 70, seed=3)
    whole = gemm.run_gemm(gemm.Linear(a, b, None), precision, SMALL).y
    launched, workspaces = [], []
    gemm_into = gemm.gemm_into

    def recording(y, y_col0, block, *rest, workspace=None):
        launched.append(block.weight.shape[0])
        workspaces.append(workspace)
        return gemm_into(y, y_col0, block, *rest, workspace=workspace)
    monkeypatch.setattr(gemm, "gemm_into", recording)
    bound = 2 * SMALL.block_n * 24 * 4  # one column tile's split of a 24-wide fp32 W
    y = linear.run_in_blocks(gemm.Linear(a, b, None), precision, SMALL, copy_bytes=bound, block_tiles=1)
    assert torch.equal(y, whole)
    assert launched == blocks
    # W's split is made into one workspace of a block's rows, which every block reuses
    if precision == "split_w":
        assert all(w is workspaces[0] for w in workspaces) and workspaces[0][0].shape == (blocks[0], 32)
    else:
        assert workspaces == [None] * len(blocks)
    launched.clear()
    linear.run_in_blocks(gemm.Linear(a, b, None), precision, SMALL, copy_bytes=bound, block_tiles=9)
    assert launched == [70]
    launched.clear()
    linear.run_in_blocks(gemm.Linear(a, b, None), precision, SMALL, copy_bytes=bound, block_tiles=7)
    assert launched == ([64, 6] if blocks != [70] else [70])
    launched.clear()
    linear.run_in_blocks(gemm.Linear(a, b, None), precision, SMALL, copy_bytes=bound, block_tiles=5)
    assert launched == blocks


@pytest.mark.parametrize("batch, out_features, in_features, rows", [
    (4096, 4096, 4096, 1024),  # the MLP's hidden layer: 32 row tiles, 8 column tiles a block (256 tiles)
    (16384, 4096, 4096, 1024),
    (1024, 8192, 8192, 2048),  # 64 row tiles: 4 column tiles would do; COPY_BYTES allows 16
    (4096, 256, 4096, 4096),  # the MLP's last layer: 2 row tiles, whole
])
def test_a_weight_gradients_blocks_are_whole_waves_of_tiles(batch, out_features, in_features, rows, monkeypatch):
    """On an H100's 132 SMs a weight gradient's split operand (x^T, in_features x batch) runs in blocks of
    at most two waves of output tiles, in whole column tiles (rounded down: a block of 2.2 waves runs in
    three), unless COPY_BYTES allows more."""
    monkeypatch.setattr(gemm_configs, "sm_count", lambda device: 132)
    g, x = torch.empty(batch, out_features, device="meta"), torch.empty(batch, in_features, device="meta")
    config = gemm_configs.candidates("split_w", torch.float32)[0]
    assert min(in_features, blocks.block_rows(gemm.Linear(g.t(), x.t(), None), "split_w", config)) == rows


@pytest.mark.parametrize("layout, precision", [("grad_weight", "split_w"), ("forward", "split_x")])
def test_a_split_copy_past_the_limit_leaves_the_call_to_cublas(layout, precision, monkeypatch):
    """A split whose copies would pass SPLIT_COPY_LIMIT (a weight gradient's block of a batch-sized
    operand; x split whole) cannot run on the Triton GEMM: the op runs it on cuBLAS, and the tuner is not
    offered it. At the limit it still can."""
    a, b = _operands(layout, 37, 24, 70, seed=5)
    call = linear.LinearCall(a, b, None, "tf32x3", "auto")
    impl = linear.LinearImplementation(precision, SMALL)
    blocked = min(70, blocks.block_rows(gemm.Linear(a, b, None), precision, SMALL))
    split_rows = 37 if precision == "split_x" else blocked
    copy_bytes = 2 * split_rows * 32 * 4  # 24 columns, padded to 32
    monkeypatch.setattr(linear, "SPLIT_COPY_LIMIT", copy_bytes)
    assert impl.unlaunchable(call) is None
    monkeypatch.setattr(linear, "SPLIT_COPY_LIMIT", copy_bytes - 1)
    assert "copies would take" in impl.unlaunchable(call)
    def offered():  # but the warp-specialized GEMM splitting in the kernel, which copies nothing
        found = linear.candidates(call, linear.problem(call, False), False).values()
        return {c.precision for c in found if not (c.config and c.config.split_in_kernel)}

    monkeypatch.setattr(linear, "SPLIT_COPY_LIMIT", 1 << 40)
    assert offered() & set(gemm_precisions.PRE_SPLIT)
    monkeypatch.setattr(linear, "SPLIT_COPY_LIMIT", 0)
    assert offered() == {"tf32x3"}  # cuBLAS at the call's precision (and 3xTF32 split in registers)
    in_memory, in_kernel = warp_specialized_gemm.CONFIGS[0], warp_specialized_gemm.CONFIGS[2]
    assert "copies would take" in linear._copy_past_limit(call, precision, in_memory)
    assert linear._copy_past_limit(call, precision, in_kernel) is None


@pytest.mark.parametrize("batch, features, within", [(16384, 4096, True), (1024, 8192, True), (4096, 4096, True),
                                                     (65552, 4096, False), (262144, 1024, False)])
def test_the_seed_problems_weight_gradients_split_within_the_limit(batch, features, within, monkeypatch):
    """On an H100's 132 SMs the seed problems' weight gradients (the largest: 16384 rows of 4096 features,
    split in blocks of 1024 features: 128 MiB) keep their pre-split GEMM; a large batch does not (65552
    rows: a block's split takes 512.1 MiB)."""
    monkeypatch.setattr(gemm_configs, "sm_count", lambda device: 132)
    g, x = torch.empty(batch, features, device="meta"), torch.empty(batch, features, device="meta")
    call = linear.LinearCall(g.t(), x.t(), None, "tf32x3", "auto")
    config = gemm_configs.candidates("split_w", torch.float32)[0]
    assert (linear._copy_past_limit(call, "split_w", config) is None) == within


def _candidates(a, b, traced, fp32_matmul="tf32x3", gemm_option="auto", operand_copies=True):
    call = linear.LinearCall(a, b, None, fp32_matmul, gemm_option, None, operand_copies)
    return linear.candidates(call, linear.problem(call, traced), traced)


@pytest.mark.parametrize("search", ["off", "short", "full"])
@pytest.mark.parametrize("traced", [False, True])
def test_candidates(traced, search, monkeypatch):
    monkeypatch.setenv("FUSEPASS_TUNE", {"off": "0", "short": "1", "full": "full"}[search])
    a, b = _operands("grad_weight", 64, 64, 64, seed=0)
    names = list(_candidates(a, b, traced))
    assert names[0].startswith("triton split_w ")  # the fast default for transposed operands
    assert names[-1] == "cublas"
    assert not any(" tma" in n for n in names)  # transposed views cannot be TMA descriptors
    full = search == "full"
    assert any(n.startswith("triton tf32x3") for n in names) == full
    assert any(n.endswith("on K-major copies") for n in names) == full
    forward = list(_candidates(*_operands("forward", 64, 64, 64, seed=0), traced))
    assert forward[0].startswith("triton tf32x3 ") and any(n.startswith("triton split_") for n in forward)
    assert not any(n.endswith("on K-major copies") for n in forward)
    assert len(forward) > len(names) - full * 2
    assert list(_candidates(a, b, traced, fp32_matmul="ieee")) == ["cublas"]
    assert list(_candidates(a, b, traced, gemm_option="cublas")) == ["cublas"]
    assert "cublas" not in _candidates(a, b, traced, gemm_option="triton")
    # no operand copies: 3xTF32 split in registers, the warp-specialized GEMM splitting in the kernel (it
    # copies nothing; on sm_90) and cuBLAS only, for transposed operands and the forward's
    for operands in ((a, b), _operands("forward", 64, 64, 64, seed=0)):
        no_copies = list(_candidates(*operands, traced, operand_copies=False))
        assert no_copies and all(n == "cublas" or n.startswith("triton tf32x3 ") or n.endswith("split in kernel")
                                 for n in no_copies)
        assert not any(n.endswith("on K-major copies") for n in no_copies)


def test_forbidding_operand_copies_is_a_problem_of_its_own():
    """Choices made with copies allowed never serve a call that forbids them (the tuning cache's key)."""
    a, b = _operands("grad_weight", 64, 64, 64, seed=0)
    allowed, forbidden = (linear.LinearCall(a, b, None, "tf32x3", "auto", None, copies) for copies in (True, False))
    assert linear.problem(allowed, False).family != linear.problem(forbidden, False).family


def test_cuda_graphs_are_a_problem_of_their_own():
    """A choice made where launches replay from CUDA graphs (the warp-specialized GEMM's host time hidden)
    never serves a call without them (the tuning cache's key)."""
    a, b = _operands("grad_weight", 64, 64, 64, seed=0)
    ungraphed, graphed = (linear.LinearCall(a, b, None, "tf32x3", "auto", None, True, graphs)
                          for graphs in (False, True))
    assert linear.problem(ungraphed, False).family != linear.problem(graphed, False).family


@pytest.mark.parametrize("precision, graphs, flop, offered", [
    ("tf32x3", False, 1.3e8, False), ("tf32x3", False, 4e9, True), ("tf32x3", False, 8.6e9, True),
    ("tf32x3", True, 1.3e8, True), ("tf32", False, 1.4e11, False), ("tf32", False, 5.5e11, True),
    ("tf32", True, 1e9, True)])
def test_without_cuda_graphs_the_warp_specialized_gemm_is_offered_where_its_launch_pays(precision, graphs, flop,
                                                                                        offered):
    """In 3xTF32 from UNHIDDEN_MIN_FLOP: a 128 x 1024 -> 512 weight gradient (1.3e8 FLOP) is not, the MLP's last
    layer (8.6e9) is; in TF32 1024 x 8192 -> 8192 (1.4e11) is not, 16384 x 4096 -> 4096 (5.5e11) is; under CUDA
    graphs every size."""
    a, b = _operands("forward", 8, 8, 8, seed=0)
    call = linear.LinearCall(a, b, None, "tf32x3", "auto", None, True, graphs)
    assert linear.warp_specialized_offered(call, flop, precision) is offered


@pytest.mark.parametrize("graphs, flop, in_memory", [(False, 1.4e11, False), (False, 5.5e11, True),
                                                     (True, 1e9, True)])
def test_without_cuda_graphs_the_warp_specialized_gemm_prepares_in_memory_for_large_gemms_only(graphs, flop,
                                                                                              in_memory):
    """Prepared in memory, a call launches two kernels from Python and copies an operand: 1024 x 8192 -> 8192
    (1.4e11 FLOP) splits in the kernel, 16384 x 4096 -> 4096 (5.5e11) may do either; under CUDA graphs, any."""
    a, b = _operands("forward", 8, 8, 8, seed=0)
    call = linear.LinearCall(a, b, None, "tf32x3", "auto", None, True, graphs)
    assert linear.launches_hidden(call, flop) is in_memory


def test_short_search_times_fewer_configs_and_small_tiles_only_where_sms_idle():
    configs = gemm_configs.candidates("native", torch.bfloat16)
    cuda = torch.device("cuda")
    many_tiles = gemm_configs.shortlist(configs, 8192, 8192, torch.device("cpu"))
    persistent = dataclasses.replace(configs[0], persistent=True)
    assert many_tiles == [configs[0], persistent, configs[0].with_tma()]  # the first's tiles, every way
    split = gemm_configs.candidates("split_x", torch.float32)  # one tile shape at two pipeline depths: all kept
    assert gemm_configs.shortlist(split, 8192, 8192, torch.device("cpu")) == split
    rounded_w = gemm_configs.candidates("round_w", torch.float32)  # persistent on other tiles: still timed
    shortlisted = gemm_configs.shortlist(rounded_w, 8192, 8192, torch.device("cpu"))
    assert [(c.block_m, c.block_n, c.persistent) for c in shortlisted] == [(128, 256, False), (256, 128, True),
                                                                           (128, 256, False)]
    if torch.cuda.is_available():
        few_tiles = gemm_configs.shortlist(configs, 128, 512, cuda)
        assert few_tiles[:3] == many_tiles and few_tiles[3].block_m == 64 and len(few_tiles) == 4


def test_op_on_cpu_is_eager_linear_with_its_gradients():
    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(s, generator=g, requires_grad=True) for s in ((9, 13), (6, 13), (6,)))
    out = linear.call(x, w, b, KernelOptions())
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    ref = F.linear(x2, w2, b2)
    assert torch.equal(out, ref)
    upstream = torch.randn(out.shape, generator=g)
    out.backward(upstream)
    ref.backward(upstream)
    for fused, eager in ((x, x2), (w, w2), (b, b2)):
        torch.testing.assert_close(fused.grad, eager.grad)


def test_bad_shapes_fail_like_eager_in_the_fake():
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x, w = torch.empty(4, 5), torch.empty(3, 6)
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            torch.ops.fusepass.linear(x, w, None, "tf32x3", "auto")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("gemm_choice", ["auto", "triton", "cublas"])
@pytest.mark.parametrize("m, k, n", [(37, 40, 19), (300, 257, 130)])
def test_op_and_its_gradients_no_further_from_float64_than_eager_on_cuda(gemm_choice, m, k, n, monkeypatch):
    monkeypatch.setenv("FUSEPASS_TUNE", "1")
    g = torch.Generator(device="cuda").manual_seed(m + n)
    leaves = [torch.randn(s, device="cuda", generator=g) for s in ((m, k), (n, k), (n,))]
    upstream = torch.randn((m, n), device="cuda", generator=g, dtype=torch.float64)
    results = {}
    for name in ("fused", "eager", "float64"):
        x, w, b = (t.detach().clone().to(torch.float64 if name == "float64" else torch.float32).requires_grad_()
                   for t in leaves)
        out = linear.call(x, w, b, KernelOptions(gemm=gemm_choice)) if name == "fused" else F.linear(x, w, b)
        (out.double() * upstream).sum().backward()
        results[name] = (out, x.grad, w.grad, b.grad)
    for i, what in enumerate(("out", "grad x", "grad weight", "grad bias")):
        assert_no_further_from_float64(what, results["fused"][i], results["eager"][i], results["float64"][i])


@requires_cuda
@pytest.mark.cuda
def test_weight_gradient_copies_stay_within_the_bound_on_cuda():
    """A weight gradient on the pre-split GEMM (8192 x 8192, 1024-row batch; its W split whole: 64 MiB):
    beyond its output, the call holds about a block's copies at any time (16 MiB: COPY_BYTES, above a block
    of BLOCK_WAVES waves of tiles), and stays exact."""
    torch.manual_seed(0)
    g, x = torch.randn(1024, 8192, device="cuda"), torch.randn(1024, 8192, device="cuda")
    call = linear.LinearCall(g.t(), x.t(), None, "tf32x3", "auto")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grad_weight = linear.LinearImplementation("split_w", gemm_configs.candidates("split_w", torch.float32)[0])(call)
    torch.cuda.synchronize()
    beyond_output = torch.cuda.max_memory_allocated() - before - grad_weight.numel() * 4
    assert beyond_output <= 24 << 20
    assert_no_further_from_float64("grad_weight", grad_weight, g.t() @ x, g.t().double() @ x.double())


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("implementation", ["triton", "library"])
def test_a_widened_output_is_the_fp32_sum_of_half_precision_products(dtype, implementation):
    """out_dtype=fp32 (a chain's weight gradient under autocast): the GEMM's fp32 accumulators come out
    as they are, on the weight gradient's layout. Products of half-precision values are exact in fp32,
    so the result is float64's to fp32 accumulation error, far below the rounding of a half-precision
    output."""
    a, b = (t.to(dtype) for t in _operands("grad_weight", 45, 77, 38, seed=11))
    impl = (linear.LinearImplementation("native", SMALL) if implementation == "triton"
            else linear.LinearImplementation("native"))
    out = impl(linear.LinearCall(a, b, None, "tf32x3", "auto", torch.float32))
    rounded = impl(linear.LinearCall(a, b, None, "tf32x3", "auto"))
    exact = F.linear(a.double(), b.double())
    assert out.dtype == torch.float32 and rounded.dtype == dtype
    assert rel_error(out, exact) < 1e-6 < rel_error(rounded, exact) / 100


def test_widened_op_checks_and_fake():
    """The op with out_dtype: its schema, fake and autograd (opcheck); fp32 only, from bf16 or fp16."""
    g = torch.Generator().manual_seed(6)
    x, w = (torch.randn(s, generator=g).bfloat16().requires_grad_() for s in ((9, 13), (6, 13)))
    torch.library.opcheck(torch.ops.fusepass.linear.default, (x, w, None, "tf32x3", "auto", torch.float32))
    assert linear.call(x, w, None, KernelOptions(), torch.float32).dtype == torch.float32
    with pytest.raises(RuntimeError, match="out_dtype"):
        linear.call(x, w, None, KernelOptions(), torch.float16)
    with pytest.raises(RuntimeError, match="out_dtype"):
        linear.call(x.float(), w.float(), None, KernelOptions(), torch.float64)
