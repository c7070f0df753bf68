"""Stages 2 and 3: the paged KV cache's memory manager (PagedAttention's "virtual memory").

The KV cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots. A sequence owns
a *block table*: logical block i (its tokens ``i*block_size`` .. ``(i+1)*block_size - 1``) lives
in physical block ``block_table[i]``. Token at position p is written to slot
``block_table[p // block_size] * block_size + p % block_size``.

Invariants (checked by the property tests):

* A block is either in the free queue (``ref_cnt == 0``) or referenced by ``ref_cnt`` block tables,
  never both; every block is one or the other.
* Blocks are allocated one at a time as a sequence grows, never reserved up front, so the only
  waste is the unfilled tail of each sequence's last block.
* Sharing (stage 3): ``fork`` gives a child the parent's table and bumps each block's ``ref_cnt``.
  A block is written only when its ``ref_cnt`` is 1: before a sequence appends into a shared,
  partially filled block, it gets a private copy (copy-on-write).
* Prefix caching (stage 3; hash-and-LRU caching as in vLLM since 2024, not the paper's reserved
  shared prefixes): a block's hash is registered once the block is *full* of known tokens. The hash
  chains the parent block's hash with the block's token ids and the sequence's extra keys (e.g. a
  cache salt), so equal hashes mean equal whole prefixes. A block whose ``ref_cnt`` drops to 0 keeps
  its hash and joins the tail of the free queue, which is therefore an LRU cache: allocation takes
  the head, and drops that block's stale hash before reuse. Freed blocks without a hash go to the
  head instead (reused first). A cache hit on a free block takes it out of the queue. Sequences
  free their blocks tail first, so the ends of prefix chains are evicted before their beginnings.
* Ownership: this manager alone owns block tables and reference counts (``block_ids(seq)`` reads
  them). It never changes a sequence: the scheduler owns ``num_computed_tokens``.
* The hash index only points at blocks whose current hash is that key; lookups are capped at
  ``len(seq) - 1`` tokens, and the hit rate (``record_prefix_lookup``) is counted in tokens, only
  while prefix caching is on.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field

# The first block of every chain hashes against this fixed seed (deterministic across runs).
ROOT_HASH = hashlib.sha256(b"tinypaged-prefix-root").digest()


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


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple = field(default=(), repr=False)  # kept with the hash to rule out collisions

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash.hex()[:8]}"
        return f"Block({self.block_id}, ref={self.ref_cnt}{cached})"


class BlockPool:
    """All physical blocks, the free queue (LRU order) and the prefix-hash index."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got num_blocks={num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        # hash -> the blocks holding that prefix block (two requests prefilled in the same step can
        # compute the same block twice; both copies stay findable until evicted)
        self.cached: dict[bytes, dict[int, Block]] = {}
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> Block:
        """Take the least recently freed block; forget the prefix it held (its hash is stale now)."""
        if not self.free_queue:
            raise RuntimeError("no free KV blocks")
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            holders = self.cached.get(block.block_hash, {})
            holders.pop(block.block_id, None)
            if not holders:
                self.cached.pop(block.block_hash, None)
            block.block_hash, block.token_ids = None, ()
            self.num_evictions += 1
        block.ref_cnt = 1
        return block

    def touch(self, block: Block) -> None:
        """One more table refers to ``block`` (a cache hit or a fork)."""
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def release(self, blocks) -> None:
        """Drop one reference from each block, in the order given. An unreferenced block with a hash
        joins the queue's tail (the LRU end: kept longest); one without a hash holds nothing worth
        keeping and goes to the head, to be reused first (vLLM v1's ``free_blocks``)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def register(self, block: Block, block_hash: bytes, token_ids: tuple) -> None:
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached.setdefault(block_hash, {})[block.block_id] = block

    def lookup(self, block_hash: bytes, token_ids: tuple) -> Block | None:
        holders = self.cached.get(block_hash)
        if not holders:
            return None
        block = next(iter(holders.values()))
        if block.token_ids != token_ids:  # a hash collision would be caught here
            return None
        return block

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash (in use or waiting in the free queue)."""
        return sum(len(h) for h in self.cached.values())


class BlockManager:
    """Block tables for sequences: allocation as they grow, sharing, copy-on-write, prefix caching.

    Implements ``tinypaged.interfaces.KVCacheManager``. ``copy_block(src, dst)`` and the swap
    callbacks are supplied by the engine: they move the actual tensors. The manager only decides
    *which* blocks; it never touches KV data itself.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 copy_block=None, num_cpu_blocks: int = 0, max_model_len: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.copy_block = copy_block or (lambda src, dst: None)
        self.tables: dict[int, list[Block]] = {}  # seq_id -> its blocks (logical order)
        self.hashes: dict[int, list[bytes]] = {}  # seq_id -> hashes of its full blocks, as far as known
        self.cpu_free = list(range(num_cpu_blocks))
        self.cpu_ref: dict[int, int] = {}  # CPU block -> how many swapped tables point at it
        self.swapped: dict[int, list[int]] = {}  # seq_id -> CPU block ids holding its KV
        self.num_cow_copies = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found cached

    @classmethod
    def from_spec(cls, spec) -> "BlockManager":
        return cls(spec.num_blocks, spec.block_size, spec.enable_prefix_caching, spec.copy_block,
                   spec.num_cpu_blocks, spec.max_model_len)

    # -- sizes -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """vLLM's KV usage, O(1): 1 - free / total."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.block_size)

    def max_tokens_needed(self, seq) -> int:
        """Blocks are allocated as a sequence grows: it never needs room for more than its longest length."""
        return seq.max_total_tokens(self.max_model_len or len(seq) + (seq.params.max_tokens or 0))

    # -- prefix caching -----------------------------------------------------------------
    def _full_block_hashes(self, seq, num_tokens: int, memo: bool = True) -> list[bytes]:
        """Chained hashes of the full blocks among the first ``num_tokens`` tokens.

        Memoised per sequence while it holds blocks (``free`` drops the memo); a mere lookup for a
        waiting sequence (``memo=False``) leaves nothing behind, so nothing leaks if it never runs.
        """
        known = self.hashes.get(seq.seq_id, [])
        hashes = hash_chain(seq.token_ids[:num_tokens], self.block_size, getattr(seq, "extra_keys", None), known)
        if memo and len(hashes) > len(known):
            self.hashes[seq.seq_id] = hashes
        return hashes[: num_tokens // self.block_size]

    def get_computed_blocks(self, seq) -> list[Block]:
        """The longest cached prefix of ``seq``'s known tokens, in whole blocks.

        The hit is capped at ``len(seq) - 1`` tokens: the last token must run through the model
        so there are logits to sample from, even when the whole prompt is cached.
        """
        if not self.enable_prefix_caching or self.tables.get(seq.seq_id):
            return []
        tokens = seq.token_ids
        found = []
        bs = self.block_size
        for i, h in enumerate(self._full_block_hashes(seq, len(seq) - 1, memo=False)):
            block = self.pool.lookup(h, tuple(tokens[i * bs:(i + 1) * bs]))
            if block is None:
                break
            found.append(block)
        return found

    def record_prefix_lookup(self, seq, num_hit_tokens: int) -> None:
        """Count a new request's lookup, in tokens (vLLM's hit rate); nothing when caching is off."""
        if not self.enable_prefix_caching:
            return
        self.prefix_queries += len(seq)
        self.prefix_hits += num_hit_tokens

    # -- allocation ---------------------------------------------------------------------
    def _cow_needed(self, table: list[Block], num_computed: int) -> bool:
        """Appending at ``num_computed`` writes into the last block: is that block shared?"""
        return bool(table) and num_computed % self.block_size != 0 and table[-1].ref_cnt > 1 \
            and num_computed // self.block_size == len(table) - 1

    def can_allocate(self, seq, num_new_tokens: int, computed_blocks=()) -> bool:
        table = self.tables.get(seq.seq_id, [])
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.blocks_for(num_computed + num_new_tokens) - len(table) - len(computed_blocks)
        need += self._cow_needed(table, num_computed)
        # Cached blocks sitting in the free queue stop being free once this sequence takes them.
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return max(need, 0) + reclaimed <= self.pool.num_free

    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks=()) -> bool:
        """Make room for ``num_new_tokens`` tokens of ``seq`` after its computed ones; False (and no
        change) if blocks are short.

        ``computed_blocks`` (from ``get_computed_blocks``) join the table first: the new tokens
        start after them. ``seq`` itself is not changed (the scheduler advances its progress).
        """
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        table = self.tables.setdefault(seq.seq_id, [])
        for block in computed_blocks:
            self.pool.touch(block)
            table.append(block)
        start = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        if self._cow_needed(table, start):
            shared = table[-1]
            private = self.pool.allocate()
            self.copy_block(shared.block_id, private.block_id)  # done now, before the forward reads it
            self.pool.release([shared])
            table[-1] = private
            self.num_cow_copies += 1
        while len(table) < self.blocks_for(start + num_new_tokens):
            table.append(self.pool.allocate())
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, start + num_new_tokens)
        return True

    def _register_full_blocks(self, seq, num_tokens: int) -> None:
        """Publish the hash of every block this step fills: its tokens are known, its KV is written
        by this step's forward before any later step (or later attention layer) can read it."""
        table = self.tables[seq.seq_id]
        tokens = seq.token_ids
        bs = self.block_size
        for i, h in enumerate(self._full_block_hashes(seq, min(num_tokens, len(tokens)))):
            block = table[i]
            if block.block_hash is None:
                self.pool.register(block, h, tuple(tokens[i * bs:(i + 1) * bs]))

    def fork(self, parent, child) -> None:
        """``child`` shares every block of ``parent`` (reference counts go up; nothing is copied)."""
        blocks = self.tables.get(parent.seq_id, [])
        for block in blocks:
            self.pool.touch(block)
        self.tables[child.seq_id] = list(blocks)
        self.hashes[child.seq_id] = list(self.hashes.get(parent.seq_id, []))

    def free(self, seq) -> None:
        """Release ``seq``'s blocks, tail first (see the eviction-order invariant above)."""
        blocks = self.tables.pop(seq.seq_id, [])
        self.pool.release(reversed(blocks))
        self.hashes.pop(seq.seq_id, None)
        for cpu in self.swapped.pop(seq.seq_id, []):  # a swapped-out sequence that is aborted
            self._release_cpu(cpu)

    # -- swapping (preemption_mode="swap", vLLM v0) ----------------------------------------
    # A request's sequences swap out and in together, so blocks shared by siblings move once and
    # stay shared (v0 swapped whole sequence groups).
    def _distinct(self, tables) -> list:
        seen: dict[int, object] = {}
        for table in tables:
            for b in table:
                seen.setdefault(b if isinstance(b, int) else b.block_id, b)
        return list(seen.values())

    def can_swap_out(self, seqs) -> bool:
        return len(self._distinct(self.tables.get(s.seq_id, []) for s in seqs)) <= len(self.cpu_free)

    def swap_out(self, seqs, copy_to_cpu) -> None:
        blocks = self._distinct(self.tables.get(s.seq_id, []) for s in seqs)
        to_cpu = {b.block_id: self.cpu_free.pop() for b in blocks}
        copy_to_cpu(list(to_cpu), list(to_cpu.values()))
        for s in seqs:
            table = self.tables.pop(s.seq_id, [])
            self.swapped[s.seq_id] = [to_cpu[b.block_id] for b in table]
            for b in table:
                self.cpu_ref[to_cpu[b.block_id]] = self.cpu_ref.get(to_cpu[b.block_id], 0) + 1
            self.pool.release(reversed(table))

    def can_swap_in(self, seqs) -> bool:
        """Room for the swapped blocks plus one more block per sequence (its next token, or a
        copy-on-write), so the allocation right after swapping in cannot fail."""
        distinct = self._distinct(self.swapped.get(s.seq_id, []) for s in seqs)
        return len(distinct) + len(seqs) <= self.pool.num_free

    def swap_in(self, seqs, copy_to_gpu) -> None:
        cpu_ids = self._distinct(self.swapped.get(s.seq_id, []) for s in seqs)
        to_gpu = {c: self.pool.allocate() for c in cpu_ids}  # ref_cnt 1 each
        copy_to_gpu(cpu_ids, [to_gpu[c].block_id for c in cpu_ids])
        first_use = set(cpu_ids)
        for s in seqs:
            table = []
            for c in self.swapped.pop(s.seq_id):
                if c in first_use:
                    first_use.discard(c)
                else:
                    self.pool.touch(to_gpu[c])  # a sibling already holds it: share again
                table.append(to_gpu[c])
                self._release_cpu(c)
            self.tables[s.seq_id] = table

    def _release_cpu(self, cpu_block: int) -> None:
        self.cpu_ref[cpu_block] -= 1
        if self.cpu_ref[cpu_block] == 0:
            del self.cpu_ref[cpu_block]
            self.cpu_free.append(cpu_block)

    # -- addressing and accounting ------------------------------------------------------
    def block_ids(self, seq) -> list[int]:
        return [b.block_id for b in self.tables.get(seq.seq_id, ())]

    def slot_mapping(self, seq, start: int, end: int) -> list[int]:
        table, bs = self.tables[seq.seq_id], self.block_size
        return [table[p // bs].block_id * bs + p % bs for p in range(start, end)]

    def stats(self) -> dict:
        """Counters are O(1); the sharing figures scan every table and block (call on demand, not per step)."""
        used = self.pool.num_blocks - self.pool.num_free
        return {
            "kv_num_blocks": self.pool.num_blocks,
            "kv_block_size": self.block_size,
            "kv_blocks_used": used,
            "kv_blocks_free": self.pool.num_free,
            "kv_cache_usage": self.usage,
            "kv_blocks_shared": sum(1 for b in self.pool.blocks if b.ref_cnt > 1),
            "kv_blocks_cached": self.pool.num_cached,
            # without sharing every table would own its blocks: the sum of table lengths
            "kv_blocks_unshared": sum(len(blocks) for blocks in self.tables.values()),
            "cow_copies": self.num_cow_copies,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            "prefix_cache_evictions": self.pool.num_evictions,
        }
