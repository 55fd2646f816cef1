"""The fused op's backward: gradients of every differentiable argument. The batch-norm, tail and softmax
terms are plain PyTorch, the tail's derivatives eager's own (pointwise.py); Inductor compiles them with
the rest of the backward graph into its own fused reductions and pointwise kernels. The two GEMMs, dX
and dW, are calls of `fusepass::linear` (linear.py), so in fp32 they run on the same 3xTF32 tensor-core
GEMM as the forward, or on cuBLAS at eager's precision where that is faster.

More exact than eager where eager cancels: in training the linear bias's gradient is exactly 0 (batch
norm removes any shift), and the pre-BN scale's gradient has a closed form instead of a sum that cancels
to rounding noise.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusepass.lowering import linear, pointwise, sync
from fusepass.lowering.launch import stored
from fusepass.lowering.reference import affine
from fusepass.lowering.schema import (FLOAT16_DTYPES, BatchNorm, ChainArgs, ChainOutputs, Scale, gradients_in_op_order,
                                      unflatten)

aten = torch.ops.aten


def setup_context(ctx, inputs: tuple, output: tuple) -> None:
    """Saves, per step of the chain: the head's x and W (dW needs x, dX needs W: under autocast the op's
    cast of W, which the fp32 W is not saved beside, or where no dX is made the fp32 W itself, a
    parameter); the linear output y, once, with the per-feature
    mean and invstd: the normalized value, the batch norm's output and the tail's values are rebuilt from
    them in the backward's own pass, never saved; the scale, gamma, beta and the tail's tensor operands;
    and the chain's output where the backward reads it: with softmax, the probabilities, whose rebuild
    would cost a second exp pass; with a tail of one 16-bit relu, its sign (eager's ReLU reads its output;
    a 16-bit value can round to 0 where its fp32 source is positive, and recompute.py rebuilds it rather
    than saving it). An fp32 relu's mask is rebuilt from y and the statistics with the forward kernel's
    arithmetic: the output, otherwise held until this backward, is then free once the next layer's weight
    gradient has read it."""
    args = unflatten(inputs)
    outputs = ChainOutputs(*output)
    ctx.mark_non_differentiable(outputs.new_running_mean, outputs.new_running_var, outputs.linear_out,
                                outputs.mean, outputs.invstd, outputs.compute_weight)
    lin, bn = args.linear, args.batch_norm
    weight = outputs.compute_weight if args.returns_compute_weight else lin.weight
    relu_from_output = (pointwise.is_single_relu(args.tail.program) and not args.softmax
                        and outputs.out.dtype in FLOAT16_DTYPES)
    out = outputs.out if args.softmax or relu_from_output else None
    ctx.save_for_backward(lin.x, weight, args.scale_before.tensor, bn.weight, bn.bias, *args.tail.tensors,
                          outputs.linear_out, outputs.mean, outputs.invstd, out)
    ctx.training, ctx.eps, ctx.save_linear_out, ctx.softmax = bn.training, bn.eps, args.save_linear_out, args.softmax
    ctx.group_name = bn.group_name if bn.synced else ""
    ctx.scale_before_value, ctx.tail_program = args.scale_before.value, args.tail.program
    ctx.bias_dtype = lin.bias.dtype if lin.bias is not None else None
    # An fp32 weight under autocast gets an fp32 gradient straight from the dW GEMM's accumulators.
    ctx.weight_grad_dtype = lin.weight.dtype if lin.casts_weight else None
    ctx.kernel = args.kernel
    ctx.relu_from_output = relu_from_output


def backward(ctx, grad_out: Tensor, *_grads_of_non_differentiable_outputs) -> tuple:
    (x, weight, scale_tensor, bn_weight, bn_bias, *tail_tensors, linear_out, mean, invstd, out) = ctx.saved_tensors
    if not ctx.save_linear_out:
        raise RuntimeError("fusepass.batch_norm_chain was called with save_linear_out=False; no backward")
    need: ChainArgs = unflatten(ctx.needs_input_grad)
    s1 = Scale(scale_tensor, ctx.scale_before_value)
    y = linear_out.float()
    x_hat = (y * s1.factor() - mean) * invstd
    g = grad_out.float()
    probs = None
    if ctx.softmax:  # through softmax: p * (g - sum(g * p))
        probs = out.float()
        g = probs * (g - (g * probs).sum(1, keepdim=True))
    grads = {}
    if ctx.relu_from_output:
        g = aten.threshold_backward(g, out.to(g.dtype), 0)
    elif ctx.tail_program:  # through the pointwise tail, recomputed from the batch norm's output
        bn_out = affine(x_hat, BatchNorm(bn_weight, bn_bias, None, None, ctx.training, 0.0, ctx.eps))
        if pointwise.is_single_relu(ctx.tail_program):
            g = _relu_backward(g, bn_out)
        else:
            values = pointwise.run(ctx.tail_program, bn_out, tail_tensors)
            g, tensor_grads = pointwise.backward(ctx.tail_program, values, g, tail_tensors, softmax_probs=probs)
            for slot, grad in tensor_grads.items():
                if getattr(need.tail, f"tensor_{slot}"):
                    grads[f"tail_tensor_{slot}"] = grad
    # g is now the gradient w.r.t. the batch_norm output

    # The backward's only two column sums, which are also gamma's and beta's gradients; those of
    # g_hat = g * gamma are them times gamma, a per-feature constant (as eager's batch-norm backward
    # takes them), not two more reductions.
    sum_g, sum_g_xhat = g.sum(0), (g * x_hat).sum(0)
    gamma = bn_weight.float() if bn_weight is not None else None
    batch_g, batch_g_xhat, count = sum_g, sum_g_xhat, g.shape[0]
    if ctx.group_name:  # SyncBatchNorm: the statistics are every rank's, so are the sums projected out
        batch_g, batch_g_xhat, count = sync.all_reduce_sums(sum_g, sum_g_xhat, count, ctx.group_name)
    # g centred by its own column mean, then scaled by gamma: grad_z's column sums, 0 in exact arithmetic,
    # stay at rounding level. Centring g * gamma by gamma * mean(g) leaves a larger rest, which a linear
    # before the chain gets in its bias's gradient (1.57x eager's rounding noise there on a CPU,
    # tests/test_bare_linear.py::test_linear_feeding_a_chain_and_fed_by_one_is_rewritten_once_each).
    if ctx.training or ctx.group_name:  # batch statistics depend on z: project out the mean and x_hat
        grad_z = (g - batch_g / count - x_hat * (batch_g_xhat / count)) * _times(gamma, invstd)
    else:
        grad_z = g * _times(gamma, invstd)
    grad_y = stored((grad_z * s1.factor()).to(linear_out.dtype))  # read by every block of dX and dW

    if need.linear.weight:  # first: x, read by nothing else here, may then be freed before dX is made
        if weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) != 1:
            # A matmul head's (in, out) W seen as (out, in): its gradient is made as x^T @ grad_y, in W's own
            # layout, and handed back as the view, so that no transposing copy of it follows.
            grads["linear_weight"] = linear.call(x.t(), grad_y.t(), None, ctx.kernel, ctx.weight_grad_dtype).t()
        else:
            grads["linear_weight"] = linear.call(grad_y.t(), x.t(), None, ctx.kernel, ctx.weight_grad_dtype)
    if need.linear.x:  # under autocast the saved cast of W; its fp32 W only where the op was told no dX
        grads["linear_x"] = linear.call(grad_y, weight.t().to(grad_y.dtype), None, ctx.kernel)
    if need.linear.bias:
        grads["linear_bias"] = _linear_bias_grad(ctx, grad_y, sum_g)
    if need.scale_before.tensor:
        grads["scale_before_tensor"] = _scale_grad(ctx, s1, grad_z, y, g, gamma, x_hat, invstd)
    if need.batch_norm.weight:
        grads["batch_norm_weight"] = sum_g_xhat.to(bn_weight.dtype)
    if need.batch_norm.bias:
        grads["batch_norm_bias"] = sum_g.to(bn_bias.dtype)
    return gradients_in_op_order(grads)


def _times(gamma: Optional[Tensor], t: Tensor) -> Tensor:
    """t scaled by the batch norm's weight, where it has one."""
    return gamma * t if gamma is not None else t


def _relu_backward(g: Tensor, bn_out: Tensor) -> Tensor:
    """threshold_backward(g, relu(bn_out), 0), its mask stored as one byte per element. Unstored, the
    masked gradient, which several kernels read, would be stored in fp32: Inductor stores such a value
    once it reads more than `realize_reads_threshold` (4) buffers, here y, mean, invstd, gamma, beta, g."""
    return g.masked_fill(stored(bn_out <= 0), 0)


def _linear_bias_grad(ctx, grad_y: Tensor, sum_g: Tensor) -> Tensor:
    # Synced, one rank's bias shifts the global mean by its share of the rows only: its gradient is the
    # rank's column sum (the ranks' sum is 0, which DDP's average gets)
    if ctx.training and not ctx.group_name:
        # Batch normalization subtracts the batch mean, so a bias shift has no effect at all: the
        # gradient is exactly zero (eager's column sum of grad_y returns only rounding noise). Made from
        # a column sum the backward takes anyway (x - x: +0 where finite, NaN where eager's would be),
        # the kernel that stores that sum stores it too; zeros of its own take a launch of their own.
        return (sum_g - sum_g).to(ctx.bias_dtype)
    return grad_y.float().sum(0).to(ctx.bias_dtype)


def _scale_grad(ctx, scale: Scale, grad_z: Tensor, y: Tensor, g: Tensor, gamma: Optional[Tensor], x_hat: Tensor,
                invstd: Tensor) -> Tensor:
    """The pre-BN scale's gradient; g is the gradient w.r.t. the batch norm's output, gamma its weight."""
    # Synced, the closed form below would need every rank's y: this rank's part of the gradient is the
    # direct sum, as eager's
    if not ctx.training or ctx.group_name:
        return pointwise.reduce_to((grad_z * y).sum(0), scale.tensor)
    if statically_known_true(y.shape[0] == 0):  # no rows, no gradient; their statistics are NaN
        return pointwise.reduce_to(torch.zeros_like(invstd), scale.tensor)
    s, g_hat = scale.factor(), _times(gamma, g)
    # Scaling a feature changes its normalized value only through eps, so the direct sum(grad_z * y)
    # cancels almost completely. Its exact value, sum(g_hat * x_hat) * eps * invstd^2 / s, does not
    # (derivation: sum(grad_z) = sum(x_hat) = 0 and mean(x_hat^2) = var * invstd^2). That sum is taken
    # here, not as gamma times the backward's shared sum(g * x_hat): the two are equal in exact arithmetic
    # and in their error over random cases (CPU), but a softmax chain's first training step on an H200
    # measured 1.15e-6 from float64 with the shared sum, past the criterion, against eager's 4.3e-7 and
    # 9.3e-7 with this sum (tests/test_backend.py, test_each_gemm_implementation_end_to_end, the code
    # before the sums were shared). The reduction that takes it exists only for a scale tensor's gradient.
    closed_form = (g_hat * x_hat).sum(0) * ctx.eps * invstd * invstd / s
    # At s == 0, x_hat is 0 and the gradient is invstd * sum((g_hat - mean(g_hat)) * y): the co-moment of
    # g_hat and y. It is taken from column sums of the same kind as the backward's, which the compiled
    # backward makes in the same reduction (the direct form needs a second pass over an (N, F) grad_z):
    # in float64, where products of fp32 values are exact, and shifted by the first row, so that a
    # constant g_hat gives exactly 0.
    g64, y64 = g_hat.double(), y.double()
    dg, dy = g64 - g64[:1], y64 - y64[:1]
    co_moment = ((dg * dy).sum(0) - dg.sum(0) * (dy.sum(0) / y.shape[0])).float()
    return pointwise.reduce_to(torch.where(s != 0, closed_form, invstd * co_moment), scale.tensor)
