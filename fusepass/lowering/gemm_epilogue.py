"""What the fused operator's GEMM does with an output tile after its main loop (gemm.py), one tile at a
time, whichever way the kernel walks its tiles (a program per tile, or persistent programs looping over
them).

Epilogues (EPILOGUE):
  EPILOGUE_LINEAR      store y (in y's dtype: x's, like eager's linear, or fp32 for a widened output);
  EPILOGUE_STATISTICS  store y, and per row tile and feature the mean and M2 of z = y * s1 (merged later
                       with Chan's formula by the passes after the GEMM);
  EPILOGUE_NORMALIZE   eval mode: store tail((z - running_mean) * invstd * gamma + beta) directly (and y
                       only if the backward needs it).
In eval mode the first row of tiles also writes the per-feature mean and invstd the op returns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusepass.lowering.pointwise import apply_tail
from fusepass.lowering.tiles import batch_norm_tile, inverse_std, load_scale, tile_column_stats, tile_offsets

EPILOGUE_LINEAR = tl.constexpr(0)
EPILOGUE_STATISTICS = tl.constexpr(1)
EPILOGUE_NORMALIZE = tl.constexpr(2)


@triton.jit
def tile_epilogue(acc, pid_m, rows, cols, M, N, y_col0, stride_ym, num_pid_m,
                  bias_ptr, scale_ptr, running_mean_ptr, running_var_ptr, gamma_ptr, beta_ptr, tail_tensors,
                  y_ptr, epilogue_out_ptr, mean_ptr, invstd_ptr, scale_value, eps,
                  EPILOGUE: tl.constexpr, STORE_Y: tl.constexpr, EVAL_STATS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  SCALE_MODE: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr,
                  BLOCK_M: tl.constexpr, TAIL: tl.constexpr):
    """acc: the tile's fp32 product, rows x cols of y (row tile pid_m of num_pid_m)."""
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    # Round to the linear's dtype as eager's linear does; everything after reads the rounded value.
    y = acc.to(y_ptr.dtype.element_ty)
    if STORE_Y:
        tl.store(y_ptr + tile_offsets(rows, y_col0 + cols, stride_ym, 1), y, mask=mask)
    y = y.to(tl.float32)

    s = load_scale(scale_ptr, scale_value, cols, col_mask, SCALE_MODE)
    if EPILOGUE == EPILOGUE_STATISTICS:
        count = tl.minimum(M - pid_m * BLOCK_M, BLOCK_M).to(tl.float32)
        tile_mean, tile_m2 = tile_column_stats(y * s[None, :], row_mask, count)
        tl.store(epilogue_out_ptr + pid_m * N + cols, tile_mean, mask=col_mask)
        tl.store(epilogue_out_ptr + (num_pid_m + pid_m) * N + cols, tile_m2, mask=col_mask)
    if EVAL_STATS:
        mean = tl.load(running_mean_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        invstd = inverse_std(tl.load(running_var_ptr + cols, mask=col_mask, other=1.0).to(tl.float32), eps)
        # The first row of tiles writes them; a masked store, not a branch: triton 3.6's fusion of a
        # persistent kernel's tile loop into its K loop fails on a branch here ("scf.if op region control
        # flow edge ... needs 5"), where the loaded values are used only inside it.
        first_row_tile = col_mask & ((tl.zeros_like(cols) + pid_m) == 0)
        tl.store(mean_ptr + cols, mean, mask=first_row_tile)
        tl.store(invstd_ptr + cols, invstd, mask=first_row_tile)
        if EPILOGUE == EPILOGUE_NORMALIZE:
            u = batch_norm_tile(y, s, mean, invstd, gamma_ptr, beta_ptr, cols, col_mask, HAS_GAMMA, HAS_BETA)
            u = apply_tail(u, cols, col_mask, tail_tensors, TAIL)
            tl.store(epilogue_out_ptr + tile_offsets(rows, cols, N, 1), u.to(epilogue_out_ptr.dtype.element_ty),
                     mask=mask)
