"""The fused operator: `torch.ops.fusepass.batch_norm_chain`, declared as a tuned op (tuned_op.py),
with its fake and its autograd formula. It takes ChainArgs flattened (schema.py) and returns the seven
ChainOutputs; new_running_* are empty unless training with running statistics, linear_out is empty
unless save_linear_out, compute_weight unless the op cast an fp32 weight (autocast) for a call whose
backward reads it. In training the rewritten graph copies the new running statistics into the
module's buffers: an op that mutates its inputs cannot carry an autograd formula.

On CUDA torch.compile traces its body, for static and symbolic shapes: the implementation is chosen then
(choice.py; timed on stand-ins, per size bucket) and Inductor launches its kernels from the compiled
graph. Where no implementation can run traced the opaque twin chooses when it runs; on CPU it runs the
reference.
"""

from __future__ import annotations

import torch

from fusepass.lowering import backward, choice
from fusepass.lowering.reference import new_running_stat_shape, reference, running_stats_dtype
from fusepass.lowering.schema import ChainArgs, ChainOutputs, bind, flatten, with_op_signature
from fusepass.lowering.tuned_op import Declaration, TunedOp


@with_op_signature
def batch_norm_chain(*op_args, **op_kwargs) -> tuple:
    """The op's signature (schema.ChainArgs, flattened)."""


def fake(args: ChainArgs) -> ChainOutputs:
    x, bn = args.linear.x, args.batch_norm
    n, f = x.shape[0], args.n_features
    stats_dtype = running_stats_dtype(bn)
    return ChainOutputs(
        out=x.new_empty((n, f), dtype=args.out_dtype),
        new_running_mean=x.new_empty(new_running_stat_shape(bn, bn.running_mean), dtype=stats_dtype),
        new_running_var=x.new_empty(new_running_stat_shape(bn, bn.running_var), dtype=stats_dtype),
        linear_out=x.new_empty((n, f) if args.save_linear_out else (0,)),
        mean=x.new_empty((f,), dtype=torch.float32),
        invstd=x.new_empty((f,), dtype=torch.float32),
        compute_weight=(x.new_empty_strided(args.linear.weight.shape, args.linear.weight.stride())
                        if args.returns_compute_weight else x.new_empty((0,))),
    )


CHAIN = TunedOp(Declaration(
    name=choice.OP_NAME,
    signature=batch_norm_chain,
    bind=bind,
    flatten=flatten,
    device=lambda args: args.linear.x.device,
    validate=ChainArgs.validate,
    problem=choice.problem,
    candidates=choice.candidates,
    stand_ins=choice.stand_ins,
    unfused=reference,
    fake=fake,
    without_collectives=choice.without_collectives,
))
CHAIN.traced.register_autograd(backward.backward, setup_context=backward.setup_context)


def call(args: ChainArgs) -> ChainOutputs:
    """The op on ChainArgs, with its outputs by name."""
    return ChainOutputs(*torch.ops.fusepass.batch_norm_chain(*flatten(args)))
