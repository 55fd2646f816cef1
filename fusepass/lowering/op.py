"""The fused operator's registration: `torch.ops.fusepass.linear_scale_batch_norm`, its opaque twin with
the fake, and the autograd formula. Both ops take ChainArgs flattened (schema.py) and return the six
ChainOutputs; new_running_* are empty unless training with running statistics, linear_out is empty
unless save_linear_out. In training the rewritten graph copies the new running statistics into the
module's buffers: an op that mutates its inputs cannot carry an autograd formula.

The op is a triton_op: on CUDA with static shapes torch.compile traces its body, the implementation is
chosen then (timed on stand-in inputs, choice.py) and Inductor launches its kernels from the compiled
graph. Where that cannot be done (not CUDA, symbolic shapes, no traceable implementation) the body calls
the opaque op, which chooses and launches when it runs, and on CPU runs the reference.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from fusepass.lowering import backward, limits
from fusepass.lowering.choice import OP_NAME, choose_implementation, static_shapes
from fusepass.lowering.implementations import Implementation
from fusepass.lowering.launch import OPAQUE_ENV
from fusepass.lowering.reference import new_running_stat_shape, reference, running_stats_dtype
from fusepass.lowering.schema import ChainArgs, ChainOutputs, bind, flatten, with_op_signature



@with_op_signature
def _traced_body(*op_args, **op_kwargs) -> tuple:
    args = bind(op_args, op_kwargs)
    run = None
    if args.linear.x.device.type == "cuda" and not os.environ.get(OPAQUE_ENV):
        args.validate()
        traced = is_fake(args.linear.x)
        if not traced or static_shapes(args):
            run = choose_implementation(args, traced=traced)
    if run is None:
        return torch.ops.fusepass.linear_scale_batch_norm_opaque(*flatten(args))
    return tuple(_launch_checked(args, run))


def _launch_checked(args: ChainArgs, run: Optional[Implementation]) -> ChainOutputs:
    """`run` on args where its kernels can launch for them (checked on every call: a choice made for one
    call serves others of its shape), else the unfused math for this call (limits.py)."""
    why = run.unlaunchable(args) if run is not None else "no implementation launches for it"
    if why is None:
        return run(args)
    limits.record_unlaunchable(OP_NAME, why)
    return reference(args)


linear_scale_batch_norm = torch.library.triton_op(OP_NAME, _traced_body, mutates_args=())


@with_op_signature
def _opaque_default(*op_args, **op_kwargs) -> tuple:
    """CPU (and other devices): the plain-PyTorch reference."""
    return tuple(reference(bind(op_args, op_kwargs)))


_opaque = torch.library.custom_op(OP_NAME + "_opaque", _opaque_default, mutates_args=())


@_opaque.register_kernel("cuda")
@with_op_signature
def _opaque_cuda(*op_args, **op_kwargs) -> tuple:
    """On CUDA, the implementation chosen for the real arguments when it runs."""
    args = bind(op_args, op_kwargs)
    args.validate()
    return tuple(_launch_checked(args, choose_implementation(args)))


@_opaque.register_fake
@with_op_signature
def _fake(*op_args, **op_kwargs) -> tuple:
    args = bind(op_args, op_kwargs)
    args.validate()
    x, bn = args.linear.x, args.batch_norm
    n, f = x.shape[0], args.n_features
    stats_dtype = running_stats_dtype(bn)
    return tuple(ChainOutputs(
        out=x.new_empty((n, f), dtype=args.out_dtype),
        new_running_mean=x.new_empty(new_running_stat_shape(bn, bn.running_mean), dtype=stats_dtype),
        new_running_var=x.new_empty(new_running_stat_shape(bn, bn.running_var), dtype=stats_dtype),
        linear_out=x.new_empty((n, f) if args.save_linear_out else (0,)),
        mean=x.new_empty((f,), dtype=torch.float32),
        invstd=x.new_empty((f,), dtype=torch.float32),
    ))


linear_scale_batch_norm.register_autograd(backward.backward, setup_context=backward.setup_context)


def call(args: ChainArgs) -> ChainOutputs:
    """The op on ChainArgs, with its outputs by name."""
    return ChainOutputs(*torch.ops.fusepass.linear_scale_batch_norm(*flatten(args)))
