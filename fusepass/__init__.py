"""fusepass: a torch.compile backend that fuses Linear -> scale -> BatchNorm1d chains.

Use it by name, without importing this package: ``torch.compile(model, backend="fusepass")``
(registered through the ``torch_dynamo_backends`` entry point). ``fusepass.explain(model, *inputs)``
reports what it would rewrite; ``fusepass.warmup(model, inputs, batch_sizes)`` fills the tuning cache
ahead of time.
"""

from fusepass import lowering  # noqa: F401  (registers torch.ops.fusepass.*)
from fusepass.options import FusepassFallbackWarning
from fusepass.explain import Report, explain
from fusepass.warmup import warmup

__all__ = ["explain", "warmup", "Report", "FusepassFallbackWarning"]
