"""Triton kernels, importable as ``tinypaged.kernels`` (this folder is mapped there by pyproject.toml).

Without Triton (macOS, Windows: ``tinypaged.triton_mode.AVAILABLE`` is False) the PyTorch references and the
specs still import; the Triton launchers are stand-ins that raise ``TritonUnavailable``, saying why.

Two families of kernels: the attention kernels the course builds (``reshape_and_cache``, ``paged_attention_decode``)
and the model's fused element-wise operators (``fused_elementwise``: add-and-RMSNorm, RoPE, SiLU-and-multiply),
which ``tinypaged.model.llama`` calls on a CUDA device.
"""

from tinypaged import triton_mode
from tinypaged.kernels.reference import (gather_then_attend, merge_splits_reference, online_softmax_update,
                                        paged_attention_reference, reshape_and_cache_reference)

if triton_mode.AVAILABLE:
    from tinypaged.kernels.fused_elementwise import add_rms_norm_triton, rope_triton_, silu_mul_triton
    from tinypaged.kernels.paged_attention import paged_attention_decode
    from tinypaged.kernels.reshape_and_cache import reshape_and_cache
else:
    def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, num_splits=None):
        """The Triton decode kernel; this machine has no Triton (see ``tinypaged.triton_mode``)."""
        triton_mode.require_triton("paged_attention_decode")

    def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
        """The Triton cache-write kernel; this machine has no Triton (see ``tinypaged.triton_mode``)."""
        triton_mode.require_triton("reshape_and_cache")

    def add_rms_norm_triton(x, residual, weight, eps):
        """The fused add-and-RMSNorm kernel; this machine has no Triton (see ``tinypaged.triton_mode``)."""
        triton_mode.require_triton("add_rms_norm_triton")

    def rope_triton_(x, heads, cos, signed_sin):
        """The fused RoPE kernel; this machine has no Triton (see ``tinypaged.triton_mode``)."""
        triton_mode.require_triton("rope_triton_")

    def silu_mul_triton(gate_up):
        """The fused SiLU-and-multiply kernel; this machine has no Triton (see ``tinypaged.triton_mode``)."""
        triton_mode.require_triton("silu_mul_triton")

__all__ = [
    "paged_attention_decode",
    "paged_attention_reference",
    "gather_then_attend",
    "online_softmax_update",
    "merge_splits_reference",
    "reshape_and_cache",
    "reshape_and_cache_reference",
    "add_rms_norm_triton",
    "rope_triton_",
    "silu_mul_triton",
]
