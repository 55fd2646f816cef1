"""KernelBench-format problem files: a `Model` class, `get_inputs()`, `get_init_inputs()`."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Optional


def load_problem(path: str | Path) -> ModuleType:
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"fusepass_problem_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def problem_sizes(problem: ModuleType, size: Optional[tuple[int, int, int]] = None) -> tuple[list[Any], int]:
    """(init inputs, batch) of a Linear-headed problem, optionally resized to size=(batch, in, out).

    The first two init inputs are in/out features; a shape (out,) among the rest follows the out size
    (a per-feature scale), other values are kept."""
    init, batch = list(problem.get_init_inputs()), problem.get_inputs()[0].shape[0]
    if size is None:
        return init, batch
    batch, in_features, out_features = size
    rest = [(out_features,) if value == (init[1],) else value for value in init[2:]]
    return [in_features, out_features, *rest], batch
