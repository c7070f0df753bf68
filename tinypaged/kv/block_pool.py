"""Stages 2 and 3: the paged KV cache's physical blocks, by id: the free queue, reference counts, prefix hashes.

``BlockAllocator`` (stage 2) is the free queue: block ids ``0 .. num_blocks - 1``; ``allocate()`` takes the
head, ``free(b)`` puts ``b`` back at the tail. ``BlockPool`` (stage 3, vLLM v1's ``v1/core/block_pool.py``)
adds a reference count per block (``refcounts``: block id -> how many block tables hold it) and, with
``enable_caching``, the prefix-cache index. These are the classes the assignments' ``BlockAllocator`` and
``PrefixCache`` answer, and the ones the engine's ``BlockManager`` runs.

Invariants (checked by the property tests):

* A block is in the allocator's free queue exactly when ``refcounts`` has no entry for it.
* Where a freed block goes (vLLM v1 today): without prefix caching every freed block joins the tail, so
  the queue is first-in first-out (``free_blocks`` when ``enable_caching`` is off, vllm PR #48017). With
  prefix caching a freed block keeps its hash and joins the tail, so the queue is an LRU cache, while a
  freed block without a hash caches nothing and goes to the head, to be reused first (vllm PR #42656).
* Allocation takes the head and forgets the hash that block held: the index only ever maps a hash to
  blocks whose current content is that prefix (no stale entries).
* A block's hash chains its parent block's hash with its own token ids and the sequence's extra keys
  (e.g. a cache salt), so equal hashes mean equal whole prefixes (SHA-256: collisions are not checked).
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict

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
    """Stage 2: the free queue of block ids. Every operation is O(1)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue

    def __iter__(self):
        """The free block ids, head (next to be allocated) first."""
        return iter(list(self._queue))

    def allocate(self) -> int:
        """The id at the head of the free queue; raises when none is free."""
        if not self._queue:
            raise RuntimeError("no free KV blocks")
        block_id, _ = self._queue.popitem(last=False)
        return block_id

    def free(self, block_id: int, front: bool = False) -> None:
        """Back to the tail of the queue (``front``: to the head); freeing a free block raises."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block {block_id} is not in this cache of {self.num_blocks} blocks")
        if block_id in self._queue:
            raise RuntimeError(f"double free of block {block_id}")
        self._queue[block_id] = None
        if front:
            self._queue.move_to_end(block_id, last=False)

    def take(self, block_id: int) -> None:
        """Remove a free block from anywhere in the queue (a prefix-cache hit reuses it)."""
        del self._queue[block_id]


class BlockPool:
    """Stage 3: reference-counted blocks over a free queue, and the prefix-hash index.

    ``BlockPool(num_blocks)`` owns its ``BlockAllocator``; ``BlockPool(allocator, refcounts=counts)`` works
    on a given allocator and counts dict (the shape of stage 3's exercises: a table is a list of ids, the
    counts a plain dict). ``free`` drops one reference; only the last one returns the block to the queue.
    """

    def __init__(self, blocks, enable_caching: bool = False, refcounts: dict[int, int] | None = None):
        self.allocator = BlockAllocator(blocks) if isinstance(blocks, int) else blocks
        self.refcounts = {} if refcounts is None else refcounts
        self.enable_caching = enable_caching
        self.hash_of: dict[int, bytes] = {}  # block -> the prefix hash it holds (kept while it is free)
        self.index: dict[bytes, dict[int, None]] = {}  # hash -> blocks holding it, first registered first
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash (in use or waiting in the free queue)."""
        return len(self.hash_of)

    def ref_count(self, block_id: int) -> int:
        return self.refcounts.get(block_id, 0)

    def allocate(self) -> int:
        """The head of the free queue, with one reference; the prefix it held is forgotten (stale now)."""
        block_id = self.allocator.allocate()
        old = self.hash_of.pop(block_id, None)
        if old is not None:
            holders = self.index[old]
            del holders[block_id]
            if not holders:
                del self.index[old]
            self.num_evictions += 1
        self.refcounts[block_id] = 1
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one reference; the last one sends the block to the queue (see the module's invariants)."""
        count = self.refcounts.get(block_id, 0)
        if count <= 0:
            raise RuntimeError(f"double free of block {block_id}: no table holds it")
        if count > 1:
            self.refcounts[block_id] = count - 1
            return
        del self.refcounts[block_id]
        if self.enable_caching and block_id not in self.hash_of:
            self.allocator.free(block_id, front=True)
        else:
            self.allocator.free(block_id)

    def touch(self, block_id: int) -> None:
        """One more table holds ``block_id`` (a fork, or a cache hit, which takes a free block out of the queue)."""
        count = self.refcounts.get(block_id, 0)
        if count == 0:
            self.allocator.take(block_id)
        self.refcounts[block_id] = count + 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """``block_id`` is full and holds the prefix ``block_hash`` names. A block holds one prefix: a new
        hash replaces its old one. Two blocks may hold the same prefix; lookups return the first."""
        old = self.hash_of.get(block_id)
        if old == block_hash:
            return
        if old is not None:
            del self.index[old][block_id]
            if not self.index[old]:
                del self.index[old]
        self.hash_of[block_id] = block_hash
        self.index.setdefault(block_hash, {})[block_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        """A block holding the prefix ``block_hash`` names (in use or free), or None."""
        holders = self.index.get(block_hash)
        return next(iter(holders)) if holders else None
