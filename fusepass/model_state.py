"""Running a model without changing it: what explain() and warmup() need."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def state_restored(model: torch.nn.Module) -> Iterator[None]:
    """Puts back the values of the model's parameters and buffers, their gradients, and the random-number
    generators' states, as they were on entry. A tensor whose `.data` was replaced gets its own storage
    back; a buffer replaced by another tensor (`self.center = ...`) gets its own tensor back."""
    owners = dict(model.named_modules())
    saved = [(owners[name.rpartition(".")[0]], name.rpartition(".")[2], tensor, tensor.data, tensor.detach().clone(),
              tensor.grad)
             for name, tensor in (*model.named_parameters(remove_duplicate=False),
                                  *model.named_buffers(remove_duplicate=False))]
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        try:
            yield
        finally:
            with torch.no_grad():
                for module, attribute, tensor, data, value, grad in saved:
                    if getattr(module, attribute) is not tensor:
                        setattr(module, attribute, tensor)
                    tensor.data = data
                    data.copy_(value)
                    tensor.grad = grad


def _cuda_devices(model: torch.nn.Module) -> list[int]:
    return sorted({t.device.index or 0 for t in (*model.parameters(), *model.buffers()) if t.is_cuda})
