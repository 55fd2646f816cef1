"""The warp-specialized TF32 and 3xTF32 GEMM's Gluon kernel (warp_specialized_gemm.py launches it): out =
a @ b^T from tf32 parts of both operands (PARTS): hi + lo halves, three products (3xTF32), or hi alone,
each operand rounded to nearest, one product (TF32). a's parts are made in registers, b's in memory or,
one K block ahead, in shared memory by the consumers.

Why Gluon: each K block's three tf32 products go into a fresh accumulator that is added to the running
sum in fp32 (gemm._three_pass_dot: the tensor cores' own accumulation truncates), and that add must wait
for the block's wgmmas. With `tl.dot`, triton 3.6 then waits for every wgmma (`wait_group 0`), and a
second accumulator to add one block late is serialized by ptxas ("non wgmma instructions reading
accumulator registers"). Here one loader warp feeds two consumer warpgroups of 64 rows each through
mbarriers; they are not in lockstep, so one warpgroup's adds and splits run while the other's wgmmas hold
the tensor cores. Measured on an H100 with W already split in memory: 130-136 TFLOP/s at 1024 x 8192 -> 8192,
16384 x 4096 -> 4096 and 4096 x 4096 -> 4096, against 96-108 for the same math with one warpgroup pair in
lockstep (1024 x 8192 -> 8192: 1.027 against 1.268 ms); with the split in the linear op's blocks,
BENCHMARKS.md "GEMM alone".

TF32 needs no fresh accumulator (its one product accumulates as cuBLAS's and tl.dot's do); it is here for
the same pipeline: the loader warp and two consumer warpgroups out of lockstep, so that one's rounding of
its `a` tile in registers runs while the other's wgmmas hold the tensor cores.

Its epilogue adds the bias and, for a training chain's forward, stores the batch statistics' partials as
the Triton GEMM's EPILOGUE_STATISTICS does (per feature, the mean and M2 of z = y * scale over each part
of the batch), which the chain's passes then merge (normalize.py). The grid's second dimension splits K:
a program sums its split's K blocks, the first split stores into out, the others into partial sums that
the launcher adds (warp_specialized_gemm.k_splits says when).
"""

from __future__ import annotations

import triton.language as tl

from fusepass.lowering.tiles import SCALE_PER_FEATURE, SCALE_SINGLE

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    # The TMA load's name: triton 3.6's, renamed by 3.9 (same arguments)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # a Triton without Gluon: the kernel is never offered (warp_specialized_gemm.unlaunchable)
    gluon = None

# How the kernel reads b (B_MODE): its tf32 halves split in memory, or its raw tile, K-major (split in place)
# or MN-major (split into K-major halves beside it)
B_SPLIT_IN_MEMORY = tl.constexpr(0)
B_K_MAJOR = tl.constexpr(1)
B_MN_MAJOR = tl.constexpr(2)

if gluon is not None:
    _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # triton 3.6's name, 3.9's

    @gluon.jit
    def _tf32_split(a):
        """a = hi + lo exactly, hi rounded to tf32 (tf32_split.tf32_split's formula)."""
        bits = a.to(gl.int32, bitcast=True)
        hi = ((bits + 0x1000) & -8192).to(gl.float32, bitcast=True)
        return hi, a - hi

    @gluon.jit
    def _loader(a_desc, b_desc, lo_desc, a_bufs, b_bufs, lo_bufs, ready, empty, off_m, off_n, k_first, k_steps,
                STAGES: gl.constexpr, A_K_MAJOR: gl.constexpr, B_MODE: gl.constexpr, PARTS: gl.constexpr):
        """Fills stage after stage once both consumers have released it (empty), with a's tile and b's (its
        raw tile, or its parts made in memory: hi into b_bufs, lo into lo_bufs), K blocks from k_first."""
        LOADS_LO: gl.constexpr = B_MODE == B_SPLIT_IN_MEMORY and PARTS == 2
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1] if A_K_MAJOR else a_desc.block_type.shape[0]
        for i in range(k_steps):
            s = i % STAGES
            k = (k_first + i) * BLOCK_K
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            b_bytes: gl.constexpr = b_desc.block_type.nbytes * (2 if LOADS_LO else 1)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_bytes)
            if A_K_MAJOR:
                _tma_load(a_desc, [off_m, k], bar, a_bufs.index(s))
            else:
                _tma_load(a_desc, [k, off_m], bar, a_bufs.index(s))
            if B_MODE == B_MN_MAJOR:
                _tma_load(b_desc, [k, off_n], bar, b_bufs.index(s))
            else:
                _tma_load(b_desc, [off_n, k], bar, b_bufs.index(s))
            if LOADS_LO:
                _tma_load(lo_desc, [off_n, k], bar, lo_bufs.index(s))

    @gluon.jit
    def _split_b_half(b_tile, hi_tile, lo_tile, ROW0: gl.constexpr, ROWS: gl.constexpr, BLOCK_K: gl.constexpr,
                      B_MODE: gl.constexpr, PARTS: gl.constexpr):
        """This consumer's half of b's tile (ROWS of its rows from ROW0) into its tf32 parts (hi and
        lo, or hi alone), K-major: from a K-major tile (hi over it, each thread writing what it read), or from
        an MN-major one, each thread reading four consecutive K of one row (a warp's reads: 32 consecutive
        rows, 128 bytes) to store them as one 16-byte vector."""
        if B_MODE == B_K_MAJOR:
            layout: gl.constexpr = gl.BlockedLayout([1, 4], [128 // BLOCK_K, BLOCK_K // 4], [4, 1], [1, 0])
            hi, lo = _tf32_split(b_tile.slice(ROW0, ROWS).load(layout))
            hi_tile.slice(ROW0, ROWS).store(hi)
            if PARTS == 2:
                lo_tile.slice(ROW0, ROWS).store(lo)
        else:
            layout: gl.constexpr = gl.BlockedLayout([4, 1], [1, 32], [4, 1], [0, 1])
            hi, lo = _tf32_split(b_tile.slice(ROW0, ROWS, dim=1).load(layout))
            hi_tile.slice(ROW0, ROWS).permute((1, 0)).store(hi)
            if PARTS == 2:
                lo_tile.slice(ROW0, ROWS).permute((1, 0)).store(lo)

    @gluon.jit
    def _split_stage(b_bufs, hi_bufs, lo_bufs, ready, split_done, i, ROW0: gl.constexpr, ROWS: gl.constexpr,
                     BLOCK_K: gl.constexpr, STAGES: gl.constexpr, B_MODE: gl.constexpr, PARTS: gl.constexpr):
        """This consumer's half of K block i's b tile split, once loaded, and announced (split_done). The
        stores are the generic proxy's and the wgmmas read through the async proxy: every thread fences its
        own, then one thread arrives for the warpgroup after all four warps have."""
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        _split_b_half(b_bufs.index(s), hi_bufs.index(s), lo_bufs.index(s), ROW0, ROWS, BLOCK_K, B_MODE, PARTS)
        fence_async_shared()
        _thread_barrier()
        mbarrier.arrive(split_done.index(s), count=1)

    @gluon.jit
    def _consumer(a_bufs, b_bufs, hi_bufs, lo_bufs, ready, split_done, empty, out_ptr, partials_ptr, bias_ptr,
                  scale_ptr, parts_ptr, M, N, stride_om, stride_on, part_stride, m2_offset, scale_value,
                  off_m, off_n, k_split, k_steps, ROW0: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, STAGES: gl.constexpr, A_K_MAJOR: gl.constexpr, B_MODE: gl.constexpr,
                  PARTS: gl.constexpr, STATISTICS: gl.constexpr, TRANSPOSED: gl.constexpr, HAS_BIAS: gl.constexpr,
                  SCALE_MODE: gl.constexpr):
        """ROWS rows of the output tile from ROW0: per K block, once both consumers have split their halves
        of b's tile (split_done; b split in memory: once loaded), the block's wgmmas: in 3xTF32 three into a
        fresh accumulator, in TF32 one into the running sum; while they run, this consumer's half of the
        next block's b tile is split; then the wgmmas are waited for, the stage released and (3xTF32) the
        block added in fp32. Then the epilogue. Splitting a block ahead keeps the two consumers out of
        lockstep: one's split and add run while the other's wgmmas hold the tensor cores (split in the
        same block, an H100 lost 15-20%)."""
        SPLIT: gl.constexpr = B_MODE != B_SPLIT_IN_MEMORY
        B_ROWS: gl.constexpr = BLOCK_N // 2  # this consumer's half of b's tile, which it splits
        B_ROW0: gl.constexpr = ROW0 // ROWS * B_ROWS
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=1)
        unused = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=mma_layout)  # use_acc=False ignores it
        acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        if SPLIT:
            _split_stage(b_bufs, hi_bufs, lo_bufs, ready, split_done, 0, B_ROW0, B_ROWS, BLOCK_K, STAGES, B_MODE,
                         PARTS)
        for i in range(k_steps):
            s = i % STAGES
            if not SPLIT:  # (splitting, this block's _split_stage waited)
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            if A_K_MAJOR:
                a_tile = a_bufs.index(s).slice(ROW0, ROWS)
            else:
                a_tile = a_bufs.index(s).slice(ROW0, ROWS, dim=1).permute((1, 0))
            a_hi, a_lo = _tf32_split(a_tile.load(a_layout))
            b_hi = hi_bufs.index(s).permute((1, 0))
            if SPLIT:
                mbarrier.wait(split_done.index(s), (i // STAGES) & 1)
            if PARTS == 2:
                block = warpgroup_mma(a_lo, b_hi, unused, use_acc=False, is_async=True)
                block = warpgroup_mma(a_hi, lo_bufs.index(s).permute((1, 0)), block, is_async=True)
                block = warpgroup_mma(a_hi, b_hi, block, is_async=True)
            else:
                block = warpgroup_mma(a_hi, b_hi, acc, is_async=True)
            if SPLIT:
                if i + 1 < k_steps:
                    _split_stage(b_bufs, hi_bufs, lo_bufs, ready, split_done, i + 1, B_ROW0, B_ROWS, BLOCK_K,
                                 STAGES, B_MODE, PARTS)
            block = warpgroup_mma_wait(0, deps=(block,))
            mbarrier.arrive(empty.index(s), count=1)
            if PARTS == 2:
                acc = acc + block
            else:
                acc = block
        rows = off_m + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_layout))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        if TRANSPOSED:  # y^T: the tile's rows are features, its columns the batch's rows
            part = off_n // BLOCK_N
        else:
            part = (off_m + ROW0) // ROWS
        _epilogue(acc, rows, cols, M, N, out_ptr, partials_ptr, stride_om, stride_on, k_split, bias_ptr,
                  scale_ptr, scale_value, parts_ptr, part, part_stride, m2_offset, STATISTICS, TRANSPOSED, HAS_BIAS,
                  SCALE_MODE)

    @gluon.jit
    def _per_feature(v, TRANSPOSED: gl.constexpr):
        """A vector over the features, broadcast over the tile (y^T's tile has them as rows)."""
        if TRANSPOSED:
            return v[:, None]
        else:
            return v[None, :]

    @gluon.jit
    def _per_batch_row(v, TRANSPOSED: gl.constexpr):
        """A vector over the batch's rows, broadcast over the tile (y^T's tile has them as columns)."""
        if TRANSPOSED:
            return v[None, :]
        else:
            return v[:, None]

    @gluon.jit
    def _load_scale(scale_ptr, scale_value, features, feature_ok, SCALE_MODE: gl.constexpr):
        """tiles.load_scale's three forms of the scale, as an fp32 vector over the features."""
        if SCALE_MODE == SCALE_PER_FEATURE:
            s = gl.load(scale_ptr + features, mask=feature_ok, other=0.0)
        elif SCALE_MODE == SCALE_SINGLE:
            s = gl.load(scale_ptr + features * 0, mask=feature_ok, other=0.0)
        else:
            s = (features * 0).to(gl.float32) + scale_value
        return s.to(gl.float32)

    @gluon.jit
    def _epilogue(acc, rows, cols, M, N, out_ptr, partials_ptr, stride_om, stride_on, k_split,
                  bias_ptr, scale_ptr, scale_value, parts_ptr, part, part_stride, m2_offset, STATISTICS: gl.constexpr,
                  TRANSPOSED: gl.constexpr, HAS_BIAS: gl.constexpr, SCALE_MODE: gl.constexpr):
        """y = acc + bias stored; with STATISTICS, the mean and M2 of z = y * scale over the tile's rows of
        the batch, per feature, at `part` of the partials (gemm_epilogue.EPILOGUE_STATISTICS's). With K split
        across programs, the first split's sum (with the bias) goes to out and split s's (no bias) to
        partials' slice s - 1, laid out as out is, for the launcher to add."""
        row_ok = rows < M
        col_ok = cols < N
        if TRANSPOSED:
            features, feature_ok, in_batch = rows, row_ok, col_ok
        else:
            features, feature_ok, in_batch = cols, col_ok, row_ok
        if HAS_BIAS:
            bias = gl.load(bias_ptr + features, mask=feature_ok & (k_split == 0), other=0.0)
            acc = acc + _per_feature(bias, TRANSPOSED)
        offsets = rows[:, None].to(gl.int64) * stride_om + cols[None, :].to(gl.int64) * stride_on
        mask = row_ok[:, None] & col_ok[None, :]
        if k_split == 0:
            gl.store(out_ptr + offsets, acc, mask=mask)
        else:
            gl.store(partials_ptr + (k_split - 1).to(gl.int64) * M * N + offsets, acc, mask=mask)
        if STATISTICS:
            z = acc * _per_feature(_load_scale(scale_ptr, scale_value, features, feature_ok, SCALE_MODE),
                                   TRANSPOSED)
            batch_axis: gl.constexpr = 1 if TRANSPOSED else 0
            batch_ok = _per_batch_row(in_batch, TRANSPOSED)
            count = gl.sum(in_batch.to(gl.float32), axis=0)
            # The mean in two passes, as tiles.tile_column_stats takes it (why: there)
            rough_mean = gl.sum(gl.where(batch_ok, z, 0.0), axis=batch_axis) / count
            deviation = gl.where(batch_ok, z - _per_feature(rough_mean, TRANSPOSED), 0.0)
            correction = gl.sum(deviation, axis=batch_axis) / count
            correction = gl.where((correction > float("-inf")) & (correction < float("inf")), correction, 0.0)
            centered = gl.where(batch_ok, deviation - _per_feature(correction, TRANSPOSED), 0.0)
            m2 = gl.sum(centered * centered, axis=batch_axis)
            mean = rough_mean + correction
            at = parts_ptr + part.to(gl.int64) * part_stride + features
            stored = feature_ok & (count > 0)  # a consumer's rows past the batch write no part
            gl.store(at, mean, mask=stored)
            gl.store(at + m2_offset, m2, mask=stored)

    @gluon.jit
    def gemm_kernel(
        a_desc, b_desc, lo_desc,  # descriptors: a (M, K) K-major, or a^T (K, M); b (N, K), b^T (K, N) or b's hi
        # and lo (N, K) (B_MODE; lo_desc read only for B_SPLIT_IN_MEMORY)
        out_ptr, partials_ptr, bias_ptr, scale_ptr, parts_ptr,  # pointers: out (M, N), the other K splits' sums
        # (one fewer than the K splits, each laid out as out); per feature; the statistics' partials
        M, N, K, stride_om, stride_on, part_stride, m2_offset,  # sizes, strides
        k_steps_per_split, scale_value,
        BLOCK_M: gl.constexpr, A_K_MAJOR: gl.constexpr, B_MODE: gl.constexpr, PARTS: gl.constexpr,
        HALF_LAYOUT: gl.constexpr,
        STATISTICS: gl.constexpr, TRANSPOSED: gl.constexpr, HAS_BIAS: gl.constexpr, SCALE_MODE: gl.constexpr,
        STAGES: gl.constexpr, GROUP: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    ):
        B_ROWS: gl.constexpr = B_MODE != B_MN_MAJOR  # b's tile is (BLOCK_N, BLOCK_K), else (BLOCK_K, BLOCK_N)
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0] if B_ROWS else b_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = b_desc.block_type.shape[1] if B_ROWS else b_desc.block_type.shape[0]
        pid = gl.program_id(0)
        k_split = gl.program_id(1)  # which K blocks (the grid's second dimension splits K)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        tiles_in_group = GROUP * gl.cdiv(N, BLOCK_N)
        first_m = (pid // tiles_in_group) * GROUP
        group_rows = min(num_pid_m - first_m, GROUP)
        off_m = (first_m + (pid % tiles_in_group) % group_rows) * BLOCK_M
        off_n = ((pid % tiles_in_group) // group_rows) * BLOCK_N

        a_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        hi_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, BLOCK_K], HALF_LAYOUT)
        if PARTS == 2:
            lo_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, BLOCK_K], HALF_LAYOUT)
        else:
            lo_bufs = hi_bufs  # (never read)
        if B_MODE == B_MN_MAJOR:
            b_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        else:
            b_bufs = hi_bufs  # hi loaded, or the raw tile split in place
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        split_done = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(split_done.index(s), count=2)  # one arrive per consumer warpgroup
            mbarrier.init(empty.index(s), count=2)
        k_first = k_split * k_steps_per_split
        k_steps = min(gl.cdiv(K, BLOCK_K) - k_first, k_steps_per_split)  # (the launcher leaves none empty)
        rows: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, hi_bufs, lo_bufs, ready, split_done, empty, out_ptr, partials_ptr, bias_ptr,
                         scale_ptr, parts_ptr, M, N, stride_om, stride_on, part_stride, m2_offset,
                         scale_value, off_m, off_n, k_split, k_steps, 0, rows, BLOCK_N, BLOCK_K, STAGES, A_K_MAJOR,
                         B_MODE, PARTS, STATISTICS, TRANSPOSED, HAS_BIAS, SCALE_MODE)),
            (_consumer, (a_bufs, b_bufs, hi_bufs, lo_bufs, ready, split_done, empty, out_ptr, partials_ptr, bias_ptr,
                         scale_ptr, parts_ptr, M, N, stride_om, stride_on, part_stride, m2_offset,
                         scale_value, off_m, off_n, k_split, k_steps, rows, rows, BLOCK_N, BLOCK_K, STAGES, A_K_MAJOR,
                         B_MODE, PARTS, STATISTICS, TRANSPOSED, HAS_BIAS, SCALE_MODE)),
            (_loader, (a_desc, b_desc, lo_desc, a_bufs, b_bufs, lo_bufs, ready, empty, off_m, off_n, k_first, k_steps,
                       STAGES, A_K_MAJOR, B_MODE, PARTS)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
else:
    gemm_kernel = None  # never launched (warp_specialized_gemm.unlaunchable)
