"""Fused operators. Importing this package registers them under torch.ops.fusepass."""

from fusepass.lowering import linear_scale_batch_norm

__all__ = ["linear_scale_batch_norm"]
