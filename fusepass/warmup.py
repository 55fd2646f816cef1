"""`fusepass.warmup`: fills the tuning cache ahead of time, for a model and a list of batch sizes.

A server answers requests of many sizes. Each size falls in a bucket (tuning.py), and a bucket met for
the first time borrows its nearest neighbour's choice rather than stalling a request to time
candidates. warmup() compiles the model with fusepass once per batch size, timing every bucket it meets,
and the choices land in the disk cache (`$FUSEPASS_CACHE_DIR`): the serving process then times nothing.

    fusepass.warmup(model.eval(), example, batch_sizes=[1, 8, 64, 256, 1024])   # at deployment

The model is left as it was (parameters, buffers, gradients, random state). Its compiled code is not:
warmup() ends with torch._dynamo.reset(), which drops every compiled graph of the process. Run it
before compiling anything else, or in a process of its own (`fusepass-bench PROBLEM.py --tune-only`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch._dynamo.utils import counters

from fusepass.lowering.tuning import tune_every_bucket
from fusepass.model_state import state_restored


def warmup(model: torch.nn.Module, example_inputs: Sequence[Any], batch_sizes: Sequence[int], *,
           train: Optional[bool] = None, options: Optional[dict] = None, mode: Optional[str] = None) -> dict:
    """Compiles `model` with fusepass (`options`, `mode` as for torch.compile) at each batch size, the
    example inputs' first dimension resized to it (rows taken cyclically), and times every size bucket its
    fused ops meet. `train` (default: model.training): forward and backward, which has its own GEMMs to
    tune; else a forward under no_grad. Returns what was done: {"batch_sizes", "tunings", "graphs"}."""
    train = model.training if train is None else train
    before = {key: counters["fusepass"][key] for key in ("tunings", "graphs")}
    with state_restored(model), tune_every_bucket(), torch._dynamo.config.patch(
            cache_size_limit=len(batch_sizes) + 8, automatic_dynamic_shapes=False):
        compiled = torch.compile(model, backend="fusepass", options=options, mode=mode, dynamic=False)
        for batch in batch_sizes:
            inputs = [with_batch(value, batch) for value in example_inputs]
            if train:
                _backward(compiled(*inputs))
            else:
                with torch.no_grad():
                    compiled(*inputs)
    torch._dynamo.reset()
    return {"batch_sizes": list(batch_sizes),
            **{key: counters["fusepass"][key] - before[key] for key in ("tunings", "graphs")}}


def with_batch(value: Any, batch: int) -> Any:
    """A tensor with `batch` rows, taken cyclically from its own; anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    rows = torch.arange(batch, device=value.device) % value.shape[0]
    return value[rows].clone()


def _backward(output: Any) -> None:
    tensors = [t for t in (output if isinstance(output, (tuple, list)) else [output])
               if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        torch.autograd.backward([t.float().sum() for t in tensors])
