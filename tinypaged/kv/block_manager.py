"""Stages 2 and 3: the paged KV cache's memory manager (PagedAttention's "virtual memory").

The KV cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots (``tinypaged.kv.block_pool``).
A sequence owns a *block table*: logical block i (its tokens ``i*block_size`` .. ``(i+1)*block_size - 1``)
lives in physical block ``block_table[i]``; token p's slot is ``attention.slot_mapping``'s
``block_table[p // block_size] * block_size + p % block_size``.

The pieces are the assignments' answers, in the shape they ask for: ``BlockTables`` (stage 2), and
``fork_table``, ``append_slot``, ``free_table`` and ``longest_cached_prefix`` (stage 3), which take a
``BlockPool`` where the exercises take a ``refcounts`` dict and an allocator (``BlockPool(allocator,
refcounts=refcounts)`` is that pair). ``BlockManager`` runs them for the engine.

Invariants (checked by the property tests):

* A block is either free (in the pool's queue) or held by ``ref_count`` block tables, never both.
* Blocks are allocated one at a time as a sequence grows, never reserved up front, so the only waste is
  the unfilled tail of each sequence's last block.
* Sharing (stage 3): ``fork`` gives a child the parent's table and bumps each block's count. A block is
  written only when one table holds it: before a sequence appends into a shared, partially filled
  block, it gets a private copy (copy-on-write).
* Prefix caching (stage 3; hash-and-LRU caching as in vLLM since 2024, not the paper's reserved shared
  prefixes): a block's hash is registered once the block is *full* of known tokens. Freed blocks keep
  it (``BlockPool``'s LRU); sequences free their blocks tail first, so the ends of prefix chains are
  evicted before their beginnings. Lookups are capped at ``len(seq) - 1`` tokens, and the hit rate
  (``record_prefix_lookup``) is counted in tokens, only while prefix caching is on.
* Ownership: this manager alone owns block tables and reference counts (``block_ids(seq)`` reads them).
  It never changes a sequence: the scheduler owns ``num_computed_tokens``.
"""

from __future__ import annotations

from tinypaged.attention.backends import slot_mapping
# ROOT_HASH and hash_block_tokens are re-exported: lessons and tests import them from here
from tinypaged.kv.block_pool import ROOT_HASH, BlockPool, blocks_needed, hash_block_tokens, hash_chain  # noqa: F401
from tinypaged.kv.swap_space import SwapSpace


# -- stage 3: one table at a time ----------------------------------------------------------------------
def fork_table(table: list[int], pool) -> list[int]:
    """The child's table: the same blocks, each held by one more table. Nothing is copied."""
    for b in table:
        pool.touch(b)
    return list(table)


def append_slot(table: list[int], num_tokens: int, block_size: int, pool):
    """Make room for the token at position ``num_tokens`` (the table holds ``num_tokens`` tokens); return
    ``(src, dst)`` when a shared, partly filled last block must be copied first (copy-on-write), else None."""
    if num_tokens % block_size == 0:
        table.append(pool.allocate())
        return None
    last = table[-1]
    if pool.ref_count(last) == 1:
        return None  # ours alone: write in place
    private = pool.allocate()
    pool.free(last)  # this table's reference moves to the copy; the others keep the shared block
    table[-1] = private
    return (last, private)


def free_table(table: list[int], pool) -> None:
    """Drop this table's references, tail first (the ends of prefix chains are evicted first)."""
    for b in reversed(table):
        pool.free(b)
    table.clear()


def longest_cached_prefix(token_ids, block_size: int, cache, extra_keys=None) -> list[int]:
    """Block ids of the longest run of cached full blocks from the start, capped at len - 1 tokens (the
    last prompt token must run through the model so there are logits to sample from)."""
    hit = []
    for h in hash_chain(token_ids[: len(token_ids) - 1], block_size, extra_keys):
        b = cache.lookup(h)
        if b is None:
            break
        hit.append(b)
    return hit


# -- stage 2: a block table per sequence -------------------------------------------------------------
class BlockTables:
    """One block table per sequence (any hashable id), grown a block at a time, all or nothing, from
    ``allocator`` (anything with ``allocate()``, ``free(block_id)`` and ``num_free``)."""

    def __init__(self, allocator, block_size: int):
        self.allocator, self.block_size = allocator, block_size
        self.tables: dict = {}

    def block_ids(self, seq_id) -> list[int]:
        return list(self.tables.get(seq_id, ()))

    def allocate_slots(self, seq_id, num_tokens: int) -> bool:
        """Make the table hold ``num_tokens`` tokens in total; False (and no change) if blocks are short."""
        table = self.tables.get(seq_id, [])
        need = blocks_needed(num_tokens, self.block_size) - len(table)
        if need > self.allocator.num_free:
            return False
        self.tables[seq_id] = table
        for _ in range(need):
            table.append(self.allocator.allocate())
        return True

    def free(self, seq_id) -> None:
        free_table(self.tables.pop(seq_id, []), self.allocator)

    def slots(self, seq_id, positions) -> list[int]:
        return slot_mapping(self.tables.get(seq_id, []), positions, self.block_size)


class BlockManager:
    """Block tables for sequences: allocation as they grow, sharing, copy-on-write, prefix caching.

    Implements ``tinypaged.interfaces.KVCacheManager``. ``copy_block(src, dst)`` and the swap callbacks
    are supplied by the engine: they move the actual tensors. The manager only decides *which* blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 copy_block=None, num_cpu_blocks: int = 0, max_model_len: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.block_tables = BlockTables(self.pool, block_size)
        self.tables = self.block_tables.tables  # seq_id -> its block ids (logical order)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.copy_block = copy_block or (lambda src, dst: None)
        self.hashes: dict[int, list[bytes]] = {}  # seq_id -> hashes of its full blocks, as far as known
        self.swap = SwapSpace(num_cpu_blocks)
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

    def max_tokens_needed(self, seq) -> int:
        """Blocks are allocated as a sequence grows: it never needs room for more than its longest length."""
        return seq.max_total_tokens(self.max_model_len or len(seq) + (seq.params.max_tokens or 0))

    # -- prefix caching -----------------------------------------------------------------
    def get_computed_blocks(self, seq) -> list[int]:
        """The longest cached prefix of ``seq``'s known tokens, in whole blocks (none while it holds blocks)."""
        if not self.enable_prefix_caching or self.tables.get(seq.seq_id):
            return []
        return longest_cached_prefix(seq.token_ids, self.block_size, self.pool, getattr(seq, "extra_keys", None))

    def record_prefix_lookup(self, seq, num_hit_tokens: int) -> None:
        """Count a new request's lookup, in tokens (vLLM's hit rate); nothing when caching is off."""
        if not self.enable_prefix_caching:
            return
        self.prefix_queries += len(seq)
        self.prefix_hits += num_hit_tokens

    def _register_full_blocks(self, seq, num_tokens: int) -> None:
        """Publish the hash of every block this step fills: its tokens are known, its KV is written by this
        step's forward before any later step (or later attention layer) can read it. Hashes are memoised
        per sequence while it holds blocks."""
        known = self.hashes.get(seq.seq_id, [])
        full = min(num_tokens, len(seq)) // self.block_size
        if full <= len(known):
            return
        hashes = self.hashes[seq.seq_id] = hash_chain(seq.token_ids[: full * self.block_size], self.block_size,
                                                      getattr(seq, "extra_keys", None), known)
        table = self.tables[seq.seq_id]
        for i in range(len(known), full):
            if self.pool.hash_of.get(table[i]) is None:
                self.pool.register(table[i], hashes[i])

    # -- allocation ---------------------------------------------------------------------
    def _copy_on_write(self, table: list[int], start: int) -> bool:
        """Does the token at ``start`` land in the table's last block while another table shares it?"""
        return start % self.block_size != 0 and len(table) == blocks_needed(start, self.block_size) \
            and self.pool.ref_count(table[-1]) > 1

    def can_allocate(self, seq, num_new_tokens: int, computed_blocks=()) -> bool:
        table = self.tables.get(seq.seq_id, ())
        start = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        need = blocks_needed(start + num_new_tokens, self.block_size) - len(table) - len(computed_blocks)
        if num_new_tokens and self._copy_on_write(table, start):
            need += 1
        if computed_blocks:  # cached blocks sitting in the free queue stop being free once taken
            return max(need, 0) + sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0) <= self.pool.num_free
        return need <= self.pool.num_free

    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks=()) -> bool:
        """Make room for ``num_new_tokens`` tokens of ``seq`` after its computed ones; False (and no change)
        if blocks are short. ``computed_blocks`` (from ``get_computed_blocks``) join the table first: the
        new tokens start after them. ``seq`` itself is not changed (the scheduler advances its progress)."""
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        table = self.tables.setdefault(seq.seq_id, [])
        for block in computed_blocks:
            self.pool.touch(block)
            table.append(block)
        start = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        end = start + num_new_tokens
        if num_new_tokens and len(table) == blocks_needed(start, self.block_size):
            copy = append_slot(table, start, self.block_size, self.pool)  # the first new token's block
            if copy is not None:
                self.copy_block(*copy)  # done now, before the forward reads it
                self.num_cow_copies += 1
        if len(table) < blocks_needed(end, self.block_size):
            self.block_tables.allocate_slots(seq.seq_id, end)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, end)
        return True

    def fork(self, parent, child) -> None:
        """``child`` shares every block of ``parent`` (reference counts go up; nothing is copied)."""
        self.tables[child.seq_id] = fork_table(self.tables.get(parent.seq_id, []), self.pool)
        self.hashes[child.seq_id] = list(self.hashes.get(parent.seq_id, []))

    def free(self, seq) -> None:
        """Release ``seq``'s blocks, tail first (see the eviction-order invariant above)."""
        self.block_tables.free(seq.seq_id)
        self.hashes.pop(seq.seq_id, None)
        self.swap.drop(seq.seq_id)  # a swapped-out sequence that is aborted

    # -- swapping (preemption_mode="swap", vLLM v0; tinypaged.kv.swap_space) ------------------
    @property
    def cpu_free(self) -> list[int]:
        return self.swap.cpu_free

    def can_swap_out(self, seqs) -> bool:
        return self.swap.can_swap_out(self.tables.get(s.seq_id, []) for s in seqs)

    def swap_out(self, seqs, copy_to_cpu) -> None:
        self.swap.swap_out({s.seq_id: self.tables.get(s.seq_id, []) for s in seqs}, copy_to_cpu)
        for s in seqs:
            self.block_tables.free(s.seq_id)
            self.hashes.pop(s.seq_id, None)  # its blocks come back unhashed: registered again on growth

    def can_swap_in(self, seqs, num_new_tokens: int = 1) -> bool:
        """Room for the swapped blocks plus what each sequence's next ``num_new_tokens`` need (and a
        copy-on-write), so the allocation right after swapping in cannot fail."""
        grow = sum(max(blocks_needed(s.num_computed_tokens + num_new_tokens, self.block_size)
                       - len(self.swap.swapped.get(s.seq_id, [])), 0) + 1 for s in seqs)
        return len(self.swap.blocks_of([s.seq_id for s in seqs])) + grow <= self.pool.num_free

    def swap_in(self, seqs, copy_to_gpu) -> None:
        self.tables.update(self.swap.swap_in([s.seq_id for s in seqs], self.pool, copy_to_gpu))

    # -- addressing and accounting ------------------------------------------------------
    def block_ids(self, seq) -> list[int]:
        return self.block_tables.block_ids(seq.seq_id)

    def slot_mapping(self, seq, start: int, end: int) -> list[int]:
        return slot_mapping(self.tables[seq.seq_id], range(start, end), self.block_size)

    def stats(self) -> dict:
        """Counters are O(1); the sharing figures scan every table (call on demand, not per step)."""
        used = self.pool.num_blocks - self.pool.num_free
        return {
            "kv_num_blocks": self.pool.num_blocks,
            "kv_block_size": self.block_size,
            "kv_blocks_used": used,
            "kv_blocks_free": self.pool.num_free,
            "kv_cache_usage": self.usage,
            "kv_blocks_shared": sum(1 for c in self.pool.refcounts.values() if c > 1),
            "kv_blocks_cached": self.pool.num_cached,
            # without sharing every table would own its blocks: the sum of table lengths
            "kv_blocks_unshared": sum(len(blocks) for blocks in self.tables.values()),
            "cow_copies": self.num_cow_copies,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            "prefix_cache_evictions": self.pool.num_evictions,
        }
