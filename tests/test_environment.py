"""The pinned stack is described twice (pip and conda); they must agree, and the install must match."""

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pins(lines):
    pins = {}
    for line in lines:
        m = re.fullmatch(r"\s*-?\s*([A-Za-z0-9_.\-]+)==([^\s#;]+).*", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def pyproject_pins():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return _pins(deps)


def conda_pins():
    return _pins((ROOT / "environment.yml").read_text().splitlines())


def test_every_dependency_is_pinned():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert len(pyproject_pins()) == len(deps), "every dependency in pyproject.toml must be pinned with =="


def test_environment_yml_matches_pyproject():
    assert conda_pins() == pyproject_pins()


def test_installed_versions_match_pins():
    for name, pinned in pyproject_pins().items():
        installed = version(name).split("+")[0]  # torch's CPU build is 2.13.0+cpu
        assert installed == pinned, f"{name}: installed {installed}, pinned {pinned}"


def test_kernels_install_inside_tinypaged_not_top_level(tmp_path):
    """kernels/ is tinypaged.kernels; a top-level `kernels` would shadow the PyPI package transformers probes."""
    import subprocess
    import sys

    code = ("import importlib.util, tinypaged.kernels as k; "
            "print(k.__file__); print(importlib.util.find_spec('kernels') is None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    path, no_top_level = out.stdout.split()
    assert Path(path).parent == ROOT / "kernels"
    assert no_top_level == "True"
