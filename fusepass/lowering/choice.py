"""What can run a call of fusepass's tuned ops (tuned_op.py): the GEMM precision, the Triton tile
configs and cuBLAS; and for the chain op its problem (the tuning key) and its candidates.

A chain's problem is a family, its features (in and out) and every argument that changes a kernel (each
tensor's dtype and kind, every flag and option; not the float values, which change none), and a bucket
of its rows, the batch, rounded up to a power of two. The candidates are decided from the bucket, not
the call's exact row count, so that every call of a bucket is offered the same ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from fusepass.lowering import gemm_configs, limits, tuning, warp_specialized_gemm
from fusepass.lowering.gemm_precisions import prepared_variant
from fusepass.lowering.implementations import Implementation
from fusepass.lowering.launch import hint
from fusepass.lowering.schema import FLAT_NAMES, ChainArgs, flatten, unflatten
from fusepass.lowering.tuning import Problem, bucket

OP_NAME = "fusepass::batch_norm_chain"
TRITON_GEMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def matmul_precision(dtype: torch.dtype, fp32_matmul: str) -> str:
    """The GEMM precision for this call: bf16/fp16 natively; fp32 as the user allows it (TF32 when
    torch allows TF32, as eager), else fp32-accurate 3xTF32, or IEEE FMA when asked for."""
    if dtype != torch.float32:
        return "native"
    if fp32_matmul == "ieee":
        return "ieee"
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "tf32x3"


def gemm_option(x: Tensor, weight: Tensor, gemm_option: str) -> str:
    """The kernel option `gemm`, except that dtypes the Triton GEMM lacks go to cuBLAS."""
    if x.dtype not in TRITON_GEMM_DTYPES or weight.dtype != x.dtype:
        return "cublas"
    return gemm_option


def triton_configs(precisions: list[str], dtype: torch.dtype, m: int, n: int, device: torch.device,
                   tma: bool) -> list[tuple[str, gemm_configs.GemmConfig]]:
    """(precision, tile config) for each that the tuner's search times (gemm_configs.shortlist for an m x n
    output unless the search is full); TMA configs only where `tma` (their operands are checked per
    call, limits.py)."""
    chosen = []
    for p in precisions:
        configs = gemm_configs.candidates(p, dtype)
        if tuning.search() != "full":
            configs = gemm_configs.shortlist(configs, m, n, device)
        chosen += [(p, config) for config in configs if tma or not config.tma]
    return chosen


def cublas_traceable(precision: str) -> bool:
    """A traced F.linear becomes Inductor's matmul, which follows torch's global TF32 flag when it runs:
    right only where that flag already gives the precision asked for."""
    return precision == "native" or torch.backends.cuda.matmul.allow_tf32 == (precision == "tf32")


# --------------------------------------------------------------------------- the chain op


def problem(args: ChainArgs, traced: bool) -> Problem:
    """The chain call's tuning problem: its family (OP_NAME, the features, precision, gemm option, every
    argument that changes a kernel, traced or not) and its bucket of rows."""
    x = args.linear.x
    precision = matmul_precision(x.dtype, args.kernel.fp32_matmul)
    parts = [OP_NAME, f"features={hint(x.shape[1])}->{hint(args.n_features)}", f"precision={precision}",
             f"gemm={_gemm_choice(args)}"]
    parts += [f"{name}={_family_part(value)}" for name, value in zip(FLAT_NAMES, flatten(args))
              if not isinstance(value, float)]
    return Problem(" ".join(parts + (["traced"] if traced else [])), (bucket(hint(x.shape[0])),))


def _family_part(value: Any) -> str:
    """A tensor by dtype and kind (its shape with each dimension over 1 as `n`): its sizes are the
    bucket's. Absent: `-`. Anything else as it is."""
    if isinstance(value, Tensor):
        shape = ",".join("1" if hint(d) == 1 else "n" for d in value.shape)
        return f"({shape}):{str(value.dtype).removeprefix('torch.')}"
    if value is None:
        return "-"
    return str(value).removeprefix("torch.")


def _gemm_choice(args: ChainArgs) -> str:
    return gemm_option(args.linear.x, args.linear.compute_weight_like(), args.kernel.gemm)


def candidates(args: ChainArgs, problem: Problem, traced: bool = False) -> dict[str, Implementation]:
    """Every way to run the op for this problem that the tuner's search times (tuning.search: the short
    search takes each precision's gemm_configs.shortlist), by name, the default first; only those that
    can launch for this call (Implementation.unlaunchable). Under autocast, an fp32 weight also cast tile
    by tile in the Triton GEMM (cast_w), unless the op returns a cast of it for its backward anyway. TF32
    and 3xTF32 also with the smaller operand prepared in memory (gemm_precisions.py), unless the options
    forbid operand copies, and in TF32 and 3xTF32 the warp-specialized Gluon GEMM preparing either operand,
    in memory (unless forbidden) or in the kernel, which copies nothing (Hopper; warp_specialized_offered).
    Plain fp32 FMA ("ieee") is cuBLAS's alone, whatever the gemm option says. TMA tile configs are
    offered where the call is not traced. `traced`: only those that can run inside Inductor's graph (may
    be none; see cublas_traceable)."""
    x = args.linear.x
    (rows,), in_features, out_features = problem.sizes, hint(x.shape[1]), hint(args.n_features)
    precision = matmul_precision(x.dtype, args.kernel.fp32_matmul)
    choice = _gemm_choice(args)
    found = {}
    if choice in ("auto", "triton") and precision != "ieee":
        precisions = [precision]
        variant = prepared_variant(precision, rows * in_features, out_features * in_features)
        if variant and args.kernel.operand_copies:
            precisions.append(variant)
        if args.linear.casts_weight and not args.returns_compute_weight:
            precisions.append("cast_w")
        # Traced, no TMA configs: torch does not capture TMA descriptors when it traces a wrap_triton
        # launch outside Dynamo ("not yet supported", torch 2.13's triton_kernel_wrap.py), and the
        # operands' addresses (so their alignment) are not known yet.
        for p, config in triton_configs(precisions, x.dtype, rows, out_features, x.device, tma=not traced):
            impl = Implementation(p, config)
            found[impl.name] = impl
        if warp_specialized_offered(args, rows):
            for p, config in warp_specialized_gemm.candidates(precision, args.kernel.operand_copies):
                impl = Implementation(p, config)
                found[impl.name] = impl
    if (choice in ("auto", "cublas") or not found) and (not traced or cublas_traceable(precision)):
        found["cublas"] = Implementation(precision)
    return {name: impl for name, impl in found.items() if impl.unlaunchable(args) is None}


# The warp-specialized GEMM launches from Python (an opaque op: 0.1-0.3 ms of host a call on the H100 and H200
# machines' hosts), so without CUDA graphs it is offered only for GEMMs whose GPU time hides that. In 3xTF32
# from TF32X3_MIN_FLOP, 0.3 ms at 100 TFLOP/s. H100, eval forwards under no_grad, offered at every size
# against not: gemm_batchnorm_scale_softmax at 1024 x 8192 -> 8192 1.121 against 1.350 ms; the MLP 1.612
# against 1.961. A training step also launches its backward's GEMMs from Python (those of at least
# warp_specialized_gemm.UNHIDDEN_MIN_FLOP), splitting in the kernel below UNGRAPHED_MIN_FLOP
# (linear.launches_hidden), which leaves the host time for the forward. H200,
# fp32 training steps in default mode, offered at every size against from UNGRAPHED_MIN_FLOP only (each in
# its own process): 1024 x 8192 -> 8192 2.709 -> 2.470 ms (its forward 1.345 -> 1.100), with softmax 2.681 ->
# 2.497 (1.340 -> 1.115), the MLP(1024, [4096, 4096, 256]) at 4096 rows 5.550 -> 4.846 (2.012 -> 1.654).
TF32X3_MIN_FLOP = 3e10
# TF32's one product takes a third of 3xTF32's time, so it needs a larger GEMM: a TF32 forward without a
# backward at 1024 x 8192 -> 8192 (1.4e11 FLOP) lost with it offered (H200, gemm_batchnorm_scale_softmax's
# forward in training mode: 0.84x Inductor, against 0.99x not offered). H100, 3xTF32 training steps in
# default mode (the backward splitting in memory), offered from here against not: 16384 x 4096 -> 4096 (5.5e11
# FLOP per GEMM) 9.893 against 11.121 ms.
UNGRAPHED_MIN_FLOP = 2.5e11
# A matmul head at any size: H100, matmul_batchnorm_scale_softmax (1024 x 8192 -> 8192, default mode) offered
# against not, training forward 1.525 -> 1.085 ms and its own peak 353 -> 96 MB; training step 2.952 -> 2.530.


def warp_specialized_offered(args: ChainArgs, rows: int) -> bool:
    """Whether the chain is offered the warp-specialized GEMM (where it can launch): under CUDA graphs;
    for a GEMM of at least TF32X3_MIN_FLOP at `rows` (the bucket's) in 3xTF32, UNGRAPHED_MIN_FLOP in TF32;
    and for a weight that is not K-major (a matmul head's (in, out) W seen as (out, in)), which the Triton
    GEMM reads through a K-major copy made on every call (gemm.needs_k_major_copy: W's size again) and
    this kernel reads in place."""
    flop = 2 * rows * hint(args.linear.x.shape[1]) * hint(args.n_features)
    tf32 = matmul_precision(args.linear.x.dtype, args.kernel.fp32_matmul) == "tf32"
    return (args.kernel.cuda_graphs or not limits.k_major(args.linear.weight)
            or flop >= (UNGRAPHED_MIN_FLOP if tf32 else TF32X3_MIN_FLOP))


def without_collectives(args: ChainArgs) -> ChainArgs:
    """args as the tuner times them: a SyncBatchNorm chain as the batch-norm chain of this rank's rows. Each
    rank tunes on its own while it compiles, and may find in the disk cache a choice another rank had to
    time: a collective issued while timing would be joined by no other rank, or paired with another rank's
    real step, which it would hang or corrupt (seen with DDP and SyncBatchNorm on two H200s, the bf16 MLP
    demo: the fusepass steps stopped, twice, after one rank timed a chain that the other did not time).
    The collective costs every candidate the same, so leaving it out keeps their order."""
    bn = args.batch_norm
    return dataclasses.replace(args, batch_norm=dataclasses.replace(bn, group_name="")) if bn.group_name else args


def stand_ins(args: ChainArgs) -> ChainArgs:
    """Real tensors shaped like args' (fake) ones, at their size hints, with values of the kind they hold,
    for timing."""
    def real(t):
        if not isinstance(t, Tensor):
            return t
        return torch.randn(tuple(hint(d) for d in t.shape), dtype=t.dtype, device=t.device)
    real_args = unflatten(real(a) for a in flatten(args))
    bn = real_args.batch_norm
    if bn.running_var is not None:  # a variance is positive
        bn = dataclasses.replace(bn, running_var=bn.running_var.abs() + 0.5)
    return dataclasses.replace(real_args, batch_norm=bn)
