"""The package's architecture, read from its source with `ast`: imports run downhill only. No cycle among
fusepass's modules, no import from a layer to one above it, and no function-local import of a fusepass
module (one would hide a cycle from Python's import-time check)."""

import ast
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

from fusepass.lowering.gemm import GemmMeta
from fusepass.lowering.normalize import OutputMeta

PACKAGE = Path(__file__).resolve().parent.parent / "fusepass"

# Bottom to top. A module may import its own layer's and lower layers' modules.
LAYERS = [
    ("the ops and their helpers", ["fusepass.lowering*", "fusepass.numerics", "fusepass.problems",
                                   "fusepass.model_state"]),
    ("what a fusepass compile hooks into torch", ["fusepass.compile_context", "fusepass.compile_workers",
                                                  "fusepass.sync_batch_norm"]),
    ("the generic matcher", ["fusepass.matcher"]),
    ("the families", ["fusepass.families*"]),
    ("options and applying matches", ["fusepass.options", "fusepass.rewrite"]),
    ("stages around the pipeline", ["fusepass.timing", "fusepass.ddp"]),
    ("reports and warm-up", ["fusepass.explain", "fusepass.warmup"]),
    ("the backend", ["fusepass.backend"]),
    ("benchmarks", ["fusepass.providers", "fusepass.measure", "fusepass.shape_changes", "fusepass.largest_batch",
                    "fusepass.bench"]),
    ("the package", ["fusepass"]),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def resolve(name: str) -> str:
    """A fusepass name as the module it lives in: itself if a module, else its parent."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(path: Path) -> list[tuple[str, bool]]:
    """(fusepass module imported, whether the import is inside a function) for each import in the file."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        local = node not in tree.body
        if isinstance(node, ast.Import):
            found += [(resolve(a.name), local) for a in node.names if a.name.split(".")[0] == "fusepass"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fusepass":
            found += [(resolve(f"{node.module}.{a.name}"), local) for a in node.names]
    return found


GRAPH = {name: {target for target, _ in imports(path) if target != name} for name, path in MODULES.items()}


def layer(name: str) -> int:
    [index] = [i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch(name, p) for p in patterns)]
    return index


def test_every_module_has_a_layer():
    for name in MODULES:
        layer(name)


def test_imports_run_downhill():
    uphill = [(name, target) for name, targets in GRAPH.items() for target in targets if layer(target) > layer(name)]
    assert uphill == [], f"imports from a lower layer to a higher one: {uphill}"


def test_no_function_local_imports_of_fusepass():
    local = [(name, target) for name, path in MODULES.items() for target, is_local in imports(path) if is_local]
    assert local == [], f"function-local imports: {local}"


def test_the_import_graph_is_acyclic():
    done, on_path = set(), []

    def visit(name):
        if name in on_path:
            raise AssertionError(f"import cycle: {' -> '.join(on_path[on_path.index(name):] + [name])}")
        if name in done:
            return
        on_path.append(name)
        for target in sorted(GRAPH[name]):
            visit(target)
        on_path.pop()
        done.add(name)

    for name in sorted(GRAPH):
        visit(name)


def test_ruff_finds_nothing():
    """The linter configured in pyproject.toml (pycodestyle and pyflakes, 120 columns)."""
    root = PACKAGE.parent
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "fusepass", "tests", "tools", "demos"], cwd=root,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _jit_kernels() -> list[tuple[str, ast.FunctionDef]]:
    """(module, function) of every @triton.jit function whose name ends in "kernel" (launched from Python;
    the helpers they call are inlined)."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("kernel") and "jit" in ast.unparse(
                    node.decorator_list[0] if node.decorator_list else ast.Constant(None)):
                found.append((name, node))
    return found


def test_files_and_kernel_signatures_stay_small():
    long_files = [name for name, path in MODULES.items() if len(path.read_text().splitlines()) > 450]
    assert long_files == [], f"modules over 450 lines: {long_files}"
    kernels = _jit_kernels()
    assert {node.name for _, node in kernels} >= {"_gemm_kernel", "normalize_kernel", "normalize_softmax_kernel"}
    wide = [(node.name, len(node.args.args)) for _, node in kernels if len(node.args.args) > 30]
    assert wide == [], f"kernels with more than 30 parameters: {wide}"


def test_kernels_unpack_their_meta_tuple_in_its_declared_order():
    """A kernel taking META unpacks it by position: each `NAME: tl.constexpr = META[i]` must name field i
    of the NamedTuple the launcher builds it from (upper-cased)."""
    declared = {"_gemm_kernel": GemmMeta._fields, "normalize_kernel": OutputMeta._fields,
                "normalize_softmax_kernel": OutputMeta._fields}
    for _, node in _jit_kernels():
        unpacked = [(stmt.target.id, stmt.value.slice.value) for stmt in node.body
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.value, ast.Subscript)
                    and ast.unparse(stmt.value.value) == "META"]
        if not unpacked:
            continue
        fields = declared[node.name]
        assert [(fields[i].upper(), i) for _, i in unpacked] == unpacked, node.name
        assert [i for _, i in unpacked] == list(range(len(unpacked))), node.name
