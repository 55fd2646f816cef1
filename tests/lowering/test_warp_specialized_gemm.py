"""The warp-specialized Gluon TF32 / 3xTF32 GEMM (warp_specialized_gemm.py): it compiles for Hopper on a
machine without one, is offered only where it can run, and on an H100/H200 is as exact as the Triton GEMM
of the same precision (split_w, round_w) at shapes that leave partial tiles in every dimension, alone,
through the linear op and in a compiled graph. Gluon kernels have no interpreter: on CPU only their
compilation and the op's plumbing are tested."""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import triton
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fusepass.lowering import blocks, choice, gemm, gemm_configs, gemm_precisions, linear, warp_specialized_gemm
from fusepass.lowering import warp_specialized_kernels as kernels
from fusepass.lowering.implementations import Implementation, prepared_rows_per_launch
from fusepass.lowering.launch import ceil_div
from fusepass.lowering.schema import KernelOptions
from fusepass.numerics import rel_error
from tests.chains import requires_cuda
from tests.lowering.cases import KERNEL_DEVICE, assert_like_eager, make_args

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
requires_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
# The kernel's modes for b, by the names the tests give them: split in memory, or a K-major or MN-major raw tile
B_MODES = {"memory": kernels.B_SPLIT_IN_MEMORY, "K": kernels.B_K_MAJOR, "MN": kernels.B_MN_MAJOR}
# Each precision with the Triton GEMM it is as exact as, and the bound on its error at the tests' shapes
TRITON_TWIN = {2: ("split_w", 1e-6), 1: ("round_w", 1e-3)}
# Each precision with its first config that prepares in memory and its first that prepares in the kernel
IN_MEMORY_AND_IN_KERNEL = [next((p, c) for p, c in warp_specialized_gemm.CANDIDATES
                                if p == precision and c.split_in_kernel == in_kernel)
                           for precision in gemm_precisions.PREPARED for in_kernel in (False, True)]


def CASE_ID(value):
    return value if isinstance(value, str) else value.describe()


def _compile_for_hopper(a_k_major: bool, b_mode: str, statistics: bool, transposed: bool, parts: int) -> str:
    """The kernel's PTX for sm_90 (compiled to a cubin) with `a` K-major or MN-major and b split (rounded) in
    memory ("memory") or in the kernel from a K-major or MN-major tile ("K", "MN"), in `parts` tf32 parts
    (the tiles of their first config: 3xTF32 128 columns, TF32 256), with or without the statistics
    epilogue (over y's tile or y^T's), as the compile-only script below prints it."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def descriptor(k_major, rows):
        block = [rows, 32] if k_major else [32, rows]
        return f"tensordesc<fp32[{block[0]},{block[1]}],{gl.NVMMASharedLayout.get_default_for(block, gl.float32)!r}>"

    mode = B_MODES[b_mode].value
    config = (warp_specialized_gemm.CONFIGS if parts == 2 else warp_specialized_gemm.ROUNDED_CONFIGS)[0]
    block_n = config.block_n
    signature = {"a_desc": descriptor(a_k_major, 128), "b_desc": descriptor(b_mode != "MN", block_n),
                 "lo_desc": descriptor(True, block_n),
                 **{name: "*fp32" for name in ("out_ptr", "partials_ptr", "bias_ptr", "scale_ptr", "parts_ptr")},
                 **{name: "i32" for name in ("M", "N", "K", "stride_om", "stride_on", "part_stride",
                                             "m2_offset", "k_steps_per_split")},
                 "scale_value": "fp32",
                 **{name: "constexpr" for name in ("BLOCK_M", "A_K_MAJOR", "B_MODE", "PARTS", "HALF_LAYOUT",
                                                   "STATISTICS", "TRANSPOSED", "HAS_BIAS", "SCALE_MODE", "STAGES",
                                                   "GROUP", "CONSUMER_REGS", "LOADER_REGS")}}
    constexprs = dict(BLOCK_M=128, A_K_MAJOR=a_k_major, B_MODE=mode, PARTS=parts,
                      HALF_LAYOUT=gl.NVMMASharedLayout.get_default_for([block_n, 32], gl.float32),
                      STATISTICS=statistics, TRANSPOSED=transposed, HAS_BIAS=statistics, SCALE_MODE=2,
                      STAGES=warp_specialized_gemm.stages_that_fit(config, mode, parts), GROUP=8, CONSUMER_REGS=232,
                      LOADER_REGS=40)
    compiled = triton_compile(GluonASTSource(kernels.gemm_kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert compiled.asm["cubin"]
    return compiled.asm["ptx"]


@pytest.mark.skipif(kernels.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("a_major, b_mode, epilogue, parts", [
    ("K", "memory", "store", 2), ("MN", "memory", "store", 2), ("K", "memory", "statistics", 2), ("K", "K", "store", 2),
    ("MN", "MN", "store", 2), ("MN", "K", "statistics_transposed", 2),
    ("K", "memory", "store", 1), ("MN", "MN", "statistics", 1), ("K", "K", "statistics_transposed", 1)])
def test_the_kernel_compiles_for_hopper_with_two_consumer_warpgroups(a_major, b_mode, epilogue, parts):
    """In a process of its own, without TRITON_INTERPRET (test_compiles.py). Per consumer and K block of 32:
    three products (3xTF32; TF32 one) of four k=8 wgmmas each, waited for (level 0) by that consumer alone;
    setmaxnreg gives the consumers their registers and takes them from the loader. Splitting b in the
    kernel, each consumer
    fences its half of the split for the async proxy, the first block's before its loop and the next
    block's between its wgmmas' commit and their wait (split while they run); b split in memory, nothing
    is fenced, and a K-major `a` tile is read from shared memory with ldmatrix, an MN-major one (read
    transposed) without."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, __file__, a_major, b_mode, epilogue, str(parts)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    wgmmas, waits, raised, fences, split_under_wgmmas, ldmatrix = (int(v) for v in done.stdout.split()[-6:])
    assert wgmmas == 2 * (3 if parts == 2 else 1) * 4 and waits == 2 and raised >= 2, done.stdout
    in_kernel = b_mode != "memory"
    assert fences == 2 * 2 * in_kernel and split_under_wgmmas == in_kernel, done.stdout
    if not in_kernel:  # (the split's reads of b may use ldmatrix too)
        assert (ldmatrix > 0) == (a_major == "K"), done.stdout


def test_offered_only_where_it_runs():
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    why = warp_specialized_gemm.unlaunchable(x, w, torch.float32)
    assert why in ("this Triton has no Gluon", "the warp-specialized GEMM is Hopper's (sm_90 wgmma)")
    assert _offered_variants(x, w) == [set(), set()]


def _offered_variants(x, w) -> list[set]:
    """The warp-specialized variants the linear op offers x @ w^T under CUDA graphs (where launching from Python
    costs a step nothing at any size), with TF32 off and on."""
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:  # set and restored by hand (test_backend.py says why)
        offered = []
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            call = linear.LinearCall(x, w, None, "tf32x3", "auto", None, True, True)
            names = list(linear.candidates(call, linear.problem(call, traced=False), traced=False))
            offered.append({n.split()[1] for n in names if "warp-specialized" in n})
        return offered
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


@requires_cuda
@requires_hopper
@pytest.mark.cuda
def test_on_hopper_it_runs_for_the_layouts_tma_reads():
    cuda = torch.randn(8, 16, device="cuda"), torch.randn(4, 16, device="cuda")
    assert warp_specialized_gemm.unlaunchable(*cuda, torch.float32) is None
    assert "fp32" in warp_specialized_gemm.unlaunchable(*(t.bfloat16() for t in cuda), torch.bfloat16)
    mn_major = cuda[0].t().contiguous().t()
    assert warp_specialized_gemm.unlaunchable(mn_major, cuda[1], torch.float32) is None
    neither = torch.randn(8, 32, device="cuda")[:, ::2]
    in_memory, in_kernel = warp_specialized_gemm.CONFIGS[0], warp_specialized_gemm.CONFIGS[2]
    assert "TMA" in warp_specialized_gemm.unlaunchable(neither, cuda[1], torch.float32, "split_w", in_memory)
    # split in memory, b may lie as it will; split in the kernel, TMA reads it too
    assert warp_specialized_gemm.unlaunchable(neither, cuda[1], torch.float32, "split_x", in_memory) is None
    assert "TMA" in warp_specialized_gemm.unlaunchable(neither, cuda[1], torch.float32, "split_x", in_kernel)
    mn_major_w = cuda[1].t().contiguous().t()
    assert warp_specialized_gemm.unlaunchable(cuda[0], mn_major_w, torch.float32, "split_w", in_kernel) is None
    wide_k = dataclasses.replace(in_kernel, block_k=64, num_stages=2)
    assert "one stage" in warp_specialized_gemm.unlaunchable(cuda[0], mn_major_w, torch.float32, "split_w", wide_k)
    assert warp_specialized_gemm.unlaunchable(cuda[0], mn_major_w, torch.float32, "split_x", wide_k) is None
    # rounded, b's tile has no lo beside it: the wide K blocks fit two stages
    assert warp_specialized_gemm.unlaunchable(cuda[0], mn_major_w, torch.float32, "round_w", wide_k) is None
    no_k = torch.empty(8, 0, device="cuda"), torch.empty(4, 0, device="cuda")
    assert "no columns" in warp_specialized_gemm.unlaunchable(*no_k, torch.float32, "split_w", in_kernel)
    assert _offered_variants(*cuda) == [{"split_w", "split_x"}, {"round_w", "round_x"}]


@pytest.mark.parametrize("precision, variants", [("tf32x3", {"split_w", "split_x"}), ("tf32", {"round_w", "round_x"})])
def test_with_operand_copies_forbidden_only_the_split_in_the_kernel_is_offered(precision, variants):
    offered = warp_specialized_gemm.candidates(precision, True)
    assert offered and {p for p, _ in offered} == variants
    assert set(offered) < set(warp_specialized_gemm.CANDIDATES)
    forbidden = warp_specialized_gemm.candidates(precision, False)
    assert forbidden and all(config.split_in_kernel for _, config in forbidden)
    assert {p for p, _ in forbidden} == variants
    assert warp_specialized_gemm.candidates("native", True) == []


@pytest.mark.parametrize("x_rows, weight_rows, k, splits", [
    (4096, 256, 4096, 2),  # the MLP's last layer: 64 tiles on 132 SMs
    (256, 4096, 4096, 2),  # its weight gradient, g^T @ x
    (4096, 4096, 4096, 1),  # 1024 tiles: a wave and more
    (128, 128, 8192, 4),  # one tile: at most MAX_K_SPLITS
    (128, 128, 600, 2),  # 19 K blocks: two splits of at least MIN_K_BLOCKS_PER_SPLIT
    (4096, 256, 200, 1)])  # a K of 7 blocks
def test_k_is_split_only_as_far_as_the_sms_are_idle_and_k_is_long(monkeypatch, x_rows, weight_rows, k, splits):
    monkeypatch.setattr(warp_specialized_gemm, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    for precision, config in K_SPLIT_CANDIDATES:
        assert warp_specialized_gemm.k_splits(precision, config, x_rows, weight_rows, k, cpu) == splits
        matmul = "tf32x3" if gemm_precisions.prepared(precision).parts == 2 else "tf32"
        offered = warp_specialized_gemm.candidates(matmul, True, (x_rows, weight_rows, k, cpu))
        assert ((precision, config) in offered) is (splits > 1)
    plain = warp_specialized_gemm.CONFIGS[2]
    assert warp_specialized_gemm.k_splits("split_w", plain, 4096, 256, 4096, cpu) == 1


def test_a_chain_is_never_offered_a_k_split():
    """Its forward's statistics epilogue needs the whole sum of each tile (the chain passes no sizes)."""
    for precision in ("tf32x3", "tf32"):
        assert not any(config.split_k for _, config in warp_specialized_gemm.candidates(precision, True))
    x, w = torch.randn(300, 8), torch.randn(7, 8)
    with pytest.raises(ValueError, match="without statistics"):
        torch.ops.fusepass.warp_specialized_linear(x, w, None, None, 1.0, True, "split_w", 0, 128, 32, 4, True)
    with pytest.raises(ValueError, match="without statistics"):
        torch.ops.fusepass.warp_specialized_linear(x, w, None, None, 1.0, False, "split_w", 128, 128, 32, 4, True)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_a_small_chain_is_offered_it_on_hopper_under_cuda_graphs_only(training, cuda_graphs):
    """Training (statistics in its epilogue) and eval (the passes after it) alike; a small GEMM only under
    CUDA graphs: without them the step would pay its launches from Python on the host."""
    args = make_args(300, 64, 200, training=training, device="cuda" if ON_HOPPER else "cpu",
                     kernel=KernelOptions(cuda_graphs=cuda_graphs))
    names = list(choice.candidates(args, choice.problem(args, traced=False), traced=False))
    offered = len(warp_specialized_gemm.candidates("tf32x3", True)) if ON_HOPPER and cuda_graphs else 0
    assert sum("warp-specialized" in n for n in names) == offered, names


@pytest.mark.parametrize("save_linear_out", [True, False])
@pytest.mark.parametrize("rows, offered", [(256, False), (1024, True), (4096, True)])
def test_without_cuda_graphs_a_3xtf32_gemm_of_enough_flop_is_offered_it(rows, offered, save_linear_out):
    """Training (a linear output saved) or inference alike: at 4096 -> 4096 features, 8.6e9 FLOP at 256 rows
    is not offered, 3.4e10 at 1024 is; under CUDA graphs, every size."""
    args = make_args(8, 4096, 4096, save_linear_out=save_linear_out, kernel=KernelOptions(cuda_graphs=False))
    assert choice.warp_specialized_offered(args, rows) is offered
    graphed = make_args(8, 4096, 4096, save_linear_out=save_linear_out, kernel=KernelOptions(cuda_graphs=True))
    assert choice.warp_specialized_offered(graphed, rows)


@pytest.mark.parametrize("save_linear_out", [True, False])
@pytest.mark.parametrize("rows, offered", [(4096, False), (16384, True)])
def test_without_cuda_graphs_a_tf32_gemm_needs_more_flop(rows, offered, save_linear_out):
    """One TF32 product takes a third of 3xTF32's time, so it hides the op's host time only in a larger GEMM:
    at 4096 -> 4096 features 1.4e11 FLOP at 4096 rows is not offered (3xTF32 is), 5.5e11 at 16384 is."""
    args = make_args(8, 4096, 4096, save_linear_out=save_linear_out, kernel=KernelOptions(cuda_graphs=False))
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:  # set and restored by hand (test_backend.py says why)
        torch.backends.cuda.matmul.allow_tf32 = True
        assert choice.warp_specialized_offered(args, rows) is offered
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert choice.warp_specialized_offered(args, rows)


@pytest.mark.parametrize("save_linear_out", [True, False])
def test_a_matmul_heads_weight_is_offered_it_at_any_size(save_linear_out):
    """An (in, out) W seen as (out, in): the Triton GEMM would copy it K-major on every call."""
    args = make_args(8, 64, 48, save_linear_out=save_linear_out, kernel=KernelOptions(cuda_graphs=False))
    in_out = args.linear.weight.t().contiguous().t()
    head = dataclasses.replace(args, linear=dataclasses.replace(args.linear, weight=in_out))
    assert head.linear.weight.stride() == (1, 48)
    assert choice.warp_specialized_offered(head, 8)
    assert not choice.warp_specialized_offered(args, 8)


@requires_cuda
@requires_hopper
@pytest.mark.cuda
@pytest.mark.parametrize("rows, features, graphs, in_memory", [(1024, 8192, False, False), (16384, 4096, False, True),
                                                               (1024, 8192, True, True)])
def test_a_weight_gradients_candidates_prepare_in_memory_only_where_its_launches_are_hidden(rows, features, graphs,
                                                                                           in_memory):
    """What linear.candidates offers a training step's dW, g^T @ x, on Hopper: the warp-specialized GEMM split
    in the kernel always; split in memory (a second launch from Python, and copies) only under CUDA graphs or
    from UNGRAPHED_MIN_FLOP: 1024 x 8192 -> 8192 (1.4e11 FLOP) is below it, 16384 x 4096 -> 4096 (5.5e11) not."""
    grad_y, x = (torch.empty(rows, features, device="cuda") for _ in range(2))
    call = linear.LinearCall(grad_y.t(), x.t(), None, "tf32x3", "auto", None, True, graphs)
    names = list(linear.candidates(call, linear.problem(call, False), False))
    warp_specialized = [n for n in names if "warp-specialized" in n]
    in_kernel = [n for n in warp_specialized if n.endswith("split in kernel")]
    assert in_kernel, names
    assert (len(warp_specialized) > len(in_kernel)) is in_memory, names


@pytest.mark.parametrize("split, block_n, part_rows", [("split_w", 128, 64), ("split_x", 128, 128),
                                                       ("round_w", 256, 64), ("round_x", 256, 256)])
def test_the_ops_fake_is_an_fp32_product_with_its_partials(split, block_n, part_rows):
    with FakeTensorMode():
        x, w = torch.empty(300, 8), torch.empty(7, 8)
        y, parts = torch.ops.fusepass.warp_specialized_linear(x, w, None, None, 1.0, True, split, 256, block_n, 32, 4)
        _, none = torch.ops.fusepass.warp_specialized_linear(x, w, None, None, 1.0, False, split, 0, block_n, 32, 4)
    assert y.shape == (300, 7) and y.dtype == torch.float32
    assert parts.shape == (2 * -(-300 // part_rows) * 7,) and none.shape == (0,)


@pytest.mark.parametrize("split, part_rows", [("split_w", 64), ("round_x", 256)])
def test_the_ops_fake_counts_the_parts_of_a_symbolic_batch(split, part_rows):
    """Traced with a symbolic batch, as a compiled graph with a dynamic batch calls it: the parts' count
    is a ceiling division of the batch (launch.ceil_div, triton.cdiv's formula), at any batch."""
    def op(x, w):
        return torch.ops.fusepass.warp_specialized_linear(x, w, None, None, 1.0, True, split, 0, 256, 32, 4)
    graph = make_fx(op, tracing_mode="symbolic")(torch.empty(1000, 8), torch.empty(7, 8)).graph
    x, w = (n.meta["val"] for n in graph.nodes if n.op == "placeholder")
    [parts] = [n.meta["val"] for n in graph.nodes if n.op == "call_function" and n.args[1:] == (1,)]
    (numel,) = parts.shape
    batch, features = x.shape[0].node.expr, w.shape[0].node.expr
    assert numel.node.expr.free_symbols == {batch, features}
    for rows in (1, part_rows - 1, part_rows, 1000, 4097):
        assert numel.node.expr.subs({batch: rows, features: 7}) == 2 * 7 * triton.cdiv(rows, part_rows)
        assert ceil_div(rows, part_rows) == triton.cdiv(rows, part_rows)


@pytest.mark.parametrize("precision, in_kernel, x_shape, w_shape, rows", [
    ("split_w", False, (4096, 4096), (4096, 4096), 1024),  # the MLP's hidden layer: 8 column tiles of 32 rows
    ("split_x", False, (4096, 1024), (4096, 1024), 2048),  # its first: 16 MiB hold 2048 rows of x split
    ("split_x", False, (300, 1024), (4096, 1024), 1024),  # a batch under one block: one launch, whole tiles
    ("split_w", True, (4096, 4096), (4096, 4096), 0),
])
def test_a_chains_forward_prepares_its_operand_in_the_linear_ops_blocks(monkeypatch, precision, in_kernel, x_shape,
                                                                        w_shape, rows):
    """Not whole: the chain's forward on the warp-specialized GEMM prepares W (or x) in memory in blocks of
    the linear op's rule (on 132 SMs: two waves of output tiles, or 16 MiB of copies where that is more),
    in whole tiles of the prepared operand (a part of x's statistics covers a tile's rows); in the kernel,
    in one launch."""
    monkeypatch.setattr(gemm_configs, "sm_count", lambda device: 132)
    config = next(c for p, c in warp_specialized_gemm.CANDIDATES if p == precision and c.split_in_kernel == in_kernel
                  and not c.split_k)
    x, w = torch.empty(x_shape, device="meta"), torch.empty(w_shape, device="meta")
    assert config.block_n == 128
    assert prepared_rows_per_launch(gemm.Linear(x, w, None), precision, config) == rows


@pytest.mark.parametrize("split, block_rows", [("tf32x3", 128), ("split_x", 200), ("round_x", 200), ("split_w", -1)])
def test_the_op_refuses_a_split_it_cannot_make(split, block_rows):
    """A precision that prepares no operand, statistics of x prepared in blocks that cut a part of 128 rows,
    negative blocks."""
    x, w = torch.randn(300, 8), torch.randn(7, 8)
    with pytest.raises(ValueError, match="blocks of"):
        torch.ops.fusepass.warp_specialized_linear(x, w, None, None, 1.0, True, split, block_rows, 128, 32, 4)


@pytest.mark.parametrize("precision, prepared_operand", [("split_w", "weight"), ("round_w", "weight"),
                                                         ("split_x", "x"), ("round_x", "x")])
def test_the_ops_blocks_are_prepared_into_one_workspace(monkeypatch, precision, prepared_operand):
    """In blocks, each block of the prepared operand (W's or x's rows) is split (rounded) into the first rows
    of one workspace of a block's rows, which every launch reads in turn: the op holds one block's copies,
    however many blocks. 70 rows in blocks of 32: the last block is partial. The kernel is mocked (Gluon
    has no interpreter); the split runs (interpreted on CPU)."""
    g = torch.Generator().manual_seed(5)
    x, w = (torch.randn(shape, generator=g).to(KERNEL_DEVICE) for shape in ((70, 24), (70, 24)))
    launches = []

    def recording(out, a, b, config, parts, transposed, epilogue, b_prepared=False, b_lo=None, splits=1):
        # b itself is kept: a freed block's memory could be handed to the next block's own buffer
        launches.append((b, b[:, :24].clone(), None if b_lo is None else b_lo[:, :24].clone(), transposed))
    monkeypatch.setattr(warp_specialized_gemm, "gemm_into", recording)
    warp_specialized_gemm.warp_specialized_linear(x, w, None, None, 1.0, False, precision, 32, 128, 32, 4)
    operand = x if prepared_operand == "x" else w
    assert [hi.shape[0] for _, hi, _, _ in launches] == [32, 32, 6]
    assert len({b.untyped_storage().data_ptr() for b, _, _, _ in launches}) == 1
    for r0, (_, hi, lo, transposed) in zip((0, 32, 64), launches):
        block = operand[r0:r0 + 32]
        assert transposed == (prepared_operand == "x")
        assert (hi.contiguous().view(torch.int32) & 0x1FFF).eq(0).all()  # tf32: 13 low mantissa bits clear
        if precision.startswith("split"):
            assert torch.equal(hi + lo, block)
        else:
            assert lo is None and torch.allclose(hi, block, rtol=2 ** -11, atol=0)


@pytest.mark.parametrize("block_n, block_k, stages, mode, parts, fit", [
    (128, 32, 4, "memory", 2, 4), (128, 32, 4, "K", 2, 4), (128, 32, 4, "MN", 2, 3), (128, 64, 2, "K", 2, 2),
    (128, 64, 2, "MN", 2, 1), (128, 32, 6, "memory", 1, 6), (128, 32, 6, "MN", 1, 4), (256, 32, 4, "memory", 1, 4),
    (256, 32, 4, "K", 1, 4), (256, 32, 4, "MN", 1, 2), (256, 64, 2, "MN", 1, 1)])
def test_an_mn_major_tile_split_in_the_kernel_takes_a_stage_of_shared_memory(block_n, block_k, stages, mode, parts,
                                                                             fit):
    """b's MN-major tile needs a buffer beside its K-major parts; 64-wide K blocks of 3xTF32 are then
    refused. Rounded (one part), a stage takes a tile less; 256 columns take twice a's tile."""
    config = gemm_configs.GemmConfig(128, block_n, block_k, 8, 4, stages, warp_specialized=True)
    assert warp_specialized_gemm.stages_that_fit(config, B_MODES[mode].value, parts) == fit


def _operands(rows, k, features, layout, seed):
    """x (rows, k) and W (features, k) as a forward, an input gradient (W read through a transposed view) or a
    weight gradient (both) hand them to the GEMM, and a bias."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g)
    w = torch.randn(features, k, device="cuda", generator=g) / k ** 0.5
    if layout in ("grad_x", "grad_w"):
        w = w.t().contiguous().t()
    if layout == "grad_w":
        x = x.t().contiguous().t()
    return x, w, torch.randn(features, device="cuda", generator=g)


def _triton_twin(precision, x, w):
    """The Triton GEMM of the same precision (W split or rounded in memory), and its error bound."""
    twin, bound = TRITON_TWIN[gemm_precisions.prepared(precision).parts]
    config = gemm_configs.candidates(twin, torch.float32)[0]
    return linear.LinearImplementation(twin, config)(linear.LinearCall(x, w, None, "tf32x3", "auto")), bound


@requires_cuda
@requires_hopper
@pytest.mark.cuda
@pytest.mark.parametrize("split, config", [(p, c) for p, c in warp_specialized_gemm.CANDIDATES if not c.split_k],
                         ids=CASE_ID)
@pytest.mark.parametrize("layout", ["forward", "grad_x", "grad_w"])
def test_as_exact_as_the_triton_gemm_of_its_precision_at_partial_tiles(split, config, layout):
    """1000 x 1004 -> 1300 (K ends in a partial block, the last row and column tiles are partial), the
    prepared operand in memory in blocks of 384 rows (three or four blocks, the last partial) or in the
    kernel; grad_x reads W through a transposed view, grad_w x as well (both MN-major)."""
    x, w, _ = _operands(1000, 1004, 1300, layout, seed=3)
    assert warp_specialized_gemm.unlaunchable(x, w, torch.float32, split, config) is None
    y, _ = torch.ops.fusepass.warp_specialized_linear(x, w, None, None, 1.0, False, split,
                                                      0 if config.split_in_kernel else 384, config.block_n,
                                                      config.block_k, config.num_stages)
    exact = F.linear(x.double(), w.double())
    twin, bound = _triton_twin(split, x, w)
    ours, triton_twin = rel_error(y, exact), rel_error(twin, exact)
    assert ours <= 1.5 * triton_twin and ours < bound, (ours, triton_twin)


K_SPLIT_CANDIDATES = [(p, c) for p, c in warp_specialized_gemm.CANDIDATES if c.split_k]


@requires_cuda
@requires_hopper
@pytest.mark.cuda
@pytest.mark.parametrize("split, config", K_SPLIT_CANDIDATES, ids=CASE_ID)
@pytest.mark.parametrize("layout", ["forward", "grad_x", "grad_w"])
@pytest.mark.parametrize("splits", [2, 3, 4])
def test_k_split_across_programs_is_as_exact_and_adds_the_bias_once(split, config, layout, splits):
    """200 x 1004 -> 136: 2 x 2 tiles, partial in both dimensions, and 32 K blocks of 32 (the last partial)
    split in 2, 3 (11, 11, 10) or 4 parts, each summed by programs of their own: as exact as the Triton GEMM of
    its precision, the bias added once, and the same sum as one program per tile to within its precision."""
    x, w, bias = _operands(200, 1004, 136, layout, seed=11)
    how = gemm_precisions.prepared(split)
    transposed = how.operand == "x"
    y, whole = (torch.full((200, 136), float("nan"), device="cuda") for _ in range(2))
    a, b = (w, x) if transposed else (x, w)
    for out, n in ((y, splits), (whole, 1)):
        warp_specialized_gemm.gemm_into(out.t() if transposed else out, a, b, config, how.parts, transposed,
                                        warp_specialized_gemm.Epilogue(bias), splits=n)
    exact = F.linear(x.double(), w.double(), bias.double())
    twin, bound = _triton_twin(split, x, w)
    ours, triton_twin = rel_error(y, exact), rel_error(twin + bias, exact)
    assert ours <= 1.5 * triton_twin and ours < bound, (ours, triton_twin)
    assert rel_error(y, whole) < bound


@requires_cuda
@requires_hopper
@pytest.mark.cuda
@pytest.mark.parametrize("split, config", K_SPLIT_CANDIDATES, ids=CASE_ID)
def test_the_op_splits_k_where_its_tiles_leave_sms_idle(split, config):
    """The op with split_k at 256 x 2048 -> 128 (two tiles, 64 K blocks): k_splits gives it MAX_K_SPLITS parts on
    an H100 or H200, the same result, bit for bit, as gemm_into with that many. A linear op call at the MLP's last
    layer (4096 x 4096 -> 256, 64 tiles, 8.6e9 FLOP) is offered it, one at 4096 x 4096 -> 4096 (1024 tiles) not;
    an input gradient at 128 x 512 -> 1024 (eight tiles, 1.3e8 FLOP) only under CUDA graphs."""
    x, w, bias = _operands(256, 2048, 128, "forward", seed=12)
    splits = warp_specialized_gemm.k_splits(split, config, 256, 128, 2048, x.device)
    assert splits == warp_specialized_gemm.MAX_K_SPLITS
    y, _ = torch.ops.fusepass.warp_specialized_linear(x, w, bias, None, 1.0, False, split, 0, config.block_n,
                                                      config.block_k, config.num_stages, True)
    how = gemm_precisions.prepared(split)
    expected = torch.empty_like(y)
    a, b, out = (w, x, expected.t()) if how.operand == "x" else (x, w, expected)
    warp_specialized_gemm.gemm_into(out, a, b, config, how.parts, how.operand == "x",
                                    warp_specialized_gemm.Epilogue(bias), splits=splits)
    assert torch.equal(y, expected)
    for rows, k, features, graphs, offered in ((4096, 4096, 256, False, True), (4096, 4096, 4096, True, False),
                                               (128, 512, 1024, True, True), (128, 512, 1024, False, False)):
        call = linear.LinearCall(torch.empty(rows, k, device="cuda"), torch.empty(features, k, device="cuda"),
                                 None, "tf32x3", "auto", None, True, graphs)
        names = list(linear.candidates(call, linear.problem(call, False), False))
        assert any("split-K" in n for n in names) is offered, (rows, k, features, graphs, names)


@requires_cuda
@requires_hopper
@pytest.mark.cuda
@pytest.mark.parametrize("precision, config", IN_MEMORY_AND_IN_KERNEL, ids=CASE_ID)
@pytest.mark.parametrize("with_bias", [False, True])
def test_through_the_linear_op_and_a_compiled_graph(precision, config, with_bias):
    """The linear op's implementation, and the custom op inside an Inductor graph: same results, bit for bit, as the
    op run eagerly; with a bias, added in the epilogue."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(777, 512, device="cuda", generator=g)
    w = torch.randn(640, 512, device="cuda", generator=g)
    b = torch.randn(640, device="cuda", generator=g) if with_bias else None
    impl = linear.LinearImplementation(precision, config)
    call = linear.LinearCall(x, w, b, "tf32x3", "auto")
    assert impl.unlaunchable(call) is None
    eager = impl(call)
    compiled = torch.compile(lambda a, c, d: impl(linear.LinearCall(a, c, d, "tf32x3", "auto")) * 2.0)(x, w, b)
    assert torch.equal(compiled, eager * 2.0)
    _, bound = TRITON_TWIN[gemm_precisions.prepared(precision).parts]
    assert rel_error(eager, F.linear(x.double(), w.double(), b.double() if with_bias else None)) < bound


@requires_cuda
@requires_hopper
@pytest.mark.cuda
@pytest.mark.parametrize("precision, config", IN_MEMORY_AND_IN_KERNEL, ids=CASE_ID)
@pytest.mark.parametrize("scale", ["per_feature", "single", "number"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("head", ["linear", "matmul"])
def test_a_chain_on_it_is_no_further_from_float64_than_eager(precision, config, scale, training, head):
    """The chain's forward with, in training, the statistics from the kernel's epilogue (partial row and
    feature tiles: 1000 rows, 300 features; a consumer's last 64 rows hold 40 of the batch, the last 128
    columns of y^T 104), and the passes after it: output, batch statistics and running statistics; in
    eval, the output from the running statistics. A matmul head's W is (in, out), seen as (out, in). In
    TF32 eager's GEMM is cuBLAS's TF32 (the flag allowing it set, as a user would)."""
    args = make_args(1000, 264, 300, scale=scale, tail="gelu_relu", momentum=0.3, training=training)
    if head == "matmul":
        in_out = args.linear.weight.t().contiguous().t()
        args = dataclasses.replace(args, linear=dataclasses.replace(args.linear, weight=in_out))
    impl = Implementation(precision, config)
    assert impl.unlaunchable(args) is None
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:  # set and restored by hand (test_backend.py says why)
        torch.backends.cuda.matmul.allow_tf32 = gemm_precisions.prepared(precision).parts == 1
        assert_like_eager(impl(args), args)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


@requires_cuda
@requires_hopper
@pytest.mark.cuda
@pytest.mark.parametrize("precision, config", IN_MEMORY_AND_IN_KERNEL, ids=CASE_ID)
def test_a_chains_statistics_on_it_stay_exact_far_from_zero(precision, config):
    """Features near 1e4 (a bias of 1e4 on values of spread about 30), some constant over the batch (rows of
    W 0, so that y is the bias there exactly): the statistics from the kernel's epilogue, the output and the
    running statistics no further from float64 than eager's (on CUDA, Welford's), and a constant feature's
    mean its value, its output beta exactly. 1000 rows: partial last tiles of the batch, whichever operand
    the kernel computes as rows. No scale: y * scale rounded, and a multiply-add fused from it in the
    output pass, would leave that rounding in a constant feature's output."""
    args = make_args(1000, 264, 300, scale=None, momentum=0.3)
    constant = slice(40, 72)
    with torch.no_grad():
        args.linear.bias.add_(1e4)
        args.linear.weight[constant] = 0.0
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = gemm_precisions.prepared(precision).parts == 1
        fused = Implementation(precision, config)(args)
        assert_like_eager(fused, args)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert torch.equal(fused.mean[constant], args.linear.bias[constant])
    assert torch.equal(fused.out[:, constant], args.batch_norm.bias[constant].expand(1000, -1))


@requires_cuda
@requires_hopper
@pytest.mark.cuda
@pytest.mark.parametrize("precision, config", [(p, c) for p, c in IN_MEMORY_AND_IN_KERNEL if not c.split_in_kernel],
                         ids=CASE_ID)
def test_a_chain_in_blocks_is_no_further_from_float64_than_eager(monkeypatch, precision, config):
    """Copies bounded to one tile of the prepared operand's rows: the chain's training forward runs a launch
    per 128 (256) rows of W (x), partial last block included, and its output, statistics and running
    statistics stay as exact as eager's."""
    monkeypatch.setattr(blocks, "COPY_BYTES", 1)
    monkeypatch.setattr(blocks, "BLOCK_WAVES", 0)
    launches = []
    gemm_into = warp_specialized_gemm.gemm_into

    def counting(*args, **kwargs):
        launches.append(1)
        return gemm_into(*args, **kwargs)
    monkeypatch.setattr(warp_specialized_gemm, "gemm_into", counting)
    args = make_args(1000, 264, 300, scale="per_feature", tail="gelu_relu", momentum=0.3, training=True)
    prepared_rows = 1000 if gemm_precisions.prepared(precision).operand == "x" else 300
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = gemm_precisions.prepared(precision).parts == 1
        assert_like_eager(Implementation(precision, config)(args), args)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert len(launches) == ceil_div(prepared_rows, config.block_n)


@requires_cuda
@requires_hopper
@pytest.mark.cuda
@pytest.mark.parametrize("split", list(gemm_precisions.PREPARED))
def test_its_partials_are_each_parts_mean_and_m2(split):
    """1000 rows (the last part partial), 600 features, a bias and a per-feature scale; the prepared operand
    split (rounded) in memory, whole and in blocks of 256 rows (of x: whole parts; of W: bias, scale and
    partials from each block's first feature), and in the kernel, K-major (in place) and MN-major (beside
    it). y is the same bit for bit every way (the same parts, the same products in the same order), and
    every part's mean and M2 of z = y * scale is float64's of the y stored within 1e-6. The partials are
    the same bit for bit split whole in memory and in the kernel, and repeated (no race between the
    consumers' splits or epilogues); in blocks they are not compared bit for bit (on an H100 split x's
    differed in their last bits while y did not; the batch size of a block is among what its launch is
    specialized on)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(1000, 136, device="cuda", generator=g)
    w = torch.randn(600, 136, device="cuda", generator=g)
    bias, scale = torch.randn(600, device="cuda", generator=g), torch.randn(600, device="cuda", generator=g)
    block_n = 128 if gemm_precisions.prepared(split).parts == 2 else 256
    rows = warp_specialized_gemm.rows_per_part(split, block_n)
    n_parts = -(-1000 // rows)

    def run(x, w, block_rows):
        return torch.ops.fusepass.warp_specialized_linear(x, w, bias, scale, 1.0, True, split, block_rows, block_n,
                                                          32, 4)

    y, parts = run(x, w, 1024)
    z = y.double() * scale.double()
    mn_major_b = (x, w.t().contiguous().t()) if split.endswith("_w") else (x.t().contiguous().t(), w)
    blocked = run(x, w, 256)
    assert torch.equal(blocked[0], y)
    for other in (run(x, w, 1024), run(x, w, 0), run(*mn_major_b, 0)):
        assert torch.equal(other[0], y) and torch.equal(other[1], parts)
    for every in (parts, blocked[1]):
        means, m2s = every.view(2, n_parts, 600).unbind(0)
        for p in range(n_parts):
            zp = z[p * rows:(p + 1) * rows]
            assert rel_error(means[p], zp.mean(0)) < 1e-6, p
            assert rel_error(m2s[p], ((zp - zp.mean(0)) ** 2).sum(0)) < 1e-6, p


if __name__ == "__main__":
    a_major, b_mode, epilogue, parts = sys.argv[1:5]
    ptx = _compile_for_hopper(a_major == "K", b_mode, epilogue.startswith("statistics"),
                              epilogue.endswith("transposed"), int(parts))
    events = re.findall(r"wgmma\.commit_group|wgmma\.wait_group|fence\.proxy\.async", ptx)
    split_under_wgmmas = any(e == "wgmma.commit_group" and "fence.proxy.async" in events[i + 1:i + 2]
                             for i, e in enumerate(events))
    print(ptx.count("wgmma.mma_async"), len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0", ptx)),
          len(re.findall(r"setmaxnreg\.inc", ptx)), ptx.count("fence.proxy.async"), int(split_under_wgmmas),
          ptx.count("ldmatrix"))
