"""Triton kernels, importable as ``tinypaged.kernels`` (this folder is mapped there by pyproject.toml)."""

from tinypaged.kernels.paged_attention import (
    gather_then_attend,
    paged_attention_decode,
    paged_attention_reference,
)
from tinypaged.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_reference
from tinypaged.kernels.teaching import online_softmax_update, random_paged_batch

__all__ = [
    "paged_attention_decode",
    "paged_attention_reference",
    "gather_then_attend",
    "reshape_and_cache",
    "reshape_and_cache_reference",
    "online_softmax_update",
    "random_paged_batch",
]
