"""The one place that decides how Triton kernels run.

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

import os
import sys
import warnings


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        warnings.warn(
            "triton was imported before tinypaged, so it was set up for the GPU compiler, and this "
            "machine has no CUDA: Triton kernels will fail. Restart Python and import tinypaged "
            "before triton (or set TRITON_INTERPRET=1 before starting Python).",
            RuntimeWarning, stacklevel=2,
        )

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
