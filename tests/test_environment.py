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


def _markers(lines):
    """name -> the environment marker of its pin (None: every platform)."""
    from packaging.requirements import InvalidRequirement, Requirement

    markers = {}
    for line in lines:
        try:
            req = Requirement(line.split(" #")[0].strip().removeprefix("- "))
        except InvalidRequirement:
            continue
        if req.specifier and str(req.specifier).startswith("=="):
            markers[req.name.lower()] = str(req.marker) if req.marker else None
    return markers


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
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    conda = (ROOT / "environment.yml").read_text().splitlines()
    assert _markers(conda) == _markers(deps), "the environment markers (e.g. triton's) differ"


def test_environment_yml_is_yaml_with_the_marker_intact():
    """A marker line such as triton's must stay one pip requirement after YAML parsing (no comment, no split)."""
    import yaml

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "triton==3.7.1; sys_platform == 'linux'" in pip


def test_triton_is_pinned_for_linux_only():
    """Triton 3.7.1 has wheels for Linux (x86_64, aarch64) only: an unconditional pin breaks macOS and Windows."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert _markers(deps)["triton"] == 'sys_platform == "linux"'


def test_installed_versions_match_pins():
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for req in map(Requirement, deps):
        if req.marker and not req.marker.evaluate():
            continue  # not for this platform (triton off Linux)
        pinned = str(req.specifier).removeprefix("==")
        installed = version(req.name).split("+")[0]  # torch's CPU build is 2.13.0+cpu
        assert installed == pinned, f"{req.name}: installed {installed}, pinned {pinned}"


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
