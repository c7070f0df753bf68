"""The package's layers (docs/ARCHITECTURE.md): sub-packages by concern, imports pointing one way only.

The contract lives in pyproject.toml ([tool.importlinter], a `layers` contract over the sub-packages and the
few top-level modules, `exhaustive`, so a new module must be placed) and is checked by import-linter, a
maintained import-contract tool. A layers contract cannot see a circle between two modules of one layer, and
kernels/ (installed as tinypaged.kernels from outside tinypaged/) may be outside its graph: this file also
reads every import itself, function-level imports included, and fails on any circle.
"""

import ast
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _layers_contract():
    return next(c for c in CONFIG["contracts"] if c["type"] == "layers")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":
        parts[0:1] = ["tinypaged", "kernels"]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in [*(ROOT / "tinypaged").rglob("*.py"), *(ROOT / "kernels").glob("*.py")]}


def _imports(path: pathlib.Path) -> set[str]:
    """The tinypaged modules a file imports, anywhere in it (module level or inside a function)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
    return {n for n in names if n in MODULES}


def test_few_modules_at_the_top_and_every_one_placed_in_a_layer():
    top = {p.stem for p in (ROOT / "tinypaged").glob("*.py") if p.stem != "__init__"}
    packages = {p.parent.name for p in (ROOT / "tinypaged").glob("*/__init__.py")}
    assert len(top) <= 10, f"{len(top)} modules directly in tinypaged/: {sorted(top)}"
    contract = _layers_contract()
    assert contract.get("exhaustive") is True and contract["containers"] == ["tinypaged"]
    placed = {name.strip().strip("()") for layer in contract["layers"] for name in layer.replace(":", "|").split("|")}
    assert (top | packages | {"kernels"}) - placed == set(), "place every module and sub-package in a layer"
    assert placed - (top | packages | {"kernels"}) == set(), "the contract names modules that no longer exist"


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is not installed (it is pinned in pyproject.toml)"
    run = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 kept, 0 broken" in run.stdout, run.stdout


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), i.e. every import circle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_anywhere():
    """Package __init__ files are left out: importing `tinypaged.kv.x` runs `tinypaged/__init__.py`, but that is
    Python's loading order, not a dependency of x's code."""
    graph = {m: {d for d in _imports(p) if MODULES[d].name != "__init__.py" or d == "tinypaged.kernels"}
             for m, p in MODULES.items()}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_kernels_import_nothing_above_them():
    """kernels/ sits outside tinypaged/ (it installs as tinypaged.kernels): read its imports directly."""
    for path in (ROOT / "kernels").glob("*.py"):
        bad = {n for n in _imports(path) if not n.startswith(("tinypaged.kernels", "tinypaged.triton_mode"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", ["attention/backends.py", "model/llama.py"])
def test_the_ignored_imports_are_only_the_kernels(path):
    """pyproject.toml ignores `tinypaged.attention.backends -> tinypaged` and `tinypaged.model.llama -> tinypaged`
    (import-linter reads the kernels' import as one of the package): make sure each file imports the kernels and
    nothing from the package's top."""
    imports = _imports(ROOT / "tinypaged" / path)
    assert "tinypaged.kernels" in imports and "tinypaged" not in imports
