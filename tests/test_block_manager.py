"""Stage 2: the block allocator (BlockManager without prefix caching), by property-based testing.

A hypothesis state machine runs random allocate / append / free sequences over several sequences
and checks the allocator's invariants after every step. Then: the slot-mapping formula, the
"False and no change" contract of allocate_slots, and that each stage-2 check rejects broken code.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tinypaged.course import checks
from tinypaged.attention.backends import gather_kv, paged_context_slots, slot_mapping
from tinypaged.kv.block_manager import BlockManager


class FakeSeq:
    """What BlockManager reads from a sequence: an id and its progress (the manager owns the table)."""

    _next = 0

    def __init__(self):
        FakeSeq._next += 1
        self.seq_id = 10_000 + FakeSeq._next
        self.num_computed_tokens = 0
        self.token_ids: list[int] = []

    def __len__(self):
        return self.num_computed_tokens


def ceil_div(a, b):
    return -(-a // b)


def snapshot(bm: BlockManager):
    return (list(bm.allocator.queue), {k: list(v) for k, v in bm.tables.items()}, dict(bm.refcounts))


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.seqs: list[FakeSeq] = []

    def _grow(self, seq: FakeSeq, n: int) -> None:
        before = snapshot(self.bm)
        table_before = self.bm.block_ids(seq)
        fits = ceil_div(seq.num_computed_tokens + n, self.bm.block_size) - len(table_before) <= self.bm.num_free_blocks
        ok = self.bm.allocate_slots(seq, n)
        assert ok == fits, f"allocate_slots returned {ok} but the blocks {'fit' if fits else 'do not fit'}"
        if ok:
            seq.num_computed_tokens += n
            assert self.bm.block_ids(seq)[:len(table_before)] == table_before, "growing a table must not move its old blocks"
        else:
            assert snapshot(self.bm) == before and self.bm.block_ids(seq) == table_before, \
                "a failed allocate_slots changed the allocator's state"

    @rule(n=st.integers(1, 40))
    def add_sequence(self, n):
        seq = FakeSeq()
        self._grow(seq, n)
        if seq.num_computed_tokens:
            self.seqs.append(seq)
        else:
            assert seq.seq_id not in self.bm.tables or not self.bm.tables[seq.seq_id]
            self.bm.free(seq)  # drop the empty table entry a failed first allocation may leave

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), n=st.integers(1, 20))
    def append(self, i, n):
        self._grow(self.seqs[i % len(self.seqs)], n)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        seq = self.seqs.pop(i % len(self.seqs))
        self.bm.free(seq)
        assert self.bm.block_ids(seq) == []

    @invariant()
    def every_block_accounted_for(self):
        owned = [b for blocks in self.bm.tables.values() for b in blocks]
        assert len(owned) == len(set(owned)), f"a block is owned twice without sharing: {sorted(owned)}"
        free = set(self.bm.allocator.queue)
        assert not free & set(owned), f"blocks both free and owned: {free & set(owned)}"
        assert len(free) + len(owned) == self.bm.num_blocks, "free + referenced must equal num_blocks"
        for b in range(self.bm.num_blocks):
            assert self.bm.ref_count(b) == (0 if b in free else 1)

    @invariant()
    def tables_hold_exactly_ceil_length(self):
        for seq in self.seqs:
            assert len(self.bm.block_ids(seq)) == ceil_div(seq.num_computed_tokens, self.bm.block_size)

    @invariant()
    def slots_are_distinct_and_in_range(self):
        seen = set()
        cap = self.bm.capacity_tokens
        for seq in self.seqs:
            for s in self.bm.slot_mapping(seq, 0, seq.num_computed_tokens):
                assert 0 <= s < cap and s not in seen, f"slot {s} reused or out of range"
                seen.add(s)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.seqs:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked after every request finished"
        assert not self.bm.tables


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestAllocator = AllocatorMachine.TestCase


def test_slot_mapping_formula():
    assert slot_mapping([7, 2, 9], range(10), 4) == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    bm = BlockManager(4, 4)
    a, b = FakeSeq(), FakeSeq()
    bm.allocate_slots(a, 4)
    bm.allocate_slots(b, 6)  # b gets blocks 1 and 2
    assert bm.slot_mapping(b, 0, 6) == slot_mapping(bm.block_ids(b), range(6), 4) == [4, 5, 6, 7, 8, 9]
    assert slot_mapping([7, 2, 9], [0, -1], 4) == [28, -1]
    slots = paged_context_slots(torch.tensor([[7, 2, 9]]), 10, 4)[0].tolist()
    assert slots == slot_mapping([7, 2, 9], range(10), 4)


def test_gather_kv_matches_flat_slots():
    cache = torch.arange(8 * 4 * 2 * 3, dtype=torch.float64).view(8, 4, 2, 3)
    table = [5, 0, 3]
    flat = cache.view(-1, 2, 3)
    slots = slot_mapping(table, range(11), 4)
    assert torch.equal(gather_kv(cache, table, 11), flat[slots])


def test_allocate_slots_false_without_change_when_blocks_run_out():
    bm = BlockManager(4, 4)
    a, b = FakeSeq(), FakeSeq()
    assert bm.allocate_slots(a, 9)  # 3 blocks
    a.num_computed_tokens = 9
    before = snapshot(bm)
    assert not bm.allocate_slots(b, 5)  # needs 2, 1 free
    assert snapshot(bm) == before and bm.block_ids(b) == []
    assert not bm.allocate_slots(a, 8)  # 17 tokens need 5 blocks
    assert snapshot(bm) == before and bm.block_ids(a) == [0, 1, 2]
    assert bm.allocate_slots(a, 4)  # 13 tokens: one more block, the last one
    assert bm.block_ids(a) == [0, 1, 2, 3] and bm.num_free_blocks == 0


@pytest.mark.parametrize("caching,want", [(False, [3, 4, 5, 1, 0]), (True, [0, 1, 3, 4, 5])])
def test_where_freed_blocks_go(caching, want):
    """vLLM v1's free_blocks: without prefix caching every freed block joins the tail (first in, first out,
    as stage 2's allocator); with it, a freed block holding no cached prefix goes to the head instead."""
    bm = BlockManager(6, 2, enable_prefix_caching=caching)
    a, b = FakeSeq(), FakeSeq()  # FakeSeq knows no tokens: its blocks are never hashed
    bm.allocate_slots(a, 4)
    bm.allocate_slots(b, 2)
    bm.free(a)  # blocks 1 then 0 (tail first)
    c = FakeSeq()
    bm.allocate_slots(c, 10)
    assert bm.block_ids(c) == want


# -- the notebook checks reject broken implementations ------------------------------------------

class FifoAllocator:
    """A correct learner-style allocator (not the package's), so the broken ones below differ by one bug."""

    def __init__(self, num_blocks):
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.queue, self.is_free = list(range(num_blocks)), [True] * num_blocks

    @property
    def num_free(self):
        return len(self.queue)

    def allocate(self):
        if not self.queue:
            raise RuntimeError("no free blocks")
        block = self.queue.pop(0)
        self.is_free[block] = False
        return block

    def free(self, block_id):
        if self.is_free[block_id]:
            raise RuntimeError(f"double free of block {block_id}")
        self.is_free[block_id] = True
        self.queue.append(block_id)


class LifoAllocator(FifoAllocator):
    def free(self, block_id):  # a stack, not a queue: freed blocks come straight back
        super().free(block_id)
        self.queue.insert(0, self.queue.pop())


class ForgivingAllocator(FifoAllocator):
    def free(self, block_id):  # double free silently accepted
        if not self.is_free[block_id]:
            super().free(block_id)


def test_stage02_checks_accept_a_correct_allocator():
    assert checks.evaluate("block_allocator", FifoAllocator)[0] == checks.PASS


class GreedyTables:
    """Block tables that allocate until the allocator runs dry: a failed call leaves a partial change."""

    def __init__(self, allocator, block_size):
        self.allocator, self.block_size, self.tables = allocator, block_size, {}

    def allocate_slots(self, seq_id, num_tokens):
        table = self.tables.setdefault(seq_id, [])
        while len(table) < -(-num_tokens // self.block_size):
            if self.allocator.num_free == 0:
                return False
            table.append(self.allocator.allocate())
        return True

    def block_ids(self, seq_id):
        return list(self.tables.get(seq_id, []))

    def free(self, seq_id):
        for b in reversed(self.tables.pop(seq_id, [])):
            self.allocator.free(b)

    def slots(self, seq_id, positions):
        t = self.tables.get(seq_id, [])
        return [t[p // self.block_size] * self.block_size + p % self.block_size for p in positions]


class HeadFirstTables(GreedyTables):
    def allocate_slots(self, seq_id, num_tokens):
        need = -(-num_tokens // self.block_size) - len(self.tables.get(seq_id, []))
        if need > self.allocator.num_free:
            return False
        return super().allocate_slots(seq_id, num_tokens)

    def free(self, seq_id):  # frees head first, not tail first
        for b in self.tables.pop(seq_id, []):
            self.allocator.free(b)


BROKEN = {
    "block_allocator": [LifoAllocator, ForgivingAllocator],
    "block_tables": [GreedyTables, HeadFirstTables],
    "slot_mapping": [
        lambda t, pos, bs: [t[p // bs] + p % bs for p in pos],  # forgot to scale by block_size
        lambda t, pos, bs: [t[p // bs] * bs + p % bs for p in pos if p >= 0],  # drops padding
        lambda t, pos, bs: [p for p in pos],  # ignores the table (contiguous thinking)
    ],
    "gather_kv": [
        lambda cache, t, n: cache.reshape(-1, *cache.shape[2:])[:n],  # ignores the table
        lambda cache, t, n: cache[torch.as_tensor(t, dtype=torch.long)].reshape(-1, *cache.shape[2:]),  # no trim
        lambda cache, t, n: cache[torch.as_tensor(t, dtype=torch.long)[torch.arange(n) % len(t)], torch.arange(n) % cache.shape[1]],
    ],
}


@pytest.mark.parametrize("name,broken", [(n, b) for n, bs in BROKEN.items() for b in bs])
def test_stage02_checks_reject_broken_code(name, broken):
    status, msg = checks.evaluate(name, broken)
    assert status == checks.FAIL, f"{name} accepted a broken implementation"
    assert "AttributeError" not in msg and "reference implementation" not in msg, msg  # for the bug it has


def test_stage02_checks_say_not_implemented():
    def todo(*args, **kwargs):
        raise NotImplementedError("not implemented yet")

    class TodoAllocator:
        def __init__(self, num_blocks):
            raise NotImplementedError("not implemented yet")

    assert checks.evaluate("block_allocator", TodoAllocator)[0] == checks.TODO
    for name in ("slot_mapping", "gather_kv"):
        assert checks.evaluate(name, todo)[0] == checks.TODO


def test_stage02_checks_registered_for_the_notebook():
    targets = {c.target for c in checks.checks_for_stage("02")}
    assert {"BlockAllocator", "BlockTables", "slot_mapping", "gather_kv"} <= targets


# -- the engine's manager is built from the lesson's parts; other parts drop in through BlockManager.factory --
def test_paged_attention_reference_matches_the_kernels_reference():
    """Stage 2's torch decode (``attention.backends.paged_attention``) equals tinypaged.kernels' reference."""
    from tinypaged.attention.backends import paged_attention
    from tinypaged.kernels import paged_attention_reference
    from tinypaged.lab.kernel_lab import random_paged_batch

    for lens, h, kvh, bs in (([5], 2, 2, 4), ([1, 8, 13], 4, 2, 4), ([20, 3, 9], 9, 3, 8)):
        q, kc, vc, tables, seq_lens = random_paged_batch(lens, h, kvh, 8, bs, dtype=torch.float64, seed=len(lens))
        assert torch.allclose(paged_attention(q, kc, vc, tables, seq_lens, 0.3),
                              paged_attention_reference(q, kc, vc, tables, seq_lens, 0.3), atol=1e-12)


def test_gather_kv_reads_a_batch_of_tables_at_once():
    cache = torch.randn(8, 4, 2, 3, dtype=torch.float64)
    tables = torch.tensor([[3, 1, 0], [6, 2, 5]])
    both = gather_kv(cache, tables, 9)
    assert both.shape == (2, 9, 2, 3)
    assert torch.equal(both[0], gather_kv(cache, [3, 1, 0], 9)) and torch.equal(both[1], gather_kv(cache, [6, 2, 5], 9))


def test_factory_runs_the_given_parts_and_nothing_changes():
    """A learner's allocator and tables (here: the package's, counting their calls) serve through
    ``LLM(kv_cache_manager=BlockManager.factory(...))``: same tokens, and every block went through them."""
    from tinypaged import LLM, SamplingParams
    from tinypaged.kv.block_manager import BlockTables
    from tinypaged.kv.block_pool import BlockAllocator

    calls = {"allocate": 0, "free": 0, "allocate_slots": 0}

    class Allocator(BlockAllocator):
        def allocate(self):
            calls["allocate"] += 1
            return super().allocate()

        def free(self, block_id):
            calls["free"] += 1
            super().free(block_id)

    class Tables(BlockTables):
        def allocate_slots(self, seq_id, num_tokens):
            calls["allocate_slots"] += 1
            return super().allocate_slots(seq_id, num_tokens)

    kw = dict(model="tiny", dtype="float64", device="cpu", block_size=4, num_gpu_blocks_override=32)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 9, 14)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, greedy)]
    llm = LLM(**kw, kv_cache_manager=BlockManager.factory(BlockAllocator=Allocator, BlockTables=Tables))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    kv = llm.llm_engine.kv
    assert type(kv.allocator) is Allocator and type(kv.block_tables) is Tables
    assert calls["allocate"] == calls["free"] > 0 and calls["allocate_slots"] > 0 and kv.usage == 0


def test_factory_refuses_an_unknown_part_before_any_work():
    with pytest.raises(TypeError, match="no part 'Allocator'.*BlockAllocator"):
        BlockManager.factory(Allocator=object)
    with pytest.raises(TypeError, match="no part 'fork_table'"):
        BlockManager(4, 4, fork_table=lambda t, r: t)
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(0, 4)
