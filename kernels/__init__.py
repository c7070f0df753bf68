"""Triton kernels, importable as ``tinypaged.kernels`` (this folder is mapped there by pyproject.toml).

Without Triton (macOS, Windows: ``tinypaged.triton_mode.AVAILABLE`` is False) the PyTorch references and the
specs still import; the two Triton launchers are stand-ins that raise ``TritonUnavailable``, saying why.
"""

from tinypaged import triton_mode
from tinypaged.kernels.reference import (gather_then_attend, merge_splits_reference, online_softmax_update,
                                        paged_attention_reference, reshape_and_cache_reference)

if triton_mode.AVAILABLE:
    from tinypaged.kernels.paged_attention import paged_attention_decode
    from tinypaged.kernels.reshape_and_cache import reshape_and_cache
else:
    def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, num_splits=None):
        """The Triton decode kernel; this machine has no Triton (see ``tinypaged.triton_mode``)."""
        triton_mode.require_triton("paged_attention_decode")

    def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
        """The Triton cache-write kernel; this machine has no Triton (see ``tinypaged.triton_mode``)."""
        triton_mode.require_triton("reshape_and_cache")

__all__ = [
    "paged_attention_decode",
    "paged_attention_reference",
    "gather_then_attend",
    "online_softmax_update",
    "merge_splits_reference",
    "reshape_and_cache",
    "reshape_and_cache_reference",
]
