"""fusepass: a torch.compile backend that fuses Linear -> scale -> BatchNorm1d chains.

Use it by name, without importing this package: ``torch.compile(model, backend="fusepass")``
(registered through the ``torch_dynamo_backends`` entry point). ``fusepass.explain(model, *inputs)``
reports what it would rewrite.
"""

from fusepass import lowering  # noqa: F401  (registers torch.ops.fusepass.*)
from fusepass.backend import FusepassFallbackWarning
from fusepass.explain import Report, explain

__all__ = ["explain", "Report", "FusepassFallbackWarning"]
