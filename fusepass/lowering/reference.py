"""The fused op's math in plain PyTorch: its CPU implementation, and what its kernels compute.

    y   = linear(x, W, b)                              # in x's dtype, like eager (W cast to it under autocast)
    z   = y * s1
    u   = (z - mean) * invstd * gamma + beta           # batch statistics (training) or running ones (eval)
    t   = tail(u)                                      # the pointwise ops after batch norm (pointwise.py)
    out = softmax(t, dim=-1)  or  t                    # max-subtracted, fp32

In training the running statistics get the momentum update with the unbiased variance. Everything after
the linear runs in fp32. A synced batch norm (SyncBatchNorm) takes mean and variance over every rank's
batch (sync.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusepass.lowering import pointwise, sync
from fusepass.lowering.schema import BatchNorm, ChainArgs, ChainOutputs


def reference(args: ChainArgs) -> ChainOutputs:
    args.validate()
    run = args.in_compute_dtype()
    lin, bn = run.linear, args.batch_norm
    y = F.linear(lin.x, lin.weight, lin.bias)
    z = y.float() * args.scale_before.factor()
    n = z.shape[0]
    if bn.synced:
        n, mean, var = sync.merge_across_ranks(*sync.moments(z), bn.group_name)
    elif bn.training:
        var, mean = torch.var_mean(z, dim=0, correction=0)
    else:
        # Copies: an op's outputs must not alias its inputs.
        mean, var = bn.running_mean.to(torch.float32, copy=True), bn.running_var.to(torch.float32, copy=True)
    invstd = 1.0 / torch.sqrt(var + bn.eps)
    out = pointwise.run(args.tail.program, affine((z - mean) * invstd, bn), args.tail.tensors)[-1]
    if args.softmax:
        out = torch.softmax(out, dim=-1)
    new_mean, new_var = updated_running_stats(bn, n, mean, var)
    linear_out = y if args.save_linear_out else y.new_empty(0)
    return ChainOutputs(out.to(args.out_dtype), new_mean, new_var, linear_out, mean, invstd,
                        args.compute_weight_output(run))


def affine(x_hat: Tensor, bn: BatchNorm) -> Tensor:
    """x_hat * gamma + beta, each where present, per channel (dim 1 of an (N, C, *) x_hat), in x_hat's
    dtype."""
    if bn.weight is not None:
        x_hat = x_hat * per_channel(bn.weight.to(x_hat.dtype), x_hat)
    if bn.bias is not None:
        x_hat = x_hat + per_channel(bn.bias.to(x_hat.dtype), x_hat)
    return x_hat


def per_channel(v: Tensor, like: Tensor) -> Tensor:
    """A (C,) vector shaped to broadcast over dim 1 of an (N, C, *) tensor."""
    return v.view(1, -1, *([1] * (like.dim() - 2)))


def running_stats_dtype(bn: BatchNorm) -> torch.dtype:
    return bn.running_mean.dtype if bn.running_mean is not None else torch.float32


def new_running_stat_shape(bn: BatchNorm, running: Optional[Tensor]) -> tuple[int, ...]:
    return tuple(running.shape) if bn.training and running is not None else (0,)


def updated_running_stats(bn: BatchNorm, n, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
    """The momentum update with the variance unbiased by n, the batch's rows (over all ranks when synced:
    then a tensor). A batch of no rows leaves them as they are, as eager's batch norm does (its mean and
    variance are NaN)."""
    if not bn.updates_running_stats:
        dtype = running_stats_dtype(bn)
        return mean.new_empty(0, dtype=dtype), mean.new_empty(0, dtype=dtype)
    if not isinstance(n, Tensor) and statically_known_true(n == 0):
        return bn.running_mean.clone(), bn.running_var.clone()
    unbiased_var = var * (n / (n - 1))
    dtype = torch.promote_types(mean.dtype, bn.running_mean.dtype)
    new_mean = bn.momentum * mean + (1.0 - bn.momentum) * bn.running_mean.to(dtype)
    new_var = bn.momentum * unbiased_var + (1.0 - bn.momentum) * bn.running_var.to(dtype)
    return new_mean.to(bn.running_mean.dtype), new_var.to(bn.running_var.dtype)
