"""Every kernel compiles for a Hopper GPU (sm_90, down to a cubin) on a machine without one.

The CPU tests run the kernels in Triton's interpreter, which accepts code its compiler rejects (a tuple
indexed by a value not declared constexpr). Compiling here catches that class of error in CI, with the
installed triton only: run this file with triton 3.6 on the path to check the GPU machine's version too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusepass.lowering import gemm, normalize_kernels, pointwise, tf32_split
from fusepass.lowering.gemm_precisions import PRECISIONS
from fusepass.lowering.normalize import OutputMeta
from fusepass.lowering.normalize_kernels import STATS_MERGE, STATS_READ, STATS_RUNNING
from fusepass.lowering.tiles import SCALE_NUMBER, SCALE_PER_FEATURE, SCALE_SINGLE

HOPPER = GPUTarget("cuda", 90, 32)
FLOAT_SCALARS = {"scale_value", "eps", "momentum"}

# A tail that uses every part of the program: a value operand, a per-feature and a one-element tensor
# operand, a number operand, and ops with one and two parameters.
TAIL = pointwise.tail_program("mul(v0,t0);sub(v1,t1);add(v2,3.0);leaky_relu(v3|0.2);softplus(v4|2.0,3.0);"
                              "mul(v5,v1)", (torch.ones(8), torch.ones(()), None, None))
NO_TAIL = pointwise.tail_program("", (None, None, None, None))


def _compile(kernel, constexprs: dict, pointer_type="*fp32") -> str:
    """The kernel's PTX, compiled down to a cubin. pointer_type: every pointer's, or a dict of them by
    parameter name, "" for the rest."""
    types = pointer_type if isinstance(pointer_type, dict) else {"": pointer_type}
    signature = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr") or name.startswith("tail_tensor_"):
            signature[name] = types.get(name, types[""])
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER)
    assert compiled.asm["cubin"]
    return compiled.asm["ptx"]


def wgmma_waits(ptx: str) -> list[int]:
    """The levels the kernel waits for its wgmmas at: 0 waits for all; above 0 leaves some in flight."""
    return sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)})


def _output_meta(source, tail) -> dict:
    return dict(META=tuple(OutputMeta(scale_mode=SCALE_PER_FEATURE.value, has_gamma=True, has_beta=True,
                                      stats_source=source.value, update_running=source == STATS_MERGE,
                                      block_r=32, block_c=64)), TAIL=tail)


def _gemm_meta(precision: str, epilogue, tail, persistent: bool = False, eval_stats: bool = False) -> dict:
    """Tiles that are not square: a branch between y's tile and its transpose must resolve when compiled."""
    return dict(META=tuple(gemm.GemmMeta(
        precision=PRECISIONS[precision].value, epilogue=epilogue.value, store_y=True,
        eval_stats=eval_stats or epilogue == gemm.EPILOGUE_NORMALIZE, has_bias=True, scale_mode=SCALE_NUMBER.value,
        has_gamma=True, has_beta=False, block_m=128, block_n=64, block_k=32, group_m=8, use_tma=False,
        persistent=persistent, k_tail=not persistent)), TAIL=tail)


def cases() -> dict:
    """name -> (kernel, constexprs, pointer type). Compiled in a process of its own: with
    TRITON_INTERPRET=1 the kernels are interpreted functions, which the compiler cannot take."""
    found = {}
    for source in (STATS_READ, STATS_MERGE, STATS_RUNNING):
        for tail_name, tail in (("tail", TAIL), ("no_tail", NO_TAIL)):
            found[f"normalize_kernel[{source.value}-{tail_name}]"] = (normalize_kernels.normalize_kernel,
                                                                       _output_meta(source, tail), "*fp32")
        found[f"normalize_softmax_kernel[{source.value}]"] = (normalize_kernels.normalize_softmax_kernel,
                                                              _output_meta(source, TAIL), "*fp32")
    found["partial_stats_kernel"] = (normalize_kernels.partial_stats_kernel,
                                     dict(SCALE_MODE=SCALE_SINGLE.value, BLOCK_R=32, BLOCK_C=64), "*fp32")
    found["finalize_stats_kernel"] = (normalize_kernels.finalize_stats_kernel,
                                      dict(STATS_SOURCE=STATS_MERGE.value, UPDATE_RUNNING=True, BLOCK_C=64), "*fp32")
    for store_lo in (True, False):
        found[f"tf32_split_kernel[{store_lo}]"] = (tf32_split._tf32_split_kernel,
                                                   dict(STORE_LO=store_lo, BLOCK_ROWS=64, BLOCK_COLS=64), "*fp32")
    for precision, epilogue, tail, pointer_type in (("tf32x3", gemm.EPILOGUE_STATISTICS, NO_TAIL, "*fp32"),
                                                    ("split_x", gemm.EPILOGUE_LINEAR, NO_TAIL, "*fp32"),
                                                    ("split_w", gemm.EPILOGUE_NORMALIZE, TAIL, "*fp32"),
                                                    ("round_x", gemm.EPILOGUE_STATISTICS, NO_TAIL, "*fp32"),
                                                    ("round_w", gemm.EPILOGUE_LINEAR, NO_TAIL, "*fp32"),
                                                    ("native", gemm.EPILOGUE_NORMALIZE, TAIL, "*bf16")):
        found[f"gemm_kernel[{precision}]"] = (gemm._gemm_kernel, _gemm_meta(precision, epilogue, tail), pointer_type)
    # The persistent walk through each epilogue: training's statistics, eval's normalization, and eval's
    # statistics alone before a softmax pass.
    for epilogue, tail, eval_stats in ((gemm.EPILOGUE_STATISTICS, NO_TAIL, False),
                                       (gemm.EPILOGUE_NORMALIZE, TAIL, True), (gemm.EPILOGUE_LINEAR, NO_TAIL, True)):
        found[f"gemm_kernel[native-persistent-{epilogue.value}]"] = (
            gemm._gemm_kernel, _gemm_meta("native", epilogue, tail, True, eval_stats), "*bf16")
    # ... and in each fp32 precision
    for precision in ("tf32", "tf32x3", "split_w", "split_x", "round_w", "round_x"):
        found[f"gemm_kernel[{precision}-persistent]"] = (
            gemm._gemm_kernel, _gemm_meta(precision, gemm.EPILOGUE_STATISTICS, NO_TAIL, True), "*fp32")
    # An autocast weight cast in the kernel: x and the rest bf16, W fp32
    for persistent in (False, True):
        found[f"gemm_kernel[cast_w-{'persistent' if persistent else 'tile'}]"] = (
            gemm._gemm_kernel, _gemm_meta("cast_w", gemm.EPILOGUE_STATISTICS, NO_TAIL, persistent),
            {"": "*bf16", "w_ptr": "*fp32"})
    return found



def test_every_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    compiled = [line.split() for line in done.stdout.splitlines() if line.startswith("compiled ")]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert len(compiled) == len(cases()), done.stdout
    # TF32 with an operand rounded in memory exists to keep wgmmas in flight across K blocks
    # (gemm_precisions.py): its main loop must wait at a level above 0.
    rounded = [(name, waits) for _, name, waits in compiled if "round_" in name]
    assert len(rounded) == 4 and all(max(json.loads(waits)) > 0 for _, waits in rounded), rounded


if __name__ == "__main__":
    for name, (kernel, constexprs, pointer_type) in cases().items():
        ptx = _compile(kernel, constexprs, pointer_type)
        print("compiled", name, str(wgmma_waits(ptx)).replace(" ", ""), flush=True)
