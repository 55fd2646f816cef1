"""A warp-specialized TF32 and 3xTF32 GEMM for Hopper, in Gluon: y = x @ W^T in fp32 from tf32 parts of both
operands, in the precision that prepares one of them (gemm_precisions.PREPARED): 3xTF32 from hi + lo halves
(split_w, split_x), TF32 from operands rounded to nearest tf32 (round_w, round_x). The kernel computes
out = a @ b^T: b = W (split_w, round_w; out = y) or b = x (split_x, round_x; out = y^T = W @ x^T, stored
through y's transposed strides). a's tile is split (rounded) in registers, read K-major or MN-major (a
transposed view: TMA loads the tile of a^T) from shared memory. wgmma reads its second operand from shared
memory only, and tf32 there K-major only, so b is split (rounded) one of two ways (the config's
`split_in_kernel`):
- in memory (split_tf32 or round_tf32, in blocks of rows that bound the copies): TMA loads its parts' tiles;
- in the kernel, nothing copied: TMA loads b's tile as it lies (K-major, or MN-major: the tile of b^T),
  and each consumer warpgroup splits half of it into K-major hi and lo tiles (rounds it into a K-major hi
  tile) in shared memory, one K block ahead of its wgmmas. It costs shared-memory bandwidth (the split's
  reads and writes beside the wgmmas'): in 3xTF32 on an H100, over the forward's, dX's and dW's layouts,
  113-127 TFLOP/s at 1024 x 8192 -> 8192 and 102-117 at 16384 x 4096 -> 4096, against 104-128 and
  114-128 split in memory, the split's pass included (another run on that GPU); the tuners time both.
So a weight gradient, g^T @ x, whose operands are both transposed views, and an input gradient, g @ W,
run without copying the operand that is not split, or, split in the kernel, either.

Its users: the linear op (linear.py: a training step's GEMMs outside a chain's forward, and bare
linears) and the chain's forward (implementations.py; offered by choice.warp_specialized_offered), through
`torch.ops.fusepass.warp_specialized_linear`, an opaque custom op: Inductor cannot trace a Gluon kernel
(its user-kernel support reads Triton's TTIR), so the compiled graph calls the op, which splits in
memory and launches the kernel per block, or launches it once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from fusepass.lowering import limits
from fusepass.lowering.gemm_configs import GemmConfig, sm_count
from fusepass.lowering.gemm_precisions import PREPARED, Workspace, prepare_operand, prepared, variants, workspace
from fusepass.lowering.launch import ceil_div
from fusepass.lowering.tiles import SCALE_NUMBER, SCALE_PER_FEATURE, scale_mode
from fusepass.lowering.warp_specialized_kernels import B_K_MAJOR, B_MN_MAJOR, B_SPLIT_IN_MEMORY, gemm_kernel, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

OP_NAME = "fusepass::warp_specialized_linear"
# Per thread of a consumer warpgroup: 3xTF32's two 64 x 128 fp32 accumulators and the split tile, or TF32's
# one 64 x 256 accumulator
CONSUMER_REGISTERS = 232
LOADER_REGISTERS = 40
GROUP_M = 8
BLOCK_M = 128  # output tile rows: two consumer warpgroups of 64; its columns (one wgmma's N) are the config's
# The kernel's 3xTF32 configs, 128 columns (two accumulators). The split operand split in memory (H100, W
# already split): 130-134 TFLOP/s at 32-wide K blocks in 4 stages, 129-136 at 64 in 2, depending on the
# shape. Split in the kernel (above), 32-wide K blocks only: at 64, an MN-major b's tile leaves room for one
# stage.
CONFIGS = [GemmConfig(BLOCK_M, 128, 32, GROUP_M, 4, 4, warp_specialized=True),
           GemmConfig(BLOCK_M, 128, 64, GROUP_M, 4, 2, warp_specialized=True),
           GemmConfig(BLOCK_M, 128, 32, GROUP_M, 4, 4, warp_specialized=True, split_in_kernel=True)]
# TF32's: one product, one accumulator, so 256 columns. Rounded in memory, b's tile alone (H200, the kernel
# alone): 0.89-0.95x cuBLAS TF32 at 1024 x 8192 -> 8192, 16384 x 4096 -> 4096, 4096 x 1024 -> 4096 and
# 4096^2 (round_x), against 0.72-0.79x on 128 columns (as 3xTF32's tiles) and 0.61-0.69x with one K block's
# wgmmas left running while the next block's are issued; 128 columns where N is small (4096 x 4096 -> 256:
# 0.73x against 0.52x). Rounded in the kernel (what operand_copies=False keeps): the chain's forward took
# 1.4x the time rounded in memory at 1024 x 8192 -> 8192 and 16384 x 4096 -> 4096 (H200, tuning log).
ROUNDED_CONFIGS = [GemmConfig(BLOCK_M, 256, 32, GROUP_M, 4, 4, warp_specialized=True),
                   GemmConfig(BLOCK_M, 128, 32, GROUP_M, 4, 4, warp_specialized=True),
                   GemmConfig(BLOCK_M, 256, 32, GROUP_M, 4, 4, warp_specialized=True, split_in_kernel=True),
                   GemmConfig(BLOCK_M, 128, 32, GROUP_M, 4, 6, warp_specialized=True, split_in_kernel=True)]
# The stages' buffers the configs were measured with (a's tile, hi and lo: 4 x 48 KiB at 32-wide K blocks),
# below the 227 KiB an sm_90 block may use, with room for the epilogue's reductions.
SHARED_MEMORY_BYTES = 4 * 3 * 128 * 32 * 4


# K split across programs (split_k): a GEMM of fewer tiles than the GPU has SMs, whose K is long, leaves SMs
# idle (4096 x 4096 -> 256, the MLP's last layer and its weight gradient: 64 tiles of 128 x 128 for 132 SMs).
# Split K ways, its programs each sum K / splits of the product; the first writes out (with the bias), the others
# fp32 partial sums that the launcher then adds to it. At most MAX_K_SPLITS, each at least
# MIN_K_BLOCKS_PER_SPLIT K blocks long, so that the pipeline's fill and the epilogue's store stay a small part
# of a program's time. GPU time (tuning.gpu_time) at 4096 x 4096 -> 256 on an H200, split in the kernel, two
# splits against none: 3xTF32 forward 0.079 against 0.140 ms, weight gradient 0.080 against 0.141; TF32 (round_w)
# 0.049 against 0.081 and 0.051 against 0.086. Launched back to back from Python, a call took 0.16-0.33 ms
# (host-bound: the op and its two launches); the tuners judge by GPU time, and which GEMMs are offered the op
# at all is linear.warp_specialized_offered's rule.
K_SPLIT_CONFIGS = [GemmConfig(BLOCK_M, 128, 32, GROUP_M, 4, 4, warp_specialized=True, split_in_kernel=True,
                              split_k=True)]
ROUNDED_K_SPLIT_CONFIGS = [GemmConfig(BLOCK_M, 128, 32, GROUP_M, 4, 6, warp_specialized=True, split_in_kernel=True,
                                      split_k=True)]
MAX_K_SPLITS = 4
MIN_K_BLOCKS_PER_SPLIT = 8
# The op launches from Python (0.1-0.3 ms of host a call, choice.py), so a default-mode step, whose launches may
# not hide, is offered it in 3xTF32 only from 4e9 FLOP (linear.warp_specialized_offered), where cuBLAS's IEEE fp32
# takes about 0.08 ms (50 TFLOP/s, "GEMM alone"), near the op's least host time: below it, the GPU time the op can
# save is less than the host time it costs. Offered at every size, the weight gradient of a 128 x 1024 -> 512
# training step (1.3e8 FLOP) chose it at 0.0092 ms of GPU time against cuBLAS's 0.0098, in a host-bound step
# (H100, BENCHMARKS.md "Small shapes", e6f8d6b). With K split it launches twice (the parts' add), and saves at
# most about 40% of the GEMM's GPU time (0.140 -> 0.079 ms at 8.6e9 FLOP, about 29 us at 4e9).
UNHIDDEN_MIN_FLOP = 4e9


# What the tuners are offered: each precision that prepares an operand with its configs
CANDIDATES = [(precision, config) for precision, how in PREPARED.items() for config in
              (CONFIGS + K_SPLIT_CONFIGS if how.parts == 2 else ROUNDED_CONFIGS + ROUNDED_K_SPLIT_CONFIGS)]


def candidates(precision: str, operand_copies: bool,
               sizes: Optional[tuple[int, int, int, torch.device]] = None) -> list[tuple[str, GemmConfig]]:
    """CANDIDATES of a matmul precision ("tf32" or "tf32x3"; none for others), with operand copies forbidden
    only those that split in the kernel (they copy nothing). Those that split K only for a GEMM without the
    statistics epilogue whose `sizes` (x's rows, W's rows, K, device) it would split (k_splits)."""
    return [(p, config) for p, config in CANDIDATES
            if p in variants(precision) and (operand_copies or config.split_in_kernel)
            and (not config.split_k or (sizes is not None and k_splits(p, config, *sizes) > 1))]


def k_splits(precision: str, config: GemmConfig, x_rows: int, weight_rows: int, k: int, device: torch.device) -> int:
    """How many ways `config` splits the K of x @ W^T prepared as `precision` (1: not at all): as many as the
    GPU's SMs hold the output's tiles, within MAX_K_SPLITS and MIN_K_BLOCKS_PER_SPLIT."""
    if not config.split_k:
        return 1
    a_rows, b_rows = (x_rows, weight_rows) if prepared(precision).operand == "weight" else (weight_rows, x_rows)
    tiles = ceil_div(a_rows, BLOCK_M) * ceil_div(b_rows, config.block_n)
    splits = min(MAX_K_SPLITS, sm_count(device) // max(tiles, 1), ceil_div(k, config.block_k) // MIN_K_BLOCKS_PER_SPLIT)
    return max(1, splits)


def unlaunchable(x: Tensor, weight: Tensor, out_dtype: torch.dtype, precision: str = "split_w",
                 config: GemmConfig = CONFIGS[0]) -> Optional[str]:
    """Why x @ weight^T (+ bias) in `precision` (the operand it prepares is b) made as `config` makes it
    cannot run on this kernel, or None: it needs Gluon, an sm_90 GPU (wgmma), fp32 operands and output, a K of
    at least one, operands K-major or MN-major as TMA reads them (b prepared in memory: a only; the copies are
    row-major), and shared memory for two stages (stages_that_fit)."""
    if gluon is None:
        return "this Triton has no Gluon"
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "the warp-specialized GEMM is Hopper's (sm_90 wgmma)"
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or out_dtype != torch.float32:
        return "the warp-specialized GEMM is fp32's (TF32, 3xTF32)"
    if x.shape[1] == 0:  # (its consumers would wait for a first K block that never comes)
        return "a product over no columns"
    how = prepared(precision)
    a, b = (x, weight) if how.operand == "weight" else (weight, x)
    for operand in (a, b) if config.split_in_kernel else (a,):
        k_major = limits.tma_layout(operand)
        if k_major and limits.tma_layout(operand.t()):
            return f"{k_major}, nor does its transpose"
    if stages_that_fit(config, b_mode(b, config), how.parts) < 2:
        return f"an MN-major operand split in K blocks of {config.block_k} leaves shared memory for one stage"
    return None


def b_mode(b: Tensor, config: GemmConfig) -> int:
    """How the kernel reads b (B_MODE) under `config`."""
    return _raw_mode(b) if config.split_in_kernel else B_SPLIT_IN_MEMORY.value


def _raw_mode(b: Tensor) -> int:
    return (B_K_MAJOR if limits.k_major(b) else B_MN_MAJOR).value


def stages_that_fit(config: GemmConfig, mode: int, parts: int) -> int:
    """The config's stages, or fewer where b's tiles take more: a's tile, b's `parts` (hi and lo, or hi), and
    b's raw tile where it needs a buffer of its own: prepared in memory its parts are loaded, a K-major tile
    is split in place (hi over it), an MN-major one beside it."""
    b_tiles = parts + (mode == B_MN_MAJOR.value)
    per_stage = (config.block_m + b_tiles * config.block_n) * config.block_k * 4
    return min(config.num_stages, SHARED_MEMORY_BYTES // per_stage)


def _descriptor(t: Tensor, k: int, block_rows: int, block_k: int) -> "TensorDescriptor":
    """TMA's view of t's first k columns (rows, k) in block_rows x block_k tiles where t is K-major, else of
    its transpose (k, rows) in block_k x block_rows tiles (limits.k_major, as limits.tma_layout reads it)."""
    rows = t.shape[0]
    if limits.k_major(t):
        shape, block = [rows, k], (block_rows, block_k)
    else:
        t, shape, block = t.t(), [k, rows], (block_k, block_rows)
    return TensorDescriptor(t, shape, [t.stride(0), 1], list(block), _shared_layout(block))


@functools.cache
def _shared_layout(block: tuple[int, int]) -> "gl.NVMMASharedLayout":
    """Made once per block shape: a training step's launches are host-bound (a profiled fp32 MLP step at
    4096 rows made eleven), and making the three descriptors with their layouts took two thirds of one
    launch's host time (78 us against 25 for the launch with descriptors made beforehand, on the H100
    machine's host)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float32)


@dataclass(frozen=True)
class Epilogue:
    """What the kernel does with y's tile besides storing it (pointers at the launch's first feature and part): add
    the bias; with `parts`, store the mean and M2 of z = y * scale (scale: a per-feature or one-element tensor, else
    scale_value) over each part of the batch's rows, its means `part_stride` apart, its M2s `m2_offset` after them
    (normalize.Partials' layout)."""
    bias: Optional[Tensor] = None
    scale: Optional[Tensor] = None
    scale_value: float = 1.0
    parts: Optional[Tensor] = None
    part_stride: int = 0
    m2_offset: int = 0


def gemm_into(out: Tensor, a: Tensor, b: Tensor, config: GemmConfig, parts: int, transposed: bool = False,
              epilogue: Epilogue = Epilogue(), b_prepared: bool = False, b_lo: Optional[Tensor] = None,
              splits: int = 1) -> None:
    """out = a @ b^T in config's tiles (its block_n, block_k and stages) from `parts` tf32 parts of each
    operand (2: 3xTF32; 1: TF32); out of any strides, a K-major or else MN-major; b raw (split in the kernel;
    K-major or else MN-major), or `b_prepared`: b's hi, with `b_lo` its lo in 3xTF32 (split_tf32's or
    round_tf32's buffers: their first K columns); `transposed`: out is y^T (its rows are y's features). K in
    up to `splits` parts summed by programs of their own (out dense, no statistics; as many as leave none
    empty), added to out afterwards."""
    if b_prepared and (b_lo is not None) != (parts == 2):
        raise ValueError(f"warp-specialized GEMM: b prepared in {parts} parts needs {parts - 1} lo")
    (m, k), n = a.shape, b.shape[0]
    block_n, block_k = config.block_n, config.block_k
    k_blocks = ceil_div(k, block_k)
    steps_per_split = ceil_div(k_blocks, max(1, min(splits, k_blocks)))
    splits = ceil_div(k_blocks, steps_per_split) if steps_per_split else 1  # (no K: unlaunchable's)
    if splits > 1 and (epilogue.parts is not None or not (out.is_contiguous() or out.t().is_contiguous())):
        raise ValueError("warp-specialized GEMM: K split only into a dense output without statistics")
    partials = out.new_empty(((splits - 1) * out.numel(),)) if splits > 1 else out  # (out: never written)
    a_desc, b_desc = _descriptor(a, k, BLOCK_M, block_k), _descriptor(b, k, block_n, block_k)
    mode = B_SPLIT_IN_MEMORY.value if b_prepared else _raw_mode(b)
    lo_desc = b_desc if b_lo is None else _descriptor(b_lo, k, block_n, block_k)  # (read only for a lo in memory)
    grid = (ceil_div(m, BLOCK_M) * ceil_div(n, block_n), splits)
    e = epilogue
    gemm_kernel[grid](
        a_desc, b_desc, lo_desc,
        out, partials, *(t if t is not None else out for t in (e.bias, e.scale, e.parts)),
        m, n, k, out.stride(0), out.stride(1), e.part_stride, e.m2_offset,
        steps_per_split, e.scale_value,
        BLOCK_M=BLOCK_M, A_K_MAJOR=limits.k_major(a), B_MODE=mode, PARTS=parts,
        HALF_LAYOUT=_shared_layout((block_n, block_k)),
        STATISTICS=e.parts is not None, TRANSPOSED=transposed, HAS_BIAS=e.bias is not None,
        SCALE_MODE=scale_mode(e.scale) if e.parts is not None else SCALE_NUMBER.value,
        STAGES=stages_that_fit(config, mode, parts), GROUP=GROUP_M, CONSUMER_REGS=CONSUMER_REGISTERS,
        LOADER_REGS=LOADER_REGISTERS, num_warps=4)
    if splits > 1:
        sums = partials.as_strided((splits - 1, *out.shape), (out.numel(), *out.stride()))
        out.add_(sums[0] if splits == 2 else sums.sum(0))


def rows_per_part(precision: str, block_n: int) -> int:
    """The batch's rows each part of the statistics covers: a consumer's rows of y's tile, or, y^T's tile
    computed (x prepared), its columns."""
    return BLOCK_M // 2 if prepared(precision).operand == "weight" else block_n


def warp_specialized_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale: Optional[Tensor],
                            scale_value: float, statistics: bool, precision: str, block_rows: int, block_n: int,
                            block_k: int, stages: int, split_k: bool = False) -> tuple[Tensor, Tensor]:
    """(y, parts): y = x @ weight^T + bias in `precision` (split_w, split_x, round_w, round_x), its operand
    split into tf32 halves or rounded to tf32: in the kernel's shared memory, one launch (block_rows 0), or in
    memory block_rows rows at a time (the linear op's bound on its copies; with statistics of x prepared,
    whole parts), a launch per block; in tiles of block_n columns of the product and K blocks of block_k, in
    `stages`. W's rows make columns of y, x's rows make rows of y, written as columns of y^T = W @ x^T. With
    `statistics`, parts holds the per-feature means and M2s of z = y * scale (the tensor, else scale_value)
    over each rows_per_part(precision, block_n) rows of the batch (normalize.Partials' flat layout); else it
    is empty. `split_k` (one launch, no statistics): K split across programs as k_splits says."""
    how = prepared(precision)
    if how is None or block_rows < 0 or (statistics and how.operand == "x"
                                         and block_rows % rows_per_part(precision, block_n)):
        raise ValueError(f"warp_specialized_linear: {precision!r} in blocks of {block_rows} rows")
    if split_k and (statistics or block_rows):
        raise ValueError("warp_specialized_linear: K is split in one launch without statistics only")
    config = GemmConfig(BLOCK_M, block_n, block_k, GROUP_M, 4, stages, warp_specialized=True, split_k=split_k)
    m, f = x.shape[0], weight.shape[0]
    y = torch.empty((m, f), device=x.device, dtype=torch.float32)
    n_parts = ceil_div(m, rows_per_part(precision, block_n))
    parts = torch.empty(2 * n_parts * f if statistics else 0, device=x.device, dtype=torch.float32)
    transposed = how.operand == "x"
    a, b, out = (weight, x, y.t()) if transposed else (x, weight, y)
    if block_rows == 0:
        epilogue = Epilogue(bias, scale, scale_value, parts if statistics else None, f, n_parts * f)
        splits = k_splits(precision, config, m, f, x.shape[1], x.device)
        gemm_into(out, a, b, config, how.parts, transposed, epilogue, splits=splits)
        return y, parts
    shared = workspace(precision, min(block_rows, b.shape[0]), b.shape[1], b)  # one block's copies at a time
    for r0 in range(0, b.shape[0], block_rows):
        hi, lo = _prepared_block(b[r0:r0 + block_rows], a, precision, shared)
        epilogue = _block_epilogue(precision, r0, rows_per_part(precision, block_n), bias, scale, scale_value,
                                   parts if statistics else None, n_parts * f, f)
        gemm_into(out[:, r0:], a, hi, config, how.parts, transposed, epilogue, b_prepared=True, b_lo=lo)
    return y, parts


def _prepared_block(block: Tensor, a: Tensor, precision: str, shared: Workspace) -> tuple[Tensor, Optional[Tensor]]:
    """The block of b as the kernel reads it, prepared into the workspace's first rows: (hi, lo or None)."""
    hi, lo = prepare_operand(block, a, precision, shared)
    rows = block.shape[0]
    return hi[:rows], lo[:rows] if lo is not None else None


def _block_epilogue(precision: str, r0: int, part_rows: int, bias: Optional[Tensor], scale: Optional[Tensor],
                    scale_value: float, parts: Optional[Tensor], m2_offset: int, n_features: int) -> Epilogue:
    """The epilogue's tensors from the block's first feature (a block of W's rows) or part (of x's rows, each
    part of part_rows)."""
    if prepared(precision).operand == "weight":
        per_feature_scale = scale is not None and scale_mode(scale) == SCALE_PER_FEATURE.value
        return Epilogue(bias[r0:] if bias is not None else None, scale[r0:] if per_feature_scale else scale,
                        scale_value, parts[r0:] if parts is not None else None, n_features, m2_offset)
    part0 = r0 // part_rows
    return Epilogue(bias, scale, scale_value, parts[part0 * n_features:] if parts is not None else None,
                    n_features, m2_offset)


# Defined with torch.library.Library, not custom_op: the compiled graph calls it on every step, and custom_op's
# Python layers (its autograd kernel, the dynamo-disabling wrapper, the outputs' aliasing check) cost more host
# time than the op's own Python (2-core CPU, kernels mocked out: 43 us per call through custom_op, 17-20 as
# defined here, 14 for the body alone).
_LIBRARY = torch.library.Library("fusepass", "FRAGMENT")
_LIBRARY.define(OP_NAME.split("::")[1] + "(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, float scale_value, "
                "bool statistics, str precision, SymInt block_rows, SymInt block_n, SymInt block_k, SymInt stages, "
                "bool split_k=False) -> (Tensor, Tensor)")
_LIBRARY.impl(OP_NAME.split("::")[1], warp_specialized_linear, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME, lib=_LIBRARY)
def _fake(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale: Optional[Tensor], scale_value: float,
          statistics: bool, precision: str, block_rows: int, block_n: int, block_k: int,
          stages: int, split_k: bool = False) -> tuple[Tensor, Tensor]:
    m, f = x.shape[0], weight.shape[0]
    n_parts = ceil_div(m, rows_per_part(precision, block_n))
    return x.new_empty((m, f)), x.new_empty((2 * n_parts * f if statistics else 0,))
