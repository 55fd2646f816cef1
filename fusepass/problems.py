"""KernelBench-format problem files: a `Model` class, `get_inputs()`, `get_init_inputs()`.

The Linear-headed problems define their sizes as module-level `batch_size`, `in_features` and
`out_features` and derive the rest from them (`scale_shape = (out_features,)`), which `get_inputs()`
and `get_init_inputs()` read when called. `resize_problem` runs the file again with those three
assignments replaced, so every derived value follows the new sizes; matching values instead (a
tuple (4096,) is the out size) could not tell in_features from out_features when they are equal.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Optional

Size = tuple[int, int, int]  # (batch, in_features, out_features)
SIZE_NAMES = ("batch_size", "in_features", "out_features")
# --shrink never takes a size below this (or below the size itself, if smaller): training-mode batch
# norm needs a batch of 2 or more, and shapes of a few elements exercise none of the tiling.
MIN_SHRUNK = 8


class ProblemSizeError(ValueError):
    """The problem file's sizes cannot be read or changed."""


def load_problem(path: str | Path, size: Optional[Size] = None) -> ModuleType:
    """The problem file as a module, resized to `size` = (batch, in_features, out_features) if given."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"fusepass_problem_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if size is not None:
        resize_problem(module, size)
    return module


def problem_size(problem: ModuleType) -> Size:
    """(batch_size, in_features, out_features) as the problem module defines them now."""
    missing = [name for name in SIZE_NAMES if not _is_int(getattr(problem, name, None))]
    if missing:
        raise ProblemSizeError(f"defines no module-level int {', '.join(missing)}, so it cannot be resized")
    return tuple(getattr(problem, name) for name in SIZE_NAMES)


def resize_problem(problem: ModuleType, size: Size) -> None:
    """Runs the problem's file again, in the same module, with `batch_size`, `in_features` and
    `out_features` assigned `size`; values derived from them follow. A module-level int or tuple of
    ints that keeps one of the file's own sizes (a literal `scale_shape = (4096,)`) is an error: the
    model would be built with the old size."""
    size = check_size(size)
    old_size = problem_size(problem)
    path = Path(problem.__file__)
    tree = ast.parse(path.read_text(), filename=str(path))
    assigned = set()
    for node in tree.body:
        name = _assigned_name(node)
        if name in SIZE_NAMES and node.value is not None:
            node.value = ast.copy_location(ast.Constant(size[SIZE_NAMES.index(name)]), node.value)
            assigned.add(name)
    missing = [name for name in SIZE_NAMES if name not in assigned]
    if missing:
        raise ProblemSizeError(f"does not assign {', '.join(missing)} at module level, so it cannot be resized")
    before = {name: value for name, value in vars(problem).items() if _is_size_like(value)}
    exec(compile(tree, str(path), "exec"), vars(problem))
    _check_nothing_kept_old_size(problem, before, old_size, size)


def shrunk_size(size: Size, factor: int) -> Size:
    """Each of batch, in_features, out_features divided by `factor` (rounded down), but not below
    MIN_SHRUNK, and a size already smaller stays as it is."""
    if factor < 1:
        raise ProblemSizeError(f"a shrink factor must be at least 1, not {factor}")
    return tuple(max(n // factor, min(n, MIN_SHRUNK)) for n in size)


def sized_name(name: str, size: Size) -> str:
    """A problem's name with the size it ran at, e.g. gemm_scale_batchnorm@1024x8192x8192."""
    return f"{name}@{'x'.join(str(n) for n in size)}"


def check_size(size) -> Size:
    size = tuple(size)
    if len(size) != 3 or not all(_is_int(n) and n >= 1 for n in size):
        raise ProblemSizeError(f"a size is three positive ints (batch, in_features, out_features), not {size}")
    return size


def _check_nothing_kept_old_size(problem: ModuleType, before: dict, old_size: Size, size: Size) -> None:
    """A value the new run left unchanged and that holds an old size the new sizes do not have was
    written as a literal, not derived from the size names."""
    stale = set(old_size) - set(size) - {0, 1}
    for name, value in before.items():
        if name in SIZE_NAMES or name.startswith("_") or vars(problem).get(name) != value:
            continue
        kept = stale.intersection(value if isinstance(value, tuple) else (value,))
        if kept:
            raise ProblemSizeError(
                f"{name} = {value!r} keeps the size {min(kept)} after resizing: write it in terms of "
                f"{', '.join(SIZE_NAMES)} so that it follows them")


def _assigned_name(node: ast.stmt) -> Optional[str]:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_size_like(value) -> bool:
    return _is_int(value) or (isinstance(value, tuple) and all(_is_int(v) for v in value))
