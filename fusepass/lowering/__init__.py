"""The fused operator. Importing this package registers it under torch.ops.fusepass.

One file per job: `schema.py` the op's arguments and outputs (written once), `reference.py` its math in
PyTorch (CPU path and test oracle), `gemm.py` the Triton GEMM with its epilogues, `passes.py` the Triton
passes after a GEMM, `tiles.py` the helpers their kernels share, `implementations.py` the CUDA
implementations (which GEMM, then which passes), `choice.py` the choice among them and `tuning.py` its
timing and disk cache, `op.py` the op's registration (traced and opaque, fake, autograd), `backward.py`
the backward formula, `launch.py` how kernels launch when the op runs and when it is traced.
"""

from fusepass.lowering import op

__all__ = ["op"]
