"""fusepass's two ops, the fused chain and the linear, with their kernels; importing this package
registers them under torch.ops.fusepass. docs/design.md, "Layout", says what each file does."""

from fusepass.lowering import op

__all__ = ["op"]
