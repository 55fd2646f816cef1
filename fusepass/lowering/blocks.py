"""How many rows of an operand the GEMM prepares in memory per launch (its tf32 split or rounding, or a
K-major copy): the bound that keeps a GEMM's copies to a block of its prepared operand, not the whole
operand again. The linear op's GEMMs (linear.run_in_blocks, and the warp-specialized GEMM's blocks) and a
chain's forward on the warp-specialized GEMM run in these blocks."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from fusepass.lowering import gemm, gemm_configs
from fusepass.lowering.gemm_precisions import prepared, prepares, preparing_weight
from fusepass.lowering.launch import hint
from fusepass.lowering.schema import Linear

# The most memory the GEMM's copies of W take at once (its tf32 split, or a K-major copy): 16 MiB, a
# sixteenth of an 8192 x 8192 fp32 W. Unless a block would then have less than BLOCK_WAVES waves of tiles
# on the GPU's SMs, in whole column tiles: blocked into 128-column strips, a 16384-row batch's weight
# gradient took the fp32 training step from 13.0 to 17.5 ms (H200, 16384 x 4096 -> 4096). Two waves
# against eight (H100, one run, fp32 training steps): the MLP 5.84 -> 5.93 ms and 444 -> 365 MB,
# 16384 x 4096 -> 4096 11.99 -> 12.00 ms and 1344 -> 961 MB, 1024 x 8192 -> 8192 3.05 -> 2.95 ms. Rounded
# down to whole column tiles, not up: blocks of 32 row tiles then take 256 tiles (1.94 waves), not 288
# (2.2 waves, run in three; with them, and a rule since dropped, the MLP's step took 6.79 ms against
# 5.74, H200).
COPY_BYTES = 16 << 20
BLOCK_WAVES = 2


def block_rows(linear: Linear, precision: str, config: gemm_configs.GemmConfig, copy_bytes: Optional[int] = None,
               block_tiles: Optional[int] = None) -> int:
    """How many of W's rows each launch of x @ W^T takes: as many as keep their copies within
    `copy_bytes` (default COPY_BYTES), or, where more, `block_tiles` output tiles (default BLOCK_WAVES
    waves of the GPU's SMs) in whole column tiles (at least one). Whole column tiles, so a multiple of
    config.block_n, unless it is all of W's rows."""
    m, k = (hint(s) for s in linear.x.shape)
    if copy_bytes is None:
        copy_bytes = COPY_BYTES
    if block_tiles is None:
        block_tiles = BLOCK_WAVES * gemm_configs.sm_count(linear.x.device)
    row_tiles = -(-m // config.block_m)
    return max(_rows_within(copy_bytes, precision, linear.weight, k, config.block_n),
               max(1, block_tiles // row_tiles) * config.block_n)


def warp_specialized_block_rows(linear: Linear, precision: str, config: gemm_configs.GemmConfig) -> int:
    """Rows of the prepared operand per launch of the warp-specialized GEMM: 0 where it prepares it in the
    kernel (one launch); else block_rows for W, and for x the same rule with the roles swapped (the
    kernel computes y^T = W @ x^T)."""
    if config.split_in_kernel:
        return 0
    swapped = linear if prepared(precision).operand == "weight" else Linear(linear.weight, linear.x, None)
    return block_rows(swapped, preparing_weight(precision), config)


def _rows_within(copy_bytes: int, precision: str, weight: Tensor, k: int, block_n: int) -> int:
    """The most of W's rows, in whole column tiles (at least one), whose copies fit in copy_bytes; at the
    rows' size hint (W is x where the warp-specialized GEMM prepares x: no guard on a symbolic batch)."""
    rows = hint(weight.shape[0])
    if prepares(precision, "weight"):
        copies = prepared(precision).parts
    else:
        copies = int(gemm.needs_k_major_copy(weight, precision))
    if copies == 0:
        return rows
    tile_bytes = copies * block_n * max(k, 1) * weight.element_size()
    return min(rows, max(1, copy_bytes // tile_bytes) * block_n)
