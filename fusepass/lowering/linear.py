"""`torch.ops.fusepass.linear(x, weight, bias, kernel_fp32_matmul, kernel_gemm, out_dtype=None,
kernel_operand_copies=True, kernel_cuda_graphs=False)`:
x @ weight^T + bias for 2-D operands of any strides, in x's dtype or, for bf16/fp16 operands, in fp32
straight from the GEMM's fp32 accumulators (out_dtype; a chain's weight gradient under autocast), on
fusepass's Triton GEMM (gemm.py, no epilogue) or on cuBLAS, whichever is fastest for the problem at the
call's precision (a tuned op, tuned_op.py: chosen per size bucket, cached like the chain op's choice).
Its autograd formula calls it again: dX = linear(g, W^T), dW = linear(g^T, x^T).

Two users: the fused chain's backward (its dX and dW GEMMs), and the bare-linear family (a linear
outside any chain). In fp32 at the default precision that puts every GEMM of a training step on
3xTF32 tensor-core math, whose error to float64 is below eager's fp32; cuBLAS at the same precision
(IEEE fp32 there: eager's own) is always a candidate, so the op is never slower than cuBLAS. On CPU the
op is F.linear, eager's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fusepass.lowering import blocks, gemm, gemm_configs, limits, tuning, warp_specialized_gemm
from fusepass.lowering.choice import (UNGRAPHED_MIN_FLOP, cublas_traceable, gemm_option, matmul_precision,
                                      triton_configs)
from fusepass.lowering.gemm_precisions import prepared, prepared_variant, prepares, workspace
from fusepass.lowering.implementations import cublas_precision, gemm_unlaunchable
from fusepass.lowering.launch import hint, stored
from fusepass.lowering.schema import FLOAT16_DTYPES, KernelOptions, Linear
from fusepass.lowering.tf32_split import split_row_stride
from fusepass.lowering.tuned_op import Declaration, TunedOp
from fusepass.lowering.tuning import Problem, bucket

OP_NAME = "fusepass::linear"


class LinearCall(NamedTuple):
    """The op's arguments, in its order."""
    x: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    kernel_fp32_matmul: str
    kernel_gemm: str
    out_dtype: Optional[torch.dtype] = None
    kernel_operand_copies: bool = True
    kernel_cuda_graphs: bool = False

    @property
    def kernel(self) -> KernelOptions:
        return KernelOptions(self.kernel_fp32_matmul, self.kernel_gemm, self.kernel_operand_copies,
                             self.kernel_cuda_graphs)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel_fp32_matmul: str, kernel_gemm: str,
           out_dtype: Optional[torch.dtype] = None, kernel_operand_copies: bool = True,
           kernel_cuda_graphs: bool = False) -> Tensor:
    """The op's signature."""


@dataclass(frozen=True)
class LinearImplementation:
    """The Triton GEMM in `precision` with tile `config` (on K-major copies of the operands where
    `k_major_copies`), or cuBLAS at that precision (config None)."""
    precision: str
    config: Optional[gemm_configs.GemmConfig] = None
    k_major_copies: bool = False

    @property
    def name(self) -> str:
        if self.config is None:
            return "cublas"
        copies = " on K-major copies" if self.k_major_copies else ""
        return f"triton {self.precision} {self.config.describe()}{copies}"

    def __call__(self, call: LinearCall) -> Tensor:
        x, weight, bias = call.x, call.weight, call.bias
        if self.config is None:
            with cublas_precision(self.precision):
                return _library_linear(x, weight, bias, _out_dtype(call))
        if self.config.warp_specialized:
            rows = blocks.warp_specialized_block_rows(Linear(x, weight, bias), self.precision, self.config)
            c = self.config
            y, _ = torch.ops.fusepass.warp_specialized_linear(x, weight, bias, None, 1.0, False, self.precision, rows,
                                                              c.block_n, c.block_k, c.num_stages, c.split_k)
            return y
        if self.k_major_copies:
            x, weight = _k_major_copy(x), _k_major_copy(weight)
        return run_in_blocks(Linear(x, weight, bias), self.precision, self.config, out_dtype=_out_dtype(call))

    def unlaunchable(self, call: LinearCall) -> Optional[str]:
        """Why this call cannot run on the Triton GEMM (limits.py, and the copy limit below), or None;
        cuBLAS always runs."""
        if self.config is None:
            return None
        # A batch of no rows (an empty output, or a weight gradient's empty reduction) is cuBLAS's: the
        # GEMM has no tiles to launch or blocks to size, and its tf32 splits no columns.
        empty = limits.first(*(limits.some_rows(size) for size in (*call.x.shape, call.weight.shape[0])))
        if empty:
            return empty
        return limits.first(limits.off_device(call.x.device, (call.weight, call.bias)),
                            gemm_unlaunchable(call.x, call.weight, _out_dtype(call), self.precision, self.config),
                            _copy_past_limit(call, self.precision, self.config))


# The most a GEMM's tf32 split may copy of an operand whose size grows with the batch: a weight gradient
# splits one of two (batch x features) operands, whose block of blocks.BLOCK_WAVES waves is often all of
# it (a 4096-feature layer: 32 KiB per row, 8 GiB at 262144 rows). Past it the call runs on cuBLAS, copying
# nothing: an MLP(1024, [4096, 4096, 256]) training step at 262144 rows held 23.0 GB on the Triton GEMMs,
# 16.9 on cuBLAS, against Inductor's 21.0 (fp32, H100). 512 MiB keeps the seed problems' choices: their
# largest split copy is a 16384-row weight gradient's, 512 MiB at 4096 x 4096.
SPLIT_COPY_LIMIT = 512 << 20


def run_in_blocks(linear: Linear, precision: str, config: gemm_configs.GemmConfig, copy_bytes: Optional[int] = None,
                  block_tiles: Optional[int] = None, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """x @ W^T + b on the Triton GEMM, in blocks of W's rows (y's columns) where the GEMM copies W
    (blocks.block_rows, `copy_bytes` and `block_tiles` passed on). W's tf32 split (rounding) is made block
    by block into one workspace of a block's rows, which each block's kernels write after the block before
    has read it: blocks of their own let a compiled graph allocate them all before the first GEMM (a TF32
    weight gradient at 1024 x 8192 -> 8192 held both blocks' roundings, 16 MiB each, at the step's peak:
    384 MB, H200)."""
    x, weight, bias = linear.x, linear.weight, linear.bias
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
    rows = blocks.block_rows(linear, precision, config, copy_bytes, block_tiles)
    shared = (workspace(precision, rows, x.shape[1], weight)
              if rows < n and prepares(precision, "weight") else None)
    for n0 in range(0, n, rows):
        block = Linear(x, weight[n0:n0 + rows], bias[n0:n0 + rows] if bias is not None else None)
        gemm.gemm_into(y, n0, block, precision, config, workspace=shared)
    return y


def _copy_past_limit(call: LinearCall, precision: str, config: gemm_configs.GemmConfig) -> Optional[str]:
    """Why the call's operand prepared in memory (gemm_precisions.py) would copy more than SPLIT_COPY_LIMIT
    at once, or None: x whole, or a block of W's rows. Compared on the call's own sizes: traced with a
    symbolic batch, the graph guards on the comparison, and a batch past the limit compiles (once) a graph
    on cuBLAS."""
    x, weight = call.x, call.weight
    how = prepared(precision)
    if how is None or config.split_in_kernel:
        return None
    if config.warp_specialized:
        split_rows = min((x if how.operand == "x" else weight).shape[0],
                         blocks.warp_specialized_block_rows(Linear(x, weight, None), precision, config))
    elif how.operand == "x":
        split_rows = x.shape[0]
    else:
        split_rows = min(weight.shape[0], blocks.block_rows(Linear(x, weight, None), precision, config))
    copy_bytes = how.parts * split_rows * split_row_stride(x.shape[1]) * x.element_size()
    if copy_bytes > SPLIT_COPY_LIMIT:
        return f"its {precision} copies would take {hint(copy_bytes) >> 20} MiB, past {SPLIT_COPY_LIMIT >> 20} MiB"
    return None


def _validate(call: LinearCall) -> None:
    call.kernel.validate()
    x, weight, bias = call.x, call.weight, call.bias
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise RuntimeError(f"fusepass.linear: mat1 and mat2 shapes cannot be multiplied "
                           f"({x.shape[0]}x{x.shape[1]} and {weight.shape[1]}x{weight.shape[0]})")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise RuntimeError("fusepass.linear: x, weight and bias must have the same dtype")
    out_dtype = _out_dtype(call)
    if out_dtype not in (x.dtype, torch.float32) or (out_dtype != x.dtype and x.dtype not in FLOAT16_DTYPES):
        raise RuntimeError(f"fusepass.linear: out_dtype {call.out_dtype} for {x.dtype} operands: "
                           f"only fp32 from {FLOAT16_DTYPES[0]} or {FLOAT16_DTYPES[1]}")


def _out_dtype(call: LinearCall) -> torch.dtype:
    return call.out_dtype or call.x.dtype


def _library_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], out_dtype: torch.dtype) -> Tensor:
    """cuBLAS's linear (on CPU: eager's), in out_dtype. Widened, cuBLAS writes its fp32 accumulators
    (torch.mm's out_dtype); on CPU, where torch.mm has no out_dtype, the operands are widened first:
    products of bf16/fp16 values are exact in fp32, so the sums are the same kind."""
    if out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    if x.device.type != "cuda":
        return F.linear(x.to(out_dtype), weight.to(out_dtype), bias.to(out_dtype) if bias is not None else None)
    y = torch.mm(x, weight.t(), out_dtype=out_dtype)
    return y + bias.to(out_dtype) if bias is not None else y


def _precision(call: LinearCall) -> str:
    return matmul_precision(call.x.dtype, call.kernel_fp32_matmul)


def problem(call: LinearCall, traced: bool) -> Problem:
    """Bucket: the batch, rounded up to a power of two. Family: the other two GEMM sizes, which operand
    dimension is contiguous, dtype, bias, precision, gemm and copies options, CUDA graphs (they change
    what is offered: warp_specialized_offered), traced or not."""
    x, weight = call.x, call.weight
    m, k, n = _gemm_sizes(call)
    batch, others = (k, f"M={m} N={n}") if _reduces_over_batch(call) else (m, f"K={k} N={n}")
    gemm_choice = gemm_option(x, weight, call.kernel_gemm)
    family = (f"{OP_NAME} {others} layout={_layout(call)} dtype={str(x.dtype).removeprefix('torch.')} "
              f"out={str(_out_dtype(call)).removeprefix('torch.')} "
              f"bias={call.bias is not None} precision={_precision(call)} gemm={gemm_choice}"
              + ("" if call.kernel_operand_copies else " copies=False")
              + (" cuda_graphs" if call.kernel_cuda_graphs else "") + (" traced" if traced else ""))
    return Problem(family, (bucket(batch),))


def _layout(call: LinearCall) -> str:
    return "".join("k" if limits.k_major(t) else "m" for t in (call.x, call.weight))


def _reduces_over_batch(call: LinearCall) -> bool:
    """Of x (M, K) @ weight (N, K)^T the batch is M, except in a weight gradient, g^T @ x, whose two
    operands are transposed views (neither K-major) and whose reduction K runs over the batch."""
    return _layout(call) == "mm"


def _gemm_sizes(call: LinearCall, problem: Optional[Problem] = None) -> tuple[int, int, int]:
    """(M, K, N) at their hints; with `problem`, the batch at its bucket (what candidates are decided
    from, so that every call of a bucket is offered the same ones)."""
    m, k, n = (hint(s) for s in (call.x.shape[0], call.x.shape[1], call.weight.shape[0]))
    if problem is None:
        return m, k, n
    (batch,) = problem.sizes
    return (m, batch, n) if _reduces_over_batch(call) else (batch, k, n)


def candidates(call: LinearCall, problem: Problem, traced: bool) -> dict[str, LinearImplementation]:
    """Every way to run this linear that the tuner's search times (tuning.search), the default first: the
    Triton GEMM in the call's precision (in TF32 and 3xTF32 also with the smaller operand prepared in
    memory, gemm_precisions.py), where it can launch for these operands (limits.py), and cuBLAS at the
    same precision where it can run traced. Never empty untraced: cuBLAS always runs.

    Operands whose K is not contiguous (a backward's transposed views) start with the prepared variant,
    which reads that operand K-major from memory: pre-split 3xTF32 made 88-102 TFLOP/s on an H100 where
    3xTF32 split in registers made 39 (tools/tune_linear.py at 1024 x 8192 -> 8192 and 16384 x 4096 ->
    4096). The full search also times the precision itself, and the GEMM on K-major copies of the
    operands. With operand copies forbidden (kernel_operand_copies=False), neither: the precision itself
    (on strided loads), and cuBLAS. In TF32 and 3xTF32, also the warp-specialized Gluon kernel
    (warp_specialized_gemm.py) preparing either operand, on an sm_90 GPU (where warp_specialized_offered):
    in the kernel, which copies nothing and so is offered with copies forbidden too (also with K split across
    programs where the bucket's tiles leave SMs idle, warp_specialized_gemm.k_splits), and in memory (where
    launches_hidden)."""
    x, weight = call.x, call.weight
    m, k, n = _gemm_sizes(call, problem)
    precision = _precision(call)
    gemm_choice = gemm_option(x, weight, call.kernel_gemm)
    search = tuning.search()
    found: list[LinearImplementation] = []
    if gemm_choice in ("auto", "triton") and precision != "ieee":
        k_major = limits.k_major(x) and limits.k_major(weight)
        copies = call.kernel_operand_copies
        precisions = [precision]
        variant = prepared_variant(precision, m * k, n * k, weight_k_major=limits.k_major(weight))
        if variant and copies:
            precisions = [precision, variant] if k_major else [variant] + ([precision] if search == "full" else [])
        found += [LinearImplementation(p, config) for p, config in
                  triton_configs(precisions, x.dtype, m, n, x.device, tma=not traced)]
        flop = 2 * m * k * n
        if warp_specialized_offered(call, flop, precision):
            hidden = launches_hidden(call, flop)
            found += [LinearImplementation(p, config) for p, config in warp_specialized_gemm.candidates(
                precision, copies and hidden, (m, n, k, x.device))]
        if not k_major and search == "full" and copies:
            found.append(LinearImplementation(precision, gemm_configs.candidates(precision, x.dtype)[0], True))
        found = [impl for impl in found if impl.unlaunchable(call) is None]
    if gemm_choice in ("auto", "cublas") or not found:
        if not traced or cublas_traceable(precision):
            found.append(LinearImplementation(precision))
    return {impl.name: impl for impl in found}


def warp_specialized_offered(call: LinearCall, flop: int, precision: str) -> bool:
    """Whether the warp-specialized GEMM, which launches from Python (an opaque op; choice.UNGRAPHED_MIN_FLOP
    says what that costs), is offered: where its launches hide (launches_hidden), and in 3xTF32, whose GEMMs
    take three TF32 products' time, from warp_specialized_gemm.UNHIDDEN_MIN_FLOP. TF32 only where they hide
    (the chain's forward keeps the same rule). H200, TF32 training steps in default mode with it offered to
    every GEMM of the backward: 16384 x 4096 -> 4096 4.239 ms (Inductor 4.776); 1024 x 8192 -> 8192 1.696
    (p20-p80 1.46-1.84; Inductor 1.107), host-bound (gated: 1.430, 1.35-1.63, Inductor 1.141); with CUDA graphs
    1.058 (Inductor 1.153)."""
    return launches_hidden(call, flop) or (precision == "tf32x3" and flop >= warp_specialized_gemm.UNHIDDEN_MIN_FLOP)


def launches_hidden(call: LinearCall, flop: int) -> bool:
    """Whether the warp-specialized op's launches from Python hide behind the GPU's time: under CUDA graphs, or
    for a GEMM of at least UNGRAPHED_MIN_FLOP. Where they do not, TF32 is not offered the kernel
    (warp_specialized_offered), nor is any precision offered it preparing an operand in memory (a split kernel
    launched before it, and the copies). One call of the op took 180-330 us of host prepared in memory against
    100-180 in the kernel (H200 machines, 256 x 512 -> 384), and a default-mode step's backward makes several:
    with the backward's GEMMs offered it in memory at every size, fp32 training steps were host-bound (H200, one
    process each, against in the kernel only: the MLP(1024, [4096, 4096, 256]) 5.401 against 5.216 ms, host
    4.69 against 3.53 ms a step; 1024 x 8192 -> 8192 2.635 against 2.698, host 2.34 against 1.38, own peak 368
    against 352 MB; 16384 x 4096 -> 4096, 5.5e11 FLOP a GEMM, 9.887 against 10.087)."""
    return call.kernel_cuda_graphs or flop >= UNGRAPHED_MIN_FLOP


def _stand_ins(call: LinearCall) -> LinearCall:
    """Real tensors with the fake ones' shapes and strides (size hints where symbolic) and dtypes."""
    def real(t):
        if t is None:
            return None
        shape, stride = tuple(hint(s) for s in t.shape), tuple(hint(s) for s in t.stride())
        return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).normal_()
    return call._replace(x=real(call.x), weight=real(call.weight), bias=real(call.bias))


def _unfused(call: LinearCall) -> Tensor:
    """cuBLAS at the call's precision (on CPU: F.linear)."""
    return LinearImplementation(_precision(call))(call)


def _fake(call: LinearCall) -> Tensor:
    return call.x.new_empty((call.x.shape[0], call.weight.shape[0]), dtype=_out_dtype(call))


def _k_major_copy(t: Tensor) -> Tensor:
    return t if limits.k_major(t) else t.contiguous()


LINEAR = TunedOp(Declaration(
    name=OP_NAME,
    signature=linear,
    bind=lambda args, kwargs: LinearCall(*args, **kwargs),
    flatten=tuple,
    device=lambda call: call.x.device,
    validate=_validate,
    problem=problem,
    candidates=candidates,
    stand_ins=_stand_ins,
    unfused=_unfused,
    fake=_fake,
))


def call(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel: KernelOptions,
         out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return torch.ops.fusepass.linear(x, weight, bias, kernel.fp32_matmul, kernel.gemm, out_dtype,
                                     kernel.operand_copies, kernel.cuda_graphs)


# --------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs: tuple, output: Tensor) -> None:
    args = LinearCall(*inputs)
    x, weight, bias = args.x, args.weight, args.bias
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
    ctx.kernel = args.kernel
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.compute_dtype = x.dtype


def _backward(ctx, grad: Tensor) -> tuple:
    x, weight = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_bias = grad.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if need_bias else None
    grad = stored(grad.to(ctx.compute_dtype))  # a widened output's gradient, in the operands' dtype
    # dW first: x, which nothing else here reads, may then be freed before dX is made
    grad_weight = call(grad.t(), x.t(), None, ctx.kernel) if need_weight else None
    grad_x = call(grad, weight.t(), None, ctx.kernel) if need_x else None
    return grad_x, grad_weight, grad_bias, *(None,) * (len(LinearCall._fields) - 3)


LINEAR.traced.register_autograd(_backward, setup_context=_setup_context)
