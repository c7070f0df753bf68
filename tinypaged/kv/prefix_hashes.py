"""Prefix caching's bookkeeping beside a paged manager's block tables (stage 3, vLLM's automatic prefix caching).

``PrefixHashes`` builds the manager's prefix cache (stage 3's ``PrefixCache``, or a subclass that records
evictions when KV events are on), finds a new sequence's cached prefix (``longest_cached_prefix``), and
publishes the hash of each block a step fills (``register``), memoising each sequence's full-block hashes
while it holds blocks. The ``BlockManager`` owns the tables and reference counts; this owns the hashes.

Invariants: a block's hash is registered once the block is *full* of known tokens and its KV is written by
the step that fills it, before any later step (or later attention layer) can read it; ``hashes[seq_id]``
holds the hashes of ``seq_id``'s first full blocks, a prefix of ``hash_chain`` of its tokens.
"""

from __future__ import annotations

from tinypaged.kv.events import KVEventLog, recording_cache


class PrefixHashes:
    """The prefix cache of a paged manager built from ``parts`` (its ``PrefixCache``, ``hash_chain`` and
    ``longest_cached_prefix``), with KV events recorded in ``events`` when ``record_events``."""

    def __init__(self, parts, num_blocks: int, block_size: int, record_events: bool = False):
        self.parts, self.block_size = parts, block_size
        # KV events (vLLM's enable_kv_cache_events): the prefix cache's changes as records, drained by take_events
        self.events = KVEventLog(block_size) if record_events else None
        cache_cls = parts.PrefixCache if self.events is None else recording_cache(parts.PrefixCache, self.events)
        self.cache = cache_cls(num_blocks)
        self.hashes: dict[int, list[bytes]] = {}  # seq_id -> hashes of its full blocks, as far as known

    def lookup(self, seq) -> list[int]:
        """The block ids of ``seq``'s longest cached prefix (at most ``len(seq) - 1`` tokens)."""
        return self.parts.longest_cached_prefix(seq.token_ids, self.block_size, self.cache,
                                                getattr(seq, "extra_keys", None))

    def register(self, seq, table: list[int], num_tokens: int) -> None:
        """Publish the hash of every block of ``table`` that the first ``num_tokens`` tokens of ``seq`` fill.
        A prefix-cache hit is registered again, which changes nothing (and records no event)."""
        known = self.hashes.get(seq.seq_id, [])
        full = min(num_tokens, len(seq)) // self.block_size
        if full <= len(known):
            return
        hashes = self.hashes[seq.seq_id] = self.parts.hash_chain(seq.token_ids[: full * self.block_size],
                                                                 self.block_size, getattr(seq, "extra_keys", None),
                                                                 known)
        for i in range(len(known), full):
            fresh = self.events is not None and self.cache.hash_of.get(table[i]) != hashes[i]
            self.cache.register(table[i], hashes[i])
            if fresh:  # a block whose hash enters the cache
                bs = self.block_size
                self.events.stored(hashes[i], hashes[i - 1] if i else None, seq.token_ids[i * bs:(i + 1) * bs])

    def fork(self, parent_id, child_id) -> None:
        """The child holds the parent's blocks, so their known hashes too."""
        self.hashes[child_id] = list(self.hashes.get(parent_id, []))

    def forget(self, seq_id) -> None:
        """``seq_id`` holds no blocks any more (freed, or swapped out): its blocks are registered again on growth."""
        self.hashes.pop(seq_id, None)

    def take_events(self) -> list:
        """The KV events recorded since the last call (``tinypaged.kv.events`` records), oldest first."""
        return self.events.take() if self.events is not None else []
