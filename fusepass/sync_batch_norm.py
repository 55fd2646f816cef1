"""nn.SyncBatchNorm under torch.compile: captured whole, as one call the chain family fuses.

Eager SyncBatchNorm graph-breaks in Dynamo (its autograd function indexes with a data-dependent mask and
calls ops without fake kernels). While Dynamo traces, and only then, fusepass's SyncBatchNorm.forward
takes SyncBatchNorm's own decisions (training, running statistics, momentum, world size) and, where
eager synchronizes, records one call of `sync_batch_norm`: F.batch_norm's arguments plus the process
group's name. The batch-norm step of the chain family matches it like F.batch_norm; a call outside a
chain runs `torch.ops.fusepass.sync_batch_norm` (one all-gather forward, one all-reduce backward,
lowering/sync.py). Run eagerly, the module is untouched: forward calls eager's own code.

Installed by fusepass.backend (on import: torch imports it to resolve the backend's name) and by
explain(); it acts only in compiles whose backend is fusepass's (other backends trace eager's code, with
its graph break, as without fusepass). Differences from eager, both deliberate: the op runs on any device
torch.distributed runs on (eager SyncBatchNorm raises ValueError for CPU input), and momentum=None (a
cumulative average read from the host) keeps eager's code, with its graph break.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fusepass.compile_context import compiling_with_fusepass
from fusepass.lowering import sync
from fusepass.lowering.reference import affine, per_channel, updated_running_stats
from fusepass.lowering.schema import BatchNorm

_EAGER_FORWARD = nn.SyncBatchNorm.forward


@torch._dynamo.allow_in_graph
def sync_batch_norm(input: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
                    weight: Optional[Tensor], bias: Optional[Tensor], training: bool, momentum: float, eps: float,
                    group_name: str) -> Tensor:
    """F.batch_norm over every rank of the group's batch (training), updating the running statistics in
    place as F.batch_norm does."""
    out, new_mean, new_var = torch.ops.fusepass.sync_batch_norm(input, running_mean, running_var, weight, bias,
                                                                 momentum, eps, group_name)[:3]
    if running_mean is not None:
        with torch.no_grad():
            torch._foreach_copy_([running_mean, running_var], [new_mean, new_var])
    return out


def _forward(self: nn.SyncBatchNorm, input: Tensor) -> Tensor:
    if not torch.compiler.is_compiling() or not compiling_with_fusepass() or (self.training and self.momentum is None):
        return _EAGER_FORWARD(self, input)
    self._check_input_dim(input)
    self._check_non_zero_input_channels(input)
    if self.training and self.track_running_stats:
        self.num_batches_tracked.add_(1)
    bn_training = self.training or (self.running_mean is None and self.running_var is None)
    tracked = not self.training or self.track_running_stats
    running_mean, running_var = (self.running_mean, self.running_var) if tracked else (None, None)
    momentum = 0.0 if self.momentum is None else self.momentum
    group = self.process_group or dist.group.WORLD
    if bn_training and self.training and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size(group) > 1:
        return sync_batch_norm(input, running_mean, running_var, self.weight, self.bias, True, momentum,
                               self.eps, group.group_name)
    return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training, momentum, self.eps)


def install() -> None:
    nn.SyncBatchNorm.forward = _forward


# --------------------------------------------------------------------------- the op of a lone SyncBatchNorm


@torch.library.custom_op("fusepass::sync_batch_norm", mutates_args=())
def _op(input: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor], weight: Optional[Tensor],
        bias: Optional[Tensor], momentum: float, eps: float, group_name: str
        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, new running mean, new running var, mean, invstd); the statistics over all ranks' batches, in
    the input's accumulation dtype (fp32, or float64 for a float64 input)."""
    bn = BatchNorm(weight, bias, running_mean, running_var, True, momentum, eps, group_name)
    rows = _channels_last_rows(input)
    count, mean, var = sync.merge_across_ranks(*sync.moments(rows), group_name)
    invstd = 1.0 / torch.sqrt(var + eps)
    out = affine((input.to(mean.dtype) - per_channel(mean, input)) * per_channel(invstd, input), bn)
    new_mean, new_var = updated_running_stats(bn, count, mean, var)
    return out.to(input.dtype), new_mean, new_var, mean, invstd


@_op.register_fake
def _(input, running_mean, running_var, weight, bias, momentum, eps, group_name):
    channels = input.shape[1]
    stats_dtype = running_mean.dtype if running_mean is not None else torch.float32
    running = (channels,) if running_mean is not None else (0,)
    acc = sync.accumulation_dtype(input.dtype)
    return (torch.empty_like(input), input.new_empty(running, dtype=stats_dtype),
            input.new_empty(running, dtype=stats_dtype), input.new_empty(channels, dtype=acc),
            input.new_empty(channels, dtype=acc))


def _setup_context(ctx, inputs, output) -> None:
    input, _, _, weight, _, _, _, group_name = inputs
    _, _, _, mean, invstd = output
    ctx.save_for_backward(input, weight, mean, invstd)
    ctx.group_name = group_name
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, grad_out, *_):
    input, weight, mean, invstd = ctx.saved_tensors
    g = grad_out.to(mean.dtype)
    x_hat = (input.to(mean.dtype) - per_channel(mean, input)) * per_channel(invstd, input)
    g_hat = g * per_channel(weight.to(mean.dtype), input) if weight is not None else g
    dims = [d for d in range(input.dim()) if d != 1]
    rows = input.numel() // input.shape[1]
    sum_g, sum_g_xhat, count = sync.all_reduce_sums(g_hat.sum(dims), (g_hat * x_hat).sum(dims), rows, ctx.group_name)
    grad_input = (g_hat - per_channel(sum_g / count, input) - x_hat * per_channel(sum_g_xhat / count, input))
    grad_input = (grad_input * per_channel(invstd, input)).to(input.dtype)
    grad_weight = (g * x_hat).sum(dims).to(weight.dtype) if weight is not None else None
    grad_bias = g.sum(dims).to(weight.dtype) if weight is not None else None
    return grad_input, None, None, grad_weight, grad_bias, None, None, None


_op.register_autograd(_backward, setup_context=_setup_context)


def _channels_last_rows(input: Tensor) -> Tensor:
    """(N * spatial, C): every value of a channel in its column."""
    return input.transpose(0, 1).reshape(input.shape[1], -1).t()
