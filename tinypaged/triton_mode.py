"""The one place that decides how Triton kernels run, and whether they can run at all.

Triton has wheels for Linux only (x86_64 and aarch64; pyproject.toml installs it there through an environment
marker). On macOS and Windows it is absent: ``AVAILABLE`` is False, ``tinypaged.kernels`` still offers the PyTorch
references, and the Triton kernels (``attention_backend="triton"``) raise :class:`TritonUnavailable`, saying so.
``AVAILABLE`` looks for the package without importing it (importing it here would defeat the next paragraph).

Triton picks between compiling for a GPU and its NumPy interpreter when a
``@triton.jit`` function is *defined*, reading ``TRITON_INTERPRET`` at that moment.
So this module must run before any kernel module is imported; ``tinypaged/__init__.py``
imports it first, and ``tinypaged.kernels`` can only be imported through ``tinypaged``.

Without CUDA we switch the interpreter on, so every kernel runs (slowly) on a CPU.
A value the user already set is respected.

Triton's own library functions (``tl.zeros``, ``tl.cdiv``, ...) are ``@triton.jit`` functions
too, so if ``triton`` was imported *before* this module switched the interpreter on, they were
built for the compiler and every interpreted kernel fails ("Cannot call @triton.jit'd outside
of the scope of a kernel"). We cannot repair that after the fact; we warn instead. Rule: in a
script or notebook, ``import tinypaged`` before ``import triton``.
"""

import importlib.util
import os
import sys
import warnings


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken entry in sys.modules / sys.path counts as absent
        return False


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


AVAILABLE: bool = _triton_installed()
"""Whether Triton is installed (False on macOS and Windows, where it has no wheels)."""

WHY_UNAVAILABLE = ("Triton is not installed: it has wheels for Linux only (x86_64 and aarch64), so on macOS and "
                   "Windows the course runs without it")


class TritonUnavailable(RuntimeError):
    """A Triton kernel was asked for on a machine without Triton."""


def require_triton(what: str) -> None:
    """Raise :class:`TritonUnavailable` naming ``what`` (the knob or function) when Triton is absent."""
    if not AVAILABLE:
        raise TritonUnavailable(f"{what} needs Triton. {WHY_UNAVAILABLE}: use attention_backend=\"torch\" (the "
                                "default), or run the Triton parts on Linux (or WSL on Windows).")


if AVAILABLE and "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        warnings.warn(
            "triton was imported before tinypaged, so it was set up for the GPU compiler, and this "
            "machine has no CUDA: Triton kernels will fail. Restart Python and import tinypaged "
            "before triton (or set TRITON_INTERPRET=1 before starting Python).",
            RuntimeWarning, stacklevel=2,
        )

INTERPRETED: bool = AVAILABLE and os.environ.get("TRITON_INTERPRET", "0") == "1"
