"""fusepass's two ops, the fused chain and the linear, with their kernels; importing this package
registers them under torch.ops.fusepass. docs/design.md, "Layout", says what each file does."""

from fusepass.lowering import linear, op, tuning

__all__ = ["forget_choices", "linear", "op"]


def forget_choices() -> None:
    """Drops the choices this process remembers, the tuner's and both ops' (the disk cache stays): as a
    new process would start."""
    for remembers in (tuning.TUNER, op.CHAIN, linear.LINEAR):
        remembers.forget()
