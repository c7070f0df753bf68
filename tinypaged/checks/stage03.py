"""Stage 3 checks: reference counting with copy-on-write, and prefix-cache lookup by hash chain.

The learner's data structures are deliberately plain: a block table is a list of block ids,
``refcounts`` a dict from block id to the number of tables holding it, and ``allocator`` any object
with ``allocate() -> int`` and ``free(block_id)`` (stage 2's ``BlockAllocator``). The references
below are small versions of what ``tinypaged.block_manager.BlockManager`` does with ``Block``
objects (``fork``, the copy-on-write in ``allocate_slots``, ``free``, ``get_computed_blocks``).
"""

from __future__ import annotations

import random

from tinypaged.block_manager import hash_block_tokens, hash_chain
from tinypaged.checks import register


def fork(table: list[int], refcounts: dict[int, int]) -> list[int]:
    """The child's table: the same blocks, each held by one more table. Nothing is copied."""
    for b in table:
        refcounts[b] += 1
    return list(table)


def append_slot(table: list[int], num_tokens: int, block_size: int, refcounts: dict[int, int], allocator):
    """Make room for the token at position ``num_tokens``; return a ``(src, dst)`` copy or None.

    A full (or missing) last block means a new block. A partially filled last block shared with
    another table must not be written: take a fresh block, drop one reference to the shared one,
    and return the copy the engine must make before the forward (copy-on-write).
    """
    if num_tokens % block_size == 0:
        new = allocator.allocate()
        refcounts[new] = 1
        table.append(new)
        return None
    last = table[-1]
    if refcounts[last] == 1:
        return None  # ours alone: write in place
    new = allocator.allocate()
    refcounts[last] -= 1
    refcounts[new] = 1
    table[-1] = new
    return (last, new)


def free_table(table: list[int], refcounts: dict[int, int], allocator) -> None:
    """Drop this table's references, tail first; blocks nobody holds go back to the allocator."""
    for b in reversed(table):
        refcounts[b] -= 1
        if refcounts[b] == 0:
            del refcounts[b]
            allocator.free(b)
    table.clear()


def longest_cached_prefix(token_ids: list[int], block_size: int, cache: dict[bytes, int]) -> list[int]:
    """Block ids of the longest run of cached full blocks from the start, capped at len - 1 tokens."""
    hit = []
    for h in hash_chain(token_ids[: len(token_ids) - 1], block_size):
        if h not in cache:
            break
        hit.append(cache[h])
    return hit


class _Allocator:
    """A FIFO free queue of block ids (stage 2's allocator) that also counts what it hands out."""

    def __init__(self, n: int):
        self.queue = list(range(n))
        self.allocated = 0

    def allocate(self) -> int:
        if not self.queue:
            raise RuntimeError("no free blocks")
        self.allocated += 1
        return self.queue.pop(0)

    def free(self, block_id: int) -> None:
        assert block_id not in self.queue, f"block {block_id} was freed twice"
        self.queue.append(block_id)


@register("03", "fork", reference=lambda: fork)
def check_fork_table(fn) -> None:
    refs = {3: 1, 7: 1, 1: 2}
    table = [3, 7, 1]
    child = fn(table, refs)
    assert child == [3, 7, 1], f"the child's table lists the parent's blocks in order: expected [3, 7, 1], got {child}"
    assert child is not table, "return a new list: the child appends to its own table later"
    assert table == [3, 7, 1], f"fork must not change the parent's table, it became {table}"
    assert refs == {3: 2, 7: 2, 1: 3}, f"each block is now held by one more table: expected {{3: 2, 7: 2, 1: 3}}, got {refs}"
    child.append(9)
    assert table == [3, 7, 1], "appending to the child changed the parent's table: copy the list"
    assert fn([], {}) == [], "forking an empty table gives an empty table"


@register("03", "append_slot", reference=lambda: append_slot)
def check_append_slot(fn) -> None:
    bs = 4
    alloc = _Allocator(8)
    refs: dict[int, int] = {}
    table: list[int] = []
    for n in range(6):  # positions 0..5: blocks are taken when a position starts one
        out = fn(table, n, bs, refs, alloc)
        assert out is None, f"a private table never copies; position {n} returned {out}"
    assert table == [0, 1] and refs == {0: 1, 1: 1}, \
        f"6 tokens in blocks of 4 need blocks [0, 1] with one reference each; got table {table}, refcounts {refs}"
    child = fork(table, refs)  # both hold 6 tokens; block 1 is shared and partially filled
    out = fn(child, 6, bs, refs, alloc)
    assert out == (1, 2), f"writing position 6 into shared, partial block 1 must copy it to a fresh block: " \
                          f"expected (1, 2), got {out}"
    assert child == [0, 2], f"the writer's table now ends with its private copy: expected [0, 2], got {child}"
    assert refs == {0: 2, 1: 1, 2: 1}, f"block 1 lost the writer's reference, block 2 has one: expected " \
                                       f"{{0: 2, 1: 1, 2: 1}}, got {refs}"
    out = fn(table, 6, bs, refs, alloc)
    assert out is None and table == [0, 1], \
        f"the last holder of block 1 writes in place (no copy): got {out}, table {table}"
    before = alloc.allocated
    child2 = fork(table, refs)  # 7 tokens each after the write... a full block is never copied
    for t in (table, child2):
        t_out = fn(t, 8, bs, refs, alloc)
        assert t_out is None, f"position 8 starts a new block: nothing to copy, got {t_out}"
    assert alloc.allocated - before == 2 and table[:2] == child2[:2] and table[2] != child2[2], \
        f"at a block boundary each table takes its own new block and keeps sharing the full ones: {table}, {child2}"
    assert refs[0] == 3 and refs[1] == 2, f"full blocks stay shared: refcounts {refs}"
    # random workout against the reference
    rng = random.Random(3)
    a1, a2 = _Allocator(200), _Allocator(200)
    r1: dict[int, int] = {}
    r2: dict[int, int] = {}
    t1: list[list[int]] = [[]]
    t2: list[list[int]] = [[]]
    lens = [0]
    for step in range(150):
        i = rng.randrange(len(lens))
        if rng.random() < 0.15 and len(lens) < 6:
            t1.append(fork(t1[i], r1))
            t2.append(fork(t2[i], r2))
            lens.append(lens[i])
            continue
        got = fn(t1[i], lens[i], bs, r1, a1)
        want = append_slot(t2[i], lens[i], bs, r2, a2)
        assert got == want and t1 == t2 and r1 == r2, \
            f"step {step}: appending position {lens[i]} to table {i}: returned {got} (expected {want}), " \
            f"tables {t1} (expected {t2}), refcounts {r1} (expected {r2})"
        lens[i] += 1


@register("03", "free_table", reference=lambda: free_table)
def check_free_table(fn) -> None:
    alloc = _Allocator(0)
    refs = {4: 1, 5: 2, 6: 1}
    table = [4, 5, 6]
    fn(table, refs, alloc)
    assert alloc.queue == [6, 4], f"blocks nobody holds return to the free queue tail first: expected [6, 4], " \
                                  f"got {alloc.queue}"
    assert refs.get(5) == 1, f"block 5 is still held by another table: its refcount should be 1, got {refs.get(5)}"
    assert refs.get(4, 0) == 0 and refs.get(6, 0) == 0, f"freed blocks have no references left: {refs}"
    assert table == [], f"the freed table should be emptied, got {table}"


@register("03", "hash_chain", reference=lambda: hash_chain)
def check_hash_chain(fn) -> None:
    toks = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    got = fn(toks, 4)
    assert isinstance(got, list) and len(got) == 2, \
        f"10 tokens in blocks of 4 make 2 full blocks, so 2 hashes (a partial block is never hashed); got {got!r}"
    h0 = hash_block_tokens(None, [5, 6, 7, 8])
    assert got[0] == h0, "the first hash is hash_block_tokens(None, first block's tokens)"
    assert got[1] == hash_block_tokens(h0, [9, 10, 11, 12]), \
        "each later hash is hash_block_tokens(previous hash, this block's tokens): the chain"
    other = fn([0, 0, 0, 0, 9, 10, 11, 12], 4)
    assert other[1] != got[1], "the same block after a different prefix must hash differently"
    assert fn([1, 2, 3], 4) == [], "fewer tokens than a block: no hash"
    rng = random.Random(1)
    for _ in range(20):
        t = [rng.randrange(5) for _ in range(rng.randrange(30))]
        bs = rng.choice([1, 2, 3, 16])
        assert fn(t, bs) == hash_chain(t, bs), f"hash_chain({t}, {bs}) differs from the reference"


@register("03", "longest_cached_prefix", reference=lambda: longest_cached_prefix)
def check_longest_cached_prefix(fn) -> None:
    bs = 4
    cached = list(range(100, 112))  # a 12-token prompt that was computed into blocks 20, 21, 22
    cache = dict(zip(hash_chain(cached, bs), [20, 21, 22]))
    got = fn(cached[:8] + [1, 2, 3, 4, 5], bs, cache)
    assert got == [20, 21], f"the first two blocks match: expected [20, 21], got {got}"
    got = fn(cached + [7], bs, cache)
    assert got == [20, 21, 22], f"a 13-token prompt extending the cached 12 hits all 3 blocks, got {got}"
    got = fn(cached, bs, cache)
    assert got == [20, 21], "the same 12-token prompt again: the hit is capped at len - 1 = 11 tokens, so 2 blocks " \
                            f"(one token must still run through the model to give logits); got {got}"
    got = fn(cached[:3], bs, cache)
    assert got == [], f"a prompt shorter than a block can never hit, got {got}"
    got = fn([0] + cached[1:], bs, cache)
    assert got == [], f"a different first block misses, and so does everything after it (the chain), got {got}"
    partial = {k: v for k, v in cache.items() if v != 21}  # block 21 evicted: 22 is unreachable
    got = fn(cached + [7], bs, partial)
    assert got == [20], f"a hit stops at the first missing block, even if later ones are cached: expected [20], got {got}"
