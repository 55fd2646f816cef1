"""The fused op's CUDA implementations. Each returns the op's outputs; they differ in the GEMM.

- `on_triton_gemm`: fusepass's Triton GEMM (gemm.py) with the statistics (training) or the whole
  eval-mode normalization in its epilogue, then the passes after it (normalize.py) where still needed.
- `on_warp_specialized_gemm`: the warp-specialized Gluon TF32 / 3xTF32 GEMM (warp_specialized_gemm.py) with
  the bias and, in training, the statistics in its epilogue, then the passes after it.
- `on_cublas`: cuBLAS's GEMM (F.linear, as eager), then every pass after it.

Each takes arguments the op has validated (ChainArgs.validate, at the op's entry points). `Implementation`
is one of them bound to a precision (and a tile config), with what its kernels need of a call
(`unlaunchable`, limits.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fusepass.lowering import blocks, gemm, gemm_configs, limits, warp_specialized_gemm
from fusepass.lowering.launch import ceil_div, tracing
from fusepass.lowering.normalize import (Partials, Statistics, normalize_linear_output, normalize_training,
                                         output_pass)
from fusepass.lowering.schema import ChainArgs, ChainOutputs, flatten


@dataclass(frozen=True)
class Implementation:
    """The Triton GEMM in `precision` with tile `config`, or cuBLAS (config None), and the passes."""
    precision: str
    config: Optional[gemm_configs.GemmConfig] = None

    @property
    def name(self) -> str:
        return f"triton {self.precision} {self.config.describe()}" if self.config else "cublas"

    @property
    def casts_weight_in_kernel(self) -> bool:
        """Whether its GEMM reads an fp32 weight under autocast as it is, casting each tile (gemm.CAST_W)."""
        return self.precision == "cast_w"

    def __call__(self, args: ChainArgs) -> ChainOutputs:
        run = args if self.casts_weight_in_kernel else args.in_compute_dtype()
        if self.config is None:
            outputs = on_cublas(run, self.precision)
        elif self.config.warp_specialized:
            outputs = on_warp_specialized_gemm(run, self.precision, self.config)
        else:
            outputs = on_triton_gemm(run, self.precision, self.config)
        return outputs._replace(compute_weight=args.compute_weight_output(run))

    def unlaunchable(self, args: ChainArgs) -> Optional[str]:
        """Why this call cannot run on these kernels (limits.py), or None."""
        x, n_features = args.linear.x, args.n_features
        weight = args.linear.weight if self.casts_weight_in_kernel else args.linear.compute_weight_like()
        return limits.first(
            limits.off_device(x.device, [a for a in flatten(args) if isinstance(a, Tensor)]),
            limits.some_rows(x.shape[0]),
            limits.column_grid(n_features),
            gemm_unlaunchable(x, weight, args.out_dtype, self.precision, self.config) if self.config else None,
        )


def gemm_unlaunchable(x: Tensor, weight: Tensor, out_dtype: torch.dtype, precision: str,
                      config: gemm_configs.GemmConfig) -> Optional[str]:
    """Why x @ weight^T cannot run in `precision` on config's GEMM kernel (the Triton GEMM, or the
    warp-specialized Gluon one splitting the precision's operand), or None."""
    if config.warp_specialized:
        return warp_specialized_gemm.unlaunchable(x, weight, out_dtype, precision, config)
    return gemm.unlaunchable(x, weight, precision, config)


def on_triton_gemm(args: ChainArgs, precision: str, config: gemm_configs.GemmConfig) -> ChainOutputs:
    """Training: GEMM and output pass (with a finalize launch between them when the row tiles are
    many). Eval: the GEMM alone, or GEMM and the softmax pass."""
    bn = args.batch_norm
    stats = Statistics.allocate(args.n_features, args.linear.x.device, bn)
    run = dict(precision=precision, config=config, scale_before=args.scale_before)
    if bn.training:
        g = gemm.run_gemm(args.linear, epilogue=gemm.EPILOGUE_STATISTICS.value, **run)
        out = _output_buffer(g.y, args)
        normalize_training(g.y, g.parts, stats, args, out)
    elif args.softmax:
        eval_norm = gemm.EvalNormalization(bn, stats.mean, stats.invstd)
        g = gemm.run_gemm(args.linear, epilogue=gemm.EPILOGUE_LINEAR.value, eval_norm=eval_norm, **run)
        out = output_pass(g.y, args, stats, _output_buffer(g.y, args))
    else:
        eval_norm = gemm.EvalNormalization(bn, stats.mean, stats.invstd, args.tail, args.out_dtype)
        g = gemm.run_gemm(args.linear, epilogue=gemm.EPILOGUE_NORMALIZE.value, store_y=args.save_linear_out,
                          eval_norm=eval_norm, **run)
        out = g.out
    return _outputs(args, out, stats, g.y)


def on_warp_specialized_gemm(args: ChainArgs, precision: str, config: gemm_configs.GemmConfig) -> ChainOutputs:
    """Training: the GEMM, its statistics' partials from its epilogue, and the output pass. Eval: the GEMM,
    then the passes after it (as on cuBLAS: its epilogue has no eval-mode normalization). The prepared
    operand is split or rounded in the kernel, or in memory in the linear op's blocks (blocks.py), in
    whole tiles of it: the statistics' parts of a prepared x cover a tile's rows. Prepared whole, the
    split of the fp32 MLP's hidden W (128 MB) set its training step's peak: 322 MB, 285 in blocks (H200)."""
    lin, scale = args.linear, args.scale_before
    training = args.batch_norm.training
    y, flat_parts = torch.ops.fusepass.warp_specialized_linear(
        lin.x, lin.weight, lin.bias, scale.tensor, scale.value, training, precision,
        prepared_rows_per_launch(lin, precision, config), config.block_n, config.block_k, config.num_stages)
    if not training:
        out, stats = normalize_linear_output(y, args, out=_output_buffer(y, args))
        return _outputs(args, out, stats, y)
    part_rows = warp_specialized_gemm.rows_per_part(precision, config.block_n)
    parts = Partials(flat_parts, ceil_div(lin.x.shape[0], part_rows), part_rows)
    stats = Statistics.allocate(args.n_features, lin.x.device, args.batch_norm)
    out = _output_buffer(y, args)
    normalize_training(y, parts, stats, args, out)
    return _outputs(args, out, stats, y)


def prepared_rows_per_launch(linear: gemm.Linear, precision: str, config: gemm_configs.GemmConfig) -> int:
    """The chain's block_rows for the warp-specialized op: 0 (prepared in the kernel), or the linear op's
    blocks rounded up to whole tiles of the prepared operand (config.block_n of its rows)."""
    tile = config.block_n
    return ceil_div(blocks.warp_specialized_block_rows(linear, precision, config), tile) * tile


def on_cublas(args: ChainArgs, precision: str) -> ChainOutputs:
    lin = args.linear
    with cublas_precision(precision):
        y = F.linear(lin.x, lin.weight, lin.bias)
    out, stats = normalize_linear_output(y, args, out=_output_buffer(y, args))
    return _outputs(args, out, stats, y)


def _outputs(args: ChainArgs, out: Tensor, stats: Statistics, y: Tensor) -> ChainOutputs:
    linear_out = y if args.save_linear_out else y.new_empty(0)
    return ChainOutputs(out, stats.new_mean, stats.new_var, linear_out, stats.mean, stats.invstd,
                        compute_weight=y.new_empty(0))


def _output_buffer(y: Tensor, args: ChainArgs) -> Tensor:
    """Where the output goes: over y when y is not returned (saves an (N, F) buffer), else a new tensor.
    Not over y while traced: Inductor then copies y into a new buffer for the pass to write (seen in
    its generated code: one more launch and a copy of y, no memory saved)."""
    if not tracing() and not args.save_linear_out and y.dtype == args.out_dtype and y.is_contiguous():
        return y
    return torch.empty(y.shape, device=y.device, dtype=args.out_dtype)


@contextlib.contextmanager
def cublas_precision(precision: str):
    """cuBLAS follows torch's global TF32 flag; the op's fp32 precision was resolved already."""
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
