"""Stages 2 and 3: the paged KV cache's physical blocks, by id: the free queue, prefix hashes.

These are the assignments' answers, line for line (stage 2's ``BlockAllocator``, stage 3's ``hash_chain`` and
``PrefixCache``), and the free queues the engine's ``BlockManager`` runs: without prefix caching a
``BlockAllocator``, a first-in first-out queue of ids ``0 .. num_blocks - 1`` (``allocate()`` takes the head,
``free(b)`` puts ``b`` back at the tail); with it a ``PrefixCache`` (vLLM v1's ``v1/core/block_pool.py``), whose
free queue is an LRU of blocks that keep their prefix hash. Reference counts (how many block tables hold a
block) are the ``BlockManager``'s, kept by stage 3's ``fork``, ``append_slot`` and ``free_table``.

Invariants (checked by the property tests):

* A block is in the free queue exactly when no block table holds it.
* Where a freed block goes (vLLM v1 today): without prefix caching every freed block joins the tail, so
  the queue is first-in first-out (vllm PR #48017). With prefix caching a freed block keeps its hash and
  joins the tail, so the queue is an LRU cache, while a freed block without a hash caches nothing and goes
  to the head, to be reused first (vllm PR #42656).
* Allocation takes the head and forgets the hash that block held: the index only ever maps a hash to
  blocks whose current content is that prefix (no stale entries).
* A block's hash chains its parent block's hash with its own token ids and the sequence's extra keys
  (e.g. a cache salt), so equal hashes mean equal whole prefixes (SHA-256: collisions are not checked).
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict, deque

# The first block of every chain hashes against this fixed seed (deterministic across runs).
ROOT_HASH = hashlib.sha256(b"tinypaged-prefix-root").digest()


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def hash_block_tokens(parent_hash: bytes | None, token_ids, extra_keys=None) -> bytes:
    """SHA-256 of (parent hash, this block's token ids, extra keys such as a LoRA id)."""
    payload = pickle.dumps((parent_hash or ROOT_HASH, tuple(token_ids), extra_keys), protocol=5)
    return hashlib.sha256(payload).digest()


def hash_chain(token_ids, block_size: int, extra_keys=None, known=()) -> list[bytes]:
    """Chained hashes of the *full* blocks of ``token_ids``: hash i covers tokens 0 .. (i+1)*block_size - 1.

    ``known`` are hashes already computed for the first blocks (they are kept, not recomputed).
    """
    hashes = list(known)
    for i in range(len(hashes), len(token_ids) // block_size):
        block = token_ids[i * block_size:(i + 1) * block_size]
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, block, extra_keys))
    return hashes


class BlockAllocator:
    """Stage 2: the free queue of block ids, first in first out. Every operation is O(1)."""

    def __init__(self, num_blocks: int):
        self.queue = deque(range(num_blocks))
        self.is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.queue)

    def allocate(self) -> int:
        """The id at the head of the free queue; raises when none is free."""
        if not self.queue:
            raise RuntimeError("no free KV blocks")
        block_id = self.queue.popleft()
        self.is_free[block_id] = False
        return block_id

    def free(self, block_id: int) -> None:
        """Back to the tail of the queue; freeing a free block raises."""
        if self.is_free[block_id]:
            raise RuntimeError(f"double free of block {block_id}")
        self.is_free[block_id] = True
        self.queue.append(block_id)


class PrefixCache:
    """Stage 3: a free queue that is an LRU cache of full blocks, found by the hash of the prefix they hold.

    ``refs[b]``: how many holders block ``b`` has (0: it is in the queue). ``hash_of`` / ``index``: which
    prefix each block holds, and which blocks hold each prefix; a freed block keeps its entry until
    ``allocate`` hands it out again. Every operation is O(1).
    """

    def __init__(self, num_blocks: int):
        self.refs = [0] * num_blocks
        self.queue = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_of = {}  # block -> the hash of the prefix it holds (kept while the block is free)
        self.index = {}  # hash -> {block: None} for the blocks holding it, first registered first

    @property
    def num_free(self) -> int:
        return len(self.queue)

    def ref_count(self, block_id: int) -> int:
        return self.refs[block_id]

    def allocate(self) -> int:
        """The head of the free queue, with one holder; the prefix it held is forgotten (stale now)."""
        if not self.queue:
            raise RuntimeError("no free blocks")
        block_id, _ = self.queue.popitem(last=False)
        old = self.hash_of.pop(block_id, None)
        if old is not None:  # the block is about to be overwritten: its hash is stale
            del self.index[old][block_id]
            if not self.index[old]:
                del self.index[old]
        self.refs[block_id] = 1
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one holder; the last one sends the block to the queue (see the module's invariants)."""
        if self.refs[block_id] <= 0:
            raise RuntimeError(f"block {block_id} is already free")
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0:
            self.queue[block_id] = None  # the tail
            if block_id not in self.hash_of:
                self.queue.move_to_end(block_id, last=False)  # nothing cached: the head

    def register(self, block_id: int, block_hash: bytes) -> None:
        """``block_id`` is full and holds the prefix ``block_hash`` names (registering it again is a no-op).
        Two blocks may hold the same prefix; lookups return the first."""
        self.hash_of[block_id] = block_hash
        self.index.setdefault(block_hash, {})[block_id] = None

    def lookup(self, block_hash: bytes):
        """A block holding the prefix ``block_hash`` names (in use or free), or None."""
        holders = self.index.get(block_hash)
        return next(iter(holders)) if holders else None

    def touch(self, block_id: int) -> None:
        """One more holder (a cache hit takes a free block out of the queue)."""
        if self.refs[block_id] == 0:
            del self.queue[block_id]
        self.refs[block_id] += 1
