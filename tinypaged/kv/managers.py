"""Building the KV cache manager, shared by the engine and the lab's model-free simulator.

One place decides which manager a configuration gets (``kv_cache_manager``: a plug-in's factory, or
the built-in paged ``BlockManager`` or contiguous ``ContiguousKVManager`` by name) and checks its contract, and one
place refuses a request that no amount of waiting would let in.
"""

from __future__ import annotations

from tinypaged.kv.block_manager import BlockManager
from tinypaged.kv.contiguous import ContiguousKVManager
from tinypaged.kv.radix_cache import RadixKVManager
from tinypaged.interfaces import KV_REQUIRED, require


def build_kv_manager(config, spec, backend=None):
    """The configured KV manager for ``spec`` (a ``KVCacheSpec``), its required methods checked;
    with an attention ``backend`` that reads block tables it must also provide ``block_ids``."""
    factory = config.kv_cache_manager
    if isinstance(factory, str):  # a built-in one, by name
        factory = {"paged": BlockManager.from_spec, "contiguous": ContiguousKVManager.from_spec,
                   "radix": RadixKVManager.factory()}[factory]  # the names of config.KV_MANAGERS
    kv = factory(spec)
    require(kv, KV_REQUIRED, "kv_cache_manager")
    if backend is not None and backend.uses_block_tables:
        require(kv, ("block_ids",), f"kv_cache_manager (attention_backend {backend.name!r} reads block tables)")
    return kv


def check_fits(kv, seq) -> None:
    """Raise ValueError if ``seq`` could not run even alone in an empty cache (it would wait forever)."""
    need = kv.max_tokens_needed(seq)
    if need > kv.capacity_tokens:
        raise ValueError(
            f"Request {seq.request_id} can never fit in the KV cache, so it would never run: it needs up to "
            f"{need} tokens (prompt {seq.num_prompt_tokens} + max_tokens {seq.params.max_tokens}, as the KV "
            f"manager reserves them) but the cache holds {kv.capacity_tokens}. Lower max_tokens or "
            f"max_model_len, or give the cache more memory (kv_cache_memory_bytes / gpu_memory_utilization).")
