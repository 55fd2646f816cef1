"""The fused operator's Triton GEMM: y = x @ W^T + b on tensor cores, with the BatchNorm chain's
first steps in its epilogue (gemm_epilogue.py), so that the (N, F) result is not read again just to get
statistics.

Tiles (configs: gemm_configs.py): a program per output tile, or (PERSISTENT, K-major operands as the
kernel reads them) one program per SM looping over the tiles in grouped order, its tile loop flattened
into the K loop so that a tile's loads overlap the previous tile's epilogue, loading through TMA
descriptors made inside the kernel (which, unlike host-made ones, a traced launch can carry).

fp32 precisions (PRECISION): TF32 (what eager does when TF32 is allowed), TF32X3 (Triton's three-pass
split: fp32-accurate on tensor cores), SPLIT_W (the same three passes with W split into tf32 hi + lo
once, in memory, so the main loop splits only the x tile) and SPLIT_X (x split in memory instead, for
problems whose x is much smaller than W; the main loop splits the W tile, which it makes the dot's
first operand, so that the split halves feed the tensor cores from registers, and accumulates y's tile
transposed); ROUND_W and ROUND_X are TF32 with W or x rounded to tf32 once in memory, the other tile
rounded in registers as the dot's first operand (why: gemm_precisions.py). Plain fp32 FMA is left to
cuBLAS: a Triton FMA GEMM measured 2.7x eager's error in a gradient. bf16/fp16 inputs use the NATIVE
dot, fp32 accumulation; CAST_W is the same product from an fp32 W under autocast, each W tile cast to
x's dtype in registers (as the dot's first operand, y's tile accumulated transposed), so that no cast of
the whole W is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true
from triton.tools.tensor_descriptor import TensorDescriptor

from fusepass.lowering import limits, pointwise
from fusepass.lowering.gemm_configs import GemmConfig, sm_count
from fusepass.lowering.gemm_precisions import (CAST_W, ROUND_W, ROUND_X, SPLIT_W, SPLIT_X, TF32, TF32X3, Workspace,
                                               kernel_precision, prepare_operands, prepared, prepares)
from fusepass.lowering.gemm_epilogue import EPILOGUE_LINEAR, EPILOGUE_NORMALIZE, EPILOGUE_STATISTICS, tile_epilogue
from fusepass.lowering.launch import launch, present_or_placeholder, tracing, unused_pointer
from fusepass.lowering.normalize import Partials
from fusepass.lowering.schema import BatchNorm, Linear, Scale, Tail
from fusepass.lowering.tf32_split import tf32_split
from fusepass.lowering.tiles import grouped_tile, tile_offsets


class GemmMeta(NamedTuple):
    """The GEMM kernel's meta-parameters but the tail program, passed as one constexpr tuple (META) in
    this order, which the kernel unpacks by position: as parameters of their own they would take it to
    42 arguments. Scalars only: triton 3.6 fails to take a nested tuple out of a constexpr tuple."""
    precision: int
    epilogue: int
    store_y: bool
    eval_stats: bool
    has_bias: bool
    scale_mode: int
    has_gamma: bool
    has_beta: bool
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    use_tma: bool
    persistent: bool
    k_tail: bool  # whether K may end in a partial block: see k_may_end_partial


def k_may_end_partial(k, block_k: int) -> bool:
    """Whether the kernel needs the masked last K block: not where K is a known whole number of blocks
    (its code alone cost a 3xTF32 forward 10%: H100, 1024 x 8192 -> 8192, 1.555 -> 1.405 ms). A symbolic
    K (a weight gradient's batch, traced dynamic) may be any size when the graph runs."""
    return not isinstance(k, int) or k % block_k != 0


def unlaunchable(x: Tensor, weight: Tensor, precision: str, config: GemmConfig) -> Optional[str]:
    """Why run_gemm cannot run x @ weight^T in this precision and config (limits.py), or None."""
    return limits.first(
        limits.column_grid(x.shape[1]) if prepared(precision) else None,
        limits.tma_layout(x, weight) if config.tma else None,
        _persistent_unlaunchable(x, weight, precision) if config.persistent else None,
    )


def _persistent_unlaunchable(x: Tensor, weight: Tensor, precision: str) -> Optional[str]:
    """TMA's needs, of the operands as the kernel reads them: one prepared in memory comes from split
    buffers, aligned whatever its size; a weight given a K-major copy is contiguous, its rows K long. Checked
    without guarding a traced graph on K (a weight gradient's K is the batch): where K's alignment is not
    known, the walk is not offered."""
    copied = needs_k_major_copy(weight, precision)
    if copied and not statically_known_true(weight.shape[1] * weight.element_size() % 16 == 0):
        return "the K-major copy's rows would not be 16-byte aligned"
    as_given = ((x, prepares(precision, "x")), (weight, prepares(precision, "weight") or copied))
    return limits.tma_layout(*(t for t, replaced in as_given if not replaced), device=x.device)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _dot(a, b, lo, acc, PRECISION: tl.constexpr):
    """acc + a @ b in the requested precision. lo: the low tf32 half of the operand split in memory
    (SPLIT_W: of b; SPLIT_X: of a, whose high half is a). ROUND_W: b is rounded already, ROUND_X: a.
    CAST_W: b is fp32, a 16-bit. SPLIT_X, ROUND_X and CAST_W accumulate (a @ b)^T (_transposed)."""
    if PRECISION == TF32:
        # Tensor cores truncate fp32 operands to tf32; rounding them to nearest first, as cuBLAS does,
        # avoids a bias that grows with K (measured on an H200: 2.5x cuBLAS tf32's error in a gradient).
        a_hi, _ = tf32_split(a)
        b_hi, _ = tf32_split(b)
        acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    elif PRECISION == TF32X3:
        acc = tl.dot(a, b, acc, input_precision="tf32x3")
    elif PRECISION == SPLIT_W:
        a_hi, a_lo = tf32_split(a)
        acc = _three_pass_dot(a_hi, a_lo, b, lo, acc)
    elif PRECISION == SPLIT_X:
        # Transposed, the tile split in registers is the first operand, the one wgmma reads from
        # registers; the halves read from memory stay in shared memory.
        b_hi, b_lo = tf32_split(tl.trans(b))
        acc = _three_pass_dot(b_hi, b_lo, tl.trans(a), tl.trans(lo), acc)
    elif PRECISION == ROUND_W:
        a_hi, _ = tf32_split(a)
        acc = tl.dot(a_hi, b, acc, input_precision="tf32")
    elif PRECISION == ROUND_X:
        b_hi, _ = tf32_split(tl.trans(b))
        acc = tl.dot(b_hi, tl.trans(a), acc, input_precision="tf32")
    elif PRECISION == CAST_W:
        # Rounded to nearest as autocast's cast rounds; the cast tile feeds the tensor cores from registers
        acc = tl.dot(tl.trans(b).to(a.dtype), tl.trans(a), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _three_pass_dot(a_hi, a_lo, b_hi, b_lo, acc):
    """acc + (a_hi + a_lo) @ (b_hi + b_lo) without the lo @ lo term. As Triton's tf32x3: the K block's
    three products go into a fresh accumulator (small ones first), added to the running sum by an
    ordinary, round-to-nearest fp32 add. Tensor cores truncate when they accumulate; running the whole
    K loop through them measured 2e-5 relative error at K = 4096 (linear in K) against 2e-7 this way."""
    block = tl.dot(a_lo, b_hi, tl.zeros_like(acc), input_precision="tf32")
    block = tl.dot(a_hi, b_lo, block, input_precision="tf32")
    return acc + tl.dot(a_hi, b_hi, block, input_precision="tf32")


@triton.jit
def _k_block(x_ptrs, w_ptrs, lo_ptrs, ks, k_left, acc, PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """acc + one K block's product. MASKED: the block runs past K, and only its first k_left columns are
    loaded. The low half (lo_ptrs) has its operand's shape and strides."""
    if MASKED:
        x_mask = ks[None, :] < k_left
        w_mask = ks[:, None] < k_left
        a = tl.load(x_ptrs, mask=x_mask, other=0.0)
        b = tl.load(w_ptrs, mask=w_mask, other=0.0)
    else:
        a = tl.load(x_ptrs)
        b = tl.load(w_ptrs)
    lo = b
    if PRECISION == SPLIT_W:
        lo = tl.load(lo_ptrs, mask=w_mask, other=0.0) if MASKED else tl.load(lo_ptrs)
    if PRECISION == SPLIT_X:
        lo = tl.load(lo_ptrs, mask=x_mask, other=0.0) if MASKED else tl.load(lo_ptrs)
    return _dot(a, b, lo, acc, PRECISION)


# The row count (M; K in a weight gradient's GEMM, whose reduction runs over the batch) changes with the
# batch: a runtime argument, never specialized (K's partial last block: K_TAIL, k_may_end_partial).
@triton.jit(do_not_specialize=["M", "K"])
def _gemm_kernel(
    # pointers: GEMM operands
    x_ptr, w_ptr, lo_ptr, bias_ptr,
    # pointers: batch-norm parameters and statistics
    scale_ptr, running_mean_ptr, running_var_ptr, gamma_ptr, beta_ptr,
    # pointers: the pointwise tail's tensor operands
    tail_tensor_0, tail_tensor_1, tail_tensor_2, tail_tensor_3,
    # pointers: outputs. epilogue_out: EPILOGUE_NORMALIZE's normalized output, or EPILOGUE_STATISTICS'
    # row tiles' means then M2s (normalize.Partials); one slot, as no epilogue writes both.
    y_ptr, epilogue_out_ptr, mean_ptr, invstd_ptr,
    # sizes; this launch's N columns are y's columns y_col0 on (a block of W's rows, run_linear)
    M, N, K, y_col0,
    # strides (of the operands, and y's rows; out is row-major, N wide)
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym,
    # scalars
    scale_value, eps,
    # meta-parameters: GemmMeta's, and the tail program (pointwise.tail_program)
    META: tl.constexpr, TAIL: tl.constexpr,
):
    PRECISION: tl.constexpr = META[0]
    EPILOGUE: tl.constexpr = META[1]
    STORE_Y: tl.constexpr = META[2]
    EVAL_STATS: tl.constexpr = META[3]
    HAS_BIAS: tl.constexpr = META[4]
    SCALE_MODE: tl.constexpr = META[5]
    HAS_GAMMA: tl.constexpr = META[6]
    HAS_BETA: tl.constexpr = META[7]
    BLOCK_M: tl.constexpr = META[8]
    BLOCK_N: tl.constexpr = META[9]
    BLOCK_K: tl.constexpr = META[10]
    GROUP_M: tl.constexpr = META[11]
    USE_TMA: tl.constexpr = META[12]
    PERSISTENT: tl.constexpr = META[13]
    K_TAIL: tl.constexpr = META[14]
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tail_tensors = (tail_tensor_0, tail_tensor_1, tail_tensor_2, tail_tensor_3)
    if PERSISTENT:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
        lo_desc = w_desc  # unread unless an operand is split in memory; its halves share their strides
        if PRECISION == SPLIT_W:
            lo_desc = tl.make_tensor_descriptor(lo_ptr, shape=[N, K], strides=[stride_wn, 1],
                                                block_shape=[BLOCK_N, BLOCK_K])
        if PRECISION == SPLIT_X:
            lo_desc = tl.make_tensor_descriptor(lo_ptr, shape=[M, K], strides=[stride_xm, 1],
                                                block_shape=[BLOCK_M, BLOCK_K])
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            acc = _descriptor_tile_product(x_desc, w_desc, lo_desc, K, pid_m, pid_n, PRECISION, BLOCK_M, BLOCK_N,
                                           BLOCK_K)
            tile_epilogue(acc, pid_m, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N),
                          M, N, y_col0, stride_ym, num_pid_m, bias_ptr, scale_ptr, running_mean_ptr,
                          running_var_ptr, gamma_ptr, beta_ptr, tail_tensors, y_ptr, epilogue_out_ptr, mean_ptr,
                          invstd_ptr, scale_value, eps, EPILOGUE, STORE_Y, EVAL_STATS, HAS_BIAS, SCALE_MODE,
                          HAS_GAMMA, HAS_BETA, BLOCK_M, TAIL)
    else:
        pid_m, pid_n = grouped_tile(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_product(x_ptr, w_ptr, lo_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, pid_m, pid_n,
                            rows, cols, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, K_TAIL)
        tile_epilogue(acc, pid_m, rows, cols, M, N, y_col0, stride_ym, num_pid_m, bias_ptr, scale_ptr,
                      running_mean_ptr, running_var_ptr, gamma_ptr, beta_ptr, tail_tensors, y_ptr, epilogue_out_ptr,
                      mean_ptr, invstd_ptr, scale_value, eps, EPILOGUE, STORE_Y, EVAL_STATS, HAS_BIAS, SCALE_MODE,
                      HAS_GAMMA, HAS_BETA, BLOCK_M, TAIL)


@triton.jit
def _tile_product(x_ptr, w_ptr, lo_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, pid_m, pid_n, rows,
                  cols, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr, K_TAIL: tl.constexpr):
    """The fp32 product of one output tile, a program's own (USE_TMA: x_ptr, w_ptr, lo_ptr are
    host-made tensor descriptors)."""
    if USE_TMA:
        acc = _descriptor_tile_product(x_ptr, w_ptr, lo_ptr, K, pid_m, pid_n, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = _fresh_accumulator(PRECISION, BLOCK_M, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        # Out-of-range rows/columns wrap around for the loads (always in bounds, no masks in the main
        # loop); their results are never stored. The low half has its operand's shape and strides.
        x_offsets = tile_offsets(rows % M, ks, stride_xm, stride_xk)
        w_offsets = tile_offsets(ks, cols % N, stride_wk, stride_wn)
        x_ptrs = x_ptr + x_offsets
        w_ptrs = w_ptr + w_offsets
        if PRECISION == SPLIT_X:
            lo_ptrs = lo_ptr + x_offsets
            lo_step = BLOCK_K * stride_xk
        else:
            lo_ptrs = lo_ptr + w_offsets
            lo_step = BLOCK_K * stride_wk
        # Whole K blocks load unmasked; K_TAIL: a partial last one (K a batch) is masked, found at run time.
        k_whole = K - K % BLOCK_K
        for _ in range(0, k_whole, BLOCK_K):
            acc = _k_block(x_ptrs, w_ptrs, lo_ptrs, ks, BLOCK_K, acc, PRECISION, False)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
            lo_ptrs += lo_step
        if K_TAIL:
            if k_whole < K:
                acc = _k_block(x_ptrs, w_ptrs, lo_ptrs, ks, K - k_whole, acc, PRECISION, True)
        if _transposed(PRECISION):
            acc = tl.trans(acc)
    return acc


@triton.jit
def _descriptor_tile_product(x_desc, w_desc, lo_desc, K, pid_m, pid_n, PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile's fp32 product from TMA descriptors (made on the host or in the kernel): the copy
    engine fetches whole tiles, zero-filled past the edges, so no masks and no address arithmetic."""
    acc = _fresh_accumulator(PRECISION, BLOCK_M, BLOCK_N)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([pid_m * BLOCK_M, k0])
        b = w_desc.load([pid_n * BLOCK_N, k0]).T
        lo = b
        if PRECISION == SPLIT_W:
            lo = lo_desc.load([pid_n * BLOCK_N, k0]).T
        if PRECISION == SPLIT_X:
            lo = lo_desc.load([pid_m * BLOCK_M, k0])
        acc = _dot(a, b, lo, acc, PRECISION)
    if _transposed(PRECISION):
        acc = tl.trans(acc)
    return acc


@triton.constexpr_function
def _transposed(precision):
    """Whether _dot accumulates y's tile transposed: a compile-time answer, which `if` needs to compile one
    branch only (the two accumulators' shapes differ)."""
    return precision in (SPLIT_X.value, ROUND_X.value, CAST_W.value)


@triton.jit
def _fresh_accumulator(PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if _transposed(PRECISION):
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y's tile transposed (see _dot)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


# --------------------------------------------------------------------------- launcher


@dataclass
class GemmOutputs:
    y: Tensor                  # the linear output (empty when not stored)
    out: Optional[Tensor]      # EPILOGUE_NORMALIZE: the op's output
    parts: Optional[Partials]  # EPILOGUE_STATISTICS: each row tile's means and M2s


@dataclass(frozen=True)
class EvalNormalization:
    """What the eval-mode epilogues read and write: the running statistics (batch_norm), gamma/beta, the
    scales, and the F-sized fp32 mean/invstd outputs filled from the running statistics."""
    batch_norm: BatchNorm
    mean: Tensor
    invstd: Tensor
    tail: Tail = Tail()
    out_dtype: Optional[torch.dtype] = None


def run_gemm(linear: Linear, precision: str, config: GemmConfig, *, epilogue: int = EPILOGUE_LINEAR.value,
             store_y: bool = True, scale_before: Scale = Scale(),
             eval_norm: Optional[EvalNormalization] = None) -> GemmOutputs:
    """y = x @ W^T + b with the epilogue asked for. `eval_norm` (eval mode) fills mean/invstd from the
    running statistics, and with EPILOGUE_NORMALIZE normalizes into a new output."""
    x, weight = linear.x, linear.weight
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"run_gemm: bad shapes {tuple(x.shape)} @ {tuple(weight.shape)}^T")
    if epilogue == EPILOGUE_NORMALIZE.value and eval_norm is None:
        raise ValueError("run_gemm: the NORMALIZE epilogue needs eval_norm (eval mode)")
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty((m, n) if store_y else (0, 0), device=x.device, dtype=x.dtype)
    return gemm_into(y, 0, linear, precision, config, epilogue, store_y, scale_before, eval_norm)


def needs_k_major_copy(weight: Tensor, precision: str) -> bool:
    """An (in, out) weight seen as (out, in) (a matmul head's W.t(), a backward's x.t()): TF32 tensor
    cores read their second operand K-major only, so the GEMM gives them a K-major copy (the tuner
    times it). A W prepared in memory is K-major already, and cast_w reads W's tiles into registers,
    whatever its layout."""
    return (weight.dtype == torch.float32 and not prepares(precision, "weight") and precision != "cast_w"
            and weight.stride(1) != 1)


def gemm_into(y: Tensor, y_col0: int, linear: Linear, precision: str, config: GemmConfig,
               epilogue: int = EPILOGUE_LINEAR.value, store_y: bool = True, scale_before: Scale = Scale(),
               eval_norm: Optional[EvalNormalization] = None, workspace: Optional[Workspace] = None) -> GemmOutputs:
    """One launch: x @ W^T + b into y's columns y_col0 on, and the epilogue's other outputs (new); an
    operand prepared in memory is made in `workspace` if given (prepare_operands)."""
    x, weight, bias = linear.x, linear.weight, linear.bias
    m, k = x.shape
    n = weight.shape[0]
    device = x.device
    x, weight, lo = prepare_operands(x, weight, precision, workspace)
    # The operands' shapes from here on are (m, k) and (n, k), whatever their buffers' widths.
    if needs_k_major_copy(weight, precision):
        weight = weight.contiguous()
    normalizes = epilogue == EPILOGUE_NORMALIZE.value
    out = torch.empty((m, n), device=device, dtype=eval_norm.out_dtype) if normalizes else None
    parts = (Partials.allocate(triton.cdiv(m, config.block_m), config.block_m, n, device)
             if epilogue == EPILOGUE_STATISTICS.value else None)
    placeholder = unused_pointer(device)

    def opt(t: Optional[Tensor]) -> Tensor:
        return present_or_placeholder(t, placeholder)

    # Without a pre-split operand the kernel never reads lo. It gets the placeholder, not an operand a
    # second time: traced by Inductor, W passed twice made the graph write the autocast cast of W into
    # two buffers (measured: a second 128 MB copy at 8192 x 8192 bf16, and its write in the cast kernel).
    operands = (x, weight, opt(lo))
    if config.tma:
        lo_rows, lo_block = (m, config.block_m) if precision == "split_x" else (n, config.block_n)
        lo = weight if lo is None else lo  # a descriptor needs an operand-shaped tensor; unread
        why = limits.tma_layout(x, weight, lo)
        if why:
            raise ValueError(f"run_gemm: {why}")
        operands = (_descriptor(x, m, k, config.block_m, config.block_k),
                    _descriptor(weight, n, k, config.block_n, config.block_k),
                    _descriptor(lo, lo_rows, k, lo_block, config.block_k))
    bn = eval_norm.batch_norm if eval_norm else None
    tail = eval_norm.tail if eval_norm else Tail()
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    grid = (torch.sym_min(sm_count(device), tiles) if config.persistent else tiles,)
    if config.persistent and not tracing():  # traced, Inductor's launcher provides the descriptors' memory
        triton.set_allocator(_scratch_allocator(device))
    launch(_gemm_kernel)[grid](
        *operands, opt(bias),
        opt(scale_before.tensor), opt(bn and bn.running_mean), opt(bn and bn.running_var),
        opt(bn and bn.weight), opt(bn and bn.bias), *(opt(t) for t in tail.tensors),
        y, opt(out if normalizes else parts and parts.stats),
        opt(eval_norm and eval_norm.mean), opt(eval_norm and eval_norm.invstd),
        m, n, k, y_col0,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0),
        scale_before.value, bn.eps if bn else 0.0,
        META=tuple(GemmMeta(
            precision=kernel_precision(precision, x.dtype),
            epilogue=epilogue, store_y=store_y, eval_stats=eval_norm is not None,
            has_bias=bias is not None, scale_mode=scale_before.mode,
            has_gamma=bn is not None and bn.weight is not None, has_beta=bn is not None and bn.bias is not None,
            block_m=config.block_m, block_n=config.block_n, block_k=config.block_k, group_m=config.group_m,
            use_tma=config.tma, persistent=config.persistent, k_tail=k_may_end_partial(k, config.block_k))),
        TAIL=pointwise.tail_program(tail.program, tail.tensors),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return GemmOutputs(y, out, parts)


def _scratch_allocator(device: torch.device):
    """Global memory for the TMA descriptors a kernel makes (Triton asks the allocator set last)."""
    return lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device)


def _descriptor(t: Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> TensorDescriptor:
    """A TMA descriptor of t's first `rows` x `cols` (a split buffer is wider): tiles past them read 0."""
    return TensorDescriptor(t, [rows, cols], [t.stride(0), 1], [block_rows, block_cols])
