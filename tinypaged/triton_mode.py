"""The one place that decides how Triton kernels run.

Triton picks between compiling for a GPU and its NumPy interpreter when a
``@triton.jit`` function is *defined*, reading ``TRITON_INTERPRET`` at that moment.
So this module must run before any kernel module is imported; ``tinypaged/__init__.py``
imports it first, and ``tinypaged.kernels`` can only be imported through ``tinypaged``.

Without CUDA we switch the interpreter on, so every kernel runs (slowly) on a CPU.
A value the user already set is respected.
"""

import os


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
