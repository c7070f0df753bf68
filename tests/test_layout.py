"""The three wings (docs/ARCHITECTURE.md): engine, lab, classroom, with imports pointing one way only.

The contracts live in pyproject.toml ([tool.importlinter]) and are checked by import-linter, a
maintained import-contract tool. This test runs it, and makes sure no engine module escapes the
contract by being left off its list (a new file in tinypaged/ must be added there).
"""

import ast
import pathlib
import shutil
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _engine_contract():
    return next(c for c in CONFIG["contracts"] if c["name"].startswith("The engine"))


def test_every_engine_module_is_under_the_contract():
    listed = set(_engine_contract()["source_modules"])
    present = {f"tinypaged.{p.stem}" for p in (ROOT / "tinypaged").glob("*.py") if p.stem != "__init__"}
    assert present - listed == set(), "engine modules missing from [tool.importlinter]; add them"
    assert listed - present == set(), "[tool.importlinter] lists modules that no longer exist"


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is not installed (it is pinned in pyproject.toml)"
    run = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 kept, 0 broken" in run.stdout, run.stdout


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_kernels_stay_in_the_engine():
    """kernels/ sits outside tinypaged/ (it installs as tinypaged.kernels), where import-linter's graph
    does not look: read its imports directly."""
    for path in (ROOT / "kernels").glob("*.py"):
        bad = {n for n in _imports(path) if n.startswith(("tinypaged.lab", "tinypaged.course"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"
