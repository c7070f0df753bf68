"""The prefix cache's own event list (vLLM v1's ``BlockPool`` keeps one the same way): which blocks' hashes
entered the cache and which left it, as plain records. The KV manager fills it only when asked
(``enable_kv_cache_events``); the engine drains it once per step (``take_events``), and the server turns the
records into vLLM's wire format (``tinypaged/engine/kv_events.py``).

``PrefixCache`` (``kv/block_pool.py``) is stage 3's graded class, so it records nothing itself: the manager
registers blocks (``BlockStored`` comes from there, where the tokens are known), and the one place a cached
prefix is forgotten, the free queue handing a cached block out again, is observed by ``recording_cache``, a
subclass of whichever prefix-cache class the manager was built with.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockStored:
    """Consecutive blocks of one chain that now hold their prefixes (vLLM's ``BlockStored``)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # the block before the first of them; None at the start of a prompt
    token_ids: list[int]
    block_size: int


@dataclass
class BlockRemoved:
    """Cached blocks handed out for other data: their prefixes are gone (vLLM's ``BlockRemoved``)."""

    block_hashes: list[bytes]


@dataclass
class KVEventLog:
    """Events since the last ``take``, in order. A block stored right after its parent extends that event,
    as vLLM's ``cache_full_blocks`` reports the new full blocks of one request in one event."""

    block_size: int
    events: list = field(default_factory=list)

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self.events.append(BlockStored([block_hash], parent, list(token_ids), self.block_size))

    def removed(self, block_hash: bytes) -> None:
        self.events.append(BlockRemoved([block_hash]))

    def take(self) -> list:
        events, self.events = self.events, []
        return events


def recording_cache(cache_cls, log: KVEventLog):
    """A subclass of the prefix-cache class ``cache_cls`` whose ``allocate`` reports to ``log`` the prefix a
    cached block held when it is handed out again (the head of the free queue, as ``PrefixCache`` hands out)."""

    class RecordingPrefixCache(cache_cls):
        def allocate(self) -> int:
            head = next(iter(self.queue), None)
            old = self.hash_of.get(head) if head is not None else None
            block_id = super().allocate()
            if old is not None and self.hash_of.get(block_id) is None:
                log.removed(old)
            return block_id

    RecordingPrefixCache.__qualname__ = RecordingPrefixCache.__name__ = f"Recording{cache_cls.__name__}"
    return RecordingPrefixCache
