"""Stage 2 checks: the block allocator, growing a block table, slot mapping, and the block-table gather.

References are tinypaged's own code: ``BlockPool`` (wrapped in a thin ``BlockAllocator`` below, since
the engine's pool hands out ``Block`` objects), ``attention.slot_mapping`` and ``attention.gather_kv``.
"""

from __future__ import annotations

import random
from collections import deque

import torch

from tinypaged import attention
from tinypaged.block_manager import blocks_needed
from tinypaged.checks import register


class BlockAllocator:
    """Reference allocator for the exercise: block ids from a FIFO free queue. (Stage 2 has no prefix
    cache; the engine's ``BlockPool`` adds hashes, and puts freed blocks without one at the head.)"""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got num_blocks={num_blocks}")
        self.queue = deque(range(num_blocks))
        self.is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.queue)

    def allocate(self) -> int:
        """The id of the block at the head of the free queue; raises when none is free."""
        if not self.queue:
            raise RuntimeError("no free KV blocks")
        block = self.queue.popleft()
        self.is_free[block] = False
        return block

    def free(self, block_id: int) -> None:
        """Return a block to the tail of the free queue; freeing a free block raises."""
        if self.is_free[block_id]:
            raise RuntimeError(f"double free of block {block_id}")
        self.is_free[block_id] = True
        self.queue.append(block_id)


def allocate_for(table: list[int], num_tokens: int, block_size: int, allocator) -> bool:
    """Reference: grow ``table`` to hold ``num_tokens`` tokens, one block at a time, or change nothing."""
    need = blocks_needed(num_tokens, block_size) - len(table)
    if need > allocator.num_free:
        return False
    for _ in range(max(need, 0)):
        table.append(allocator.allocate())
    return True


def _raises(fn) -> bool:
    try:
        fn()
    except (AssertionError, NotImplementedError):
        raise
    except Exception:
        return True
    return False


@register("02", "BlockAllocator", reference=lambda: BlockAllocator)
def check_block_allocator(cls) -> None:
    a = cls(4)
    assert a.num_free == 4, f"a fresh BlockAllocator(4) should have 4 free blocks, num_free is {a.num_free}"
    got = [a.allocate() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3], f"4 allocations from 4 blocks should return ids 0..3 once each, got {got}"
    assert got == [0, 1, 2, 3], f"a fresh free queue hands out blocks in id order (FIFO), got {got}"
    assert a.num_free == 0, f"after allocating every block num_free should be 0, got {a.num_free}"
    assert _raises(a.allocate), "allocate() with no free block must raise, not return a block twice"
    a.free(2)
    a.free(0)
    assert a.num_free == 2, f"after freeing 2 blocks num_free should be 2, got {a.num_free}"
    assert _raises(lambda: a.free(2)), "freeing a block that is already free (double free) must raise"
    nxt = [a.allocate(), a.allocate()]
    assert nxt == [2, 0], f"freed blocks join the tail of the queue, so they come back in the order freed: " \
                          f"expected [2, 0], got {nxt}"
    # Random workout against a model of the queue.
    rng = random.Random(2)
    a = cls(8)
    queue, owned = list(range(8)), set()
    for step in range(200):
        if owned and (not queue or rng.random() < 0.45):
            b = rng.choice(sorted(owned))
            a.free(b)
            owned.remove(b)
            queue.append(b)
        else:
            b = a.allocate()
            assert b == queue[0], f"step {step}: expected block {queue[0]} (head of the free queue), got {b}"
            queue.pop(0)
            owned.add(b)
        assert a.num_free == len(queue), f"step {step}: num_free is {a.num_free}, expected {len(queue)}"


@register("02", "allocate_for", reference=lambda: allocate_for)
def check_allocate_for(fn) -> None:
    alloc = BlockAllocator(6)
    table: list[int] = []
    assert fn(table, 1, 4, alloc) is True, "allocate_for should return True when the blocks were found"
    assert table == [0], f"1 token with block_size 4 needs 1 block: table should be [0], got {table}"
    assert fn(table, 4, 4, alloc) is True and table == [0], \
        f"4 tokens still fit in 1 block of 4: the table should stay [0], got {table}"
    assert fn(table, 5, 4, alloc) is True and table == [0, 1], \
        f"the 5th token needs a second block: expected [0, 1], got {table}"
    other: list[int] = []
    assert fn(other, 9, 4, alloc) is True and other == [2, 3, 4], \
        f"9 tokens need ceil(9/4) = 3 blocks: expected [2, 3, 4], got {other}"
    before = (list(table), alloc.num_free)
    ok = fn(table, 16, 4, alloc)  # needs 2 more, only 1 free
    assert ok is False, "allocate_for must return False when there are not enough free blocks"
    assert (table, alloc.num_free) == before, \
        f"a failed allocate_for must change nothing: table {before[0]} -> {table}, " \
        f"free {before[1]} -> {alloc.num_free} (check before you allocate)"
    assert fn(table, 12, 4, alloc) is True and table == [0, 1, 5], f"expected [0, 1, 5], got {table}"
    rng = random.Random(0)
    for bs in (1, 3, 16):
        alloc = BlockAllocator(160)
        t: list[int] = []
        n = 0
        for _ in range(20):
            n += rng.randint(0, 7)
            assert fn(t, n, bs, alloc) is True, f"{n} tokens with block_size {bs} fit in 160 blocks, but got False"
            assert len(t) == blocks_needed(n, bs), f"{n} tokens with block_size {bs} need {blocks_needed(n, bs)} blocks, table has {len(t)}"
        assert len(set(t)) == len(t), f"a block appears twice in one table: {t}"


@register("02", "slot_mapping", reference=lambda: attention.slot_mapping)
def check_slot_mapping(fn) -> None:
    got = [int(s) for s in fn([7, 2, 9], list(range(10)), 4)]
    want = [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    assert got == want, f"block table [7, 2, 9], block_size 4, positions 0..9: expected {want}, got {got}"
    got = [int(s) for s in fn([5], [0, 1, 2], 16)]
    assert got == [80, 81, 82], f"block table [5], block_size 16: positions 0, 1, 2 are slots 80, 81, 82, got {got}"
    got = [int(s) for s in fn([3, 1], [5, -1, -1], 4)]
    assert got == [5, -1, -1], f"negative positions are padding and map to slot -1: expected [5, -1, -1], got {got}"
    rng = random.Random(1)
    for bs in (1, 2, 16):
        table = rng.sample(range(100), 12)
        pos = [rng.randrange(12 * bs) for _ in range(30)]
        want = [table[p // bs] * bs + p % bs for p in pos]
        got = [int(s) for s in fn(table, pos, bs)]
        assert got == want, f"block_size {bs}, table {table}: positions {pos[:5]}... expected {want[:5]}..., got {got[:5]}..."
    table = [4, 0, 2]
    slots = [int(s) for s in fn(table, list(range(12)), 4)]
    assert len(set(slots)) == 12, f"different positions of one sequence must get different slots, got {slots}"


@register("02", "gather_kv", reference=lambda: attention.gather_kv)
def check_gather_kv(fn) -> None:
    g = torch.Generator().manual_seed(0)
    num_blocks, bs, kvh, d = 10, 4, 2, 3
    cache = torch.randn(num_blocks, bs, kvh, d, generator=g, dtype=torch.float64)
    for table, n in (([7, 2, 9], 10), ([3], 1), ([0, 1], 8), ([5, 8, 1, 4], 13)):
        out = fn(cache, table, n)
        assert isinstance(out, torch.Tensor), f"gather_kv should return a tensor, got {type(out).__name__}"
        assert tuple(out.shape) == (n, kvh, d), \
            f"table {table}, context_len {n}: expected shape {(n, kvh, d)}, got {tuple(out.shape)}"
        want = torch.stack([cache[table[j // bs], j % bs] for j in range(n)])
        if not torch.equal(out, want):
            bad = next(j for j in range(n) if not torch.equal(out[j], want[j]))
            assert False, f"table {table}, context_len {n}: key {bad} should come from block {table[bad // bs]}, " \
                          f"row {bad % bs} (block_table[j // block_size], j % block_size)"
    table = torch.tensor([6, 3, 0], dtype=torch.int32)
    out = fn(cache, table, 9)
    want = torch.cat([cache[6], cache[3], cache[0, :1]])
    assert torch.equal(out, want), "gather_kv should accept a block table given as an int32 tensor"
