"""The warp-specialized Gluon 3xTF32 GEMM (warp_specialized_gemm.py): it compiles for Hopper on a machine
without one, is offered only where it can run, and on an H100/H200 is as exact as the Triton split_w GEMM
at shapes that leave partial tiles in every dimension, alone, through the linear op and in a compiled
graph. Gluon kernels have no interpreter: on CPU only their compilation and the op's plumbing are tested."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from fusepass.lowering import gemm_configs, linear, warp_specialized_gemm
from fusepass.numerics import rel_error
from tests.chains import requires_cuda

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
requires_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")


def _compile_for_hopper(a_k_major: bool) -> str:
    """The kernel's PTX for sm_90 (compiled to a cubin) with `a` K-major or MN-major, as the compile-only
    script below prints it."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def descriptor(block):
        return f"tensordesc<fp32[{block[0]},{block[1]}],{gl.NVMMASharedLayout.get_default_for(block, gl.float32)!r}>"

    a_block = [128, 32] if a_k_major else [32, 128]
    signature = {"a_desc": descriptor(a_block), "hi_desc": descriptor([128, 32]), "lo_desc": descriptor([128, 32]),
                 "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_om": "i32", "stride_on": "i32",
                 "BLOCK_M": "constexpr", "A_K_MAJOR": "constexpr", "STAGES": "constexpr", "GROUP": "constexpr",
                 "CONSUMER_REGS": "constexpr", "LOADER_REGS": "constexpr"}
    constexprs = dict(BLOCK_M=128, A_K_MAJOR=a_k_major, STAGES=4, GROUP=8, CONSUMER_REGS=232, LOADER_REGS=40)
    compiled = triton_compile(GluonASTSource(warp_specialized_gemm._gemm_kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert compiled.asm["cubin"]
    return compiled.asm["ptx"]


@pytest.mark.skipif(warp_specialized_gemm.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("a_major", ["K", "MN"])
def test_the_kernel_compiles_for_hopper_with_two_consumer_warpgroups(a_major):
    """In a process of its own, without TRITON_INTERPRET (test_compiles.py). Per consumer and K block of 32:
    three products of four k=8 wgmmas each, waited for (level 0) by that consumer alone; setmaxnreg gives
    the consumers their registers and takes them from the loader. A K-major `a` tile is read from shared
    memory with ldmatrix; an MN-major one (read transposed) without."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, __file__, a_major], env=env, capture_output=True, text=True, timeout=600,
                          cwd=root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    wgmmas, waits, raised, ldmatrix = (int(v) for v in done.stdout.split()[-4:])
    assert wgmmas == 2 * 3 * 4 and waits == 2 and raised >= 2, done.stdout
    assert (ldmatrix > 0) == (a_major == "K"), done.stdout


def test_offered_only_where_it_runs():
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    why = warp_specialized_gemm.unlaunchable(x, w, None, torch.float32)
    assert why in ("this Triton has no Gluon", "the warp-specialized GEMM is Hopper's (sm_90 wgmma)")
    if ON_HOPPER:
        cuda = x.cuda(), w.cuda()
        assert warp_specialized_gemm.unlaunchable(*cuda, None, torch.float32) is None
        assert "bias" in warp_specialized_gemm.unlaunchable(*cuda, torch.zeros(4, device="cuda"), torch.float32)
        assert "fp32" in warp_specialized_gemm.unlaunchable(*(t.bfloat16() for t in cuda), None, torch.bfloat16)
        mn_major = cuda[0].t().contiguous().t()
        assert warp_specialized_gemm.unlaunchable(mn_major, cuda[1], None, torch.float32) is None
        neither = torch.randn(8, 32, device="cuda")[:, ::2]
        assert "TMA" in warp_specialized_gemm.unlaunchable(neither, cuda[1], None, torch.float32)
        assert warp_specialized_gemm.unlaunchable(neither, cuda[1], None, torch.float32, split="x") is None
        assert "TMA" in warp_specialized_gemm.unlaunchable(cuda[0], neither, None, torch.float32, split="x")
    call = linear.LinearCall(x, w, None, "tf32x3", "auto")
    problem = linear.problem(call, traced=False)
    names = list(linear.candidates(call, problem, traced=False))
    assert any("warp-specialized" in n for n in names) == ON_HOPPER, names


def test_the_ops_fake_is_an_fp32_product():
    with FakeTensorMode():
        y = torch.ops.fusepass.warp_specialized_linear(torch.empty(5, 8), torch.empty(7, 8), "x", 4, 32, 4)
    assert y.shape == (5, 7) and y.dtype == torch.float32


def _split_w_triton(x, w):
    config = gemm_configs.candidates("split_w", torch.float32)[0]
    return linear.LinearImplementation("split_w", config)(linear.LinearCall(x, w, None, "tf32x3", "auto"))


@requires_cuda
@requires_hopper
@pytest.mark.cuda
@pytest.mark.parametrize("config", warp_specialized_gemm.CONFIGS, ids=lambda c: c.describe())
@pytest.mark.parametrize("split", warp_specialized_gemm.SPLIT_OPERANDS)
@pytest.mark.parametrize("layout", ["forward", "grad_x", "grad_w"])
def test_as_exact_as_the_triton_split_gemm_at_partial_tiles(config, split, layout):
    """1000 x 1004 -> 1300 (K ends in a partial block, the last row and column tiles are partial), the split
    operand in blocks of 384 rows (three or four blocks, the last partial); grad_x reads W through a
    transposed view, grad_w x as well (both MN-major)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1000, 1004, device="cuda", generator=g)
    w = torch.randn(1300, 1004, device="cuda", generator=g) / 1004 ** 0.5
    if layout in ("grad_x", "grad_w"):
        w = w.t().contiguous().t()
    if layout == "grad_w":
        x = x.t().contiguous().t()
    y = torch.ops.fusepass.warp_specialized_linear(x, w, split, 384, config.block_k, config.num_stages)
    exact = F.linear(x.double(), w.double())
    ours, triton_split = rel_error(y, exact), rel_error(_split_w_triton(x, w), exact)
    assert ours <= 1.5 * triton_split and ours < 1e-6, (ours, triton_split)


@requires_cuda
@requires_hopper
@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["split_w", "split_x"])
def test_through_the_linear_op_and_a_compiled_graph(precision):
    """The linear op's implementation (its blocks from _block_rows), and the custom op inside an Inductor
    graph: same results, bit for bit, as the op run eagerly."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(777, 512, device="cuda", generator=g)
    w = torch.randn(640, 512, device="cuda", generator=g)
    impl = linear.LinearImplementation(precision, warp_specialized_gemm.CONFIGS[0])
    call = linear.LinearCall(x, w, None, "tf32x3", "auto")
    assert impl.unlaunchable(call) is None
    eager = impl(call)
    compiled = torch.compile(lambda a, b: impl(linear.LinearCall(a, b, None, "tf32x3", "auto")) * 2.0)(x, w)
    assert torch.equal(compiled, eager * 2.0)
    assert rel_error(eager, F.linear(x.double(), w.double())) < 1e-6


if __name__ == "__main__":
    ptx = _compile_for_hopper(a_k_major=sys.argv[1] == "K")
    print(ptx.count("wgmma.mma_async"), len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0", ptx)),
          len(re.findall(r"setmaxnreg\.inc", ptx)), ptx.count("ldmatrix"))
