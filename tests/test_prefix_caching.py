"""Stage 3: prefix caching gives the same tokens as recomputing, and the block manager's invariants hold."""

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tinypaged import LLM, SamplingParams
from tinypaged.kv.block_manager import BlockManager
from tinypaged.kv.block_pool import ROOT_HASH, hash_block_tokens
from tinypaged.sequence import Sequence


pytestmark = pytest.mark.usefixtures("one_thread")


BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=5)


def _llm(caching, blocks=64):
    return LLM(model="tiny", dtype="float64", device="cpu", block_size=BS, num_gpu_blocks_override=blocks,
               enable_prefix_caching=caching)


@pytest.fixture(scope="module")
def pair():
    return _llm(False), _llm(True)


def _run(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


SYSTEM = _prompt(0, 10)  # a shared 10-token prefix: two full blocks of 4, then 2 tokens
WORKLOADS = {
    # the same prompt twice in one batch and again later: full hits, capped so one token is computed
    "full_hits": [[_prompt(1, 12)] * 2, [_prompt(1, 12)]],
    # shared system prefix, different questions: partial hits
    "partial_hits": [[SYSTEM + _prompt(i, 3 + i) for i in range(4)], [SYSTEM + _prompt(9, 5)]],
    # prefixes shorter than one block: nothing to hit
    "short": [[_prompt(2, 3), _prompt(2, 3)[:2] + [7]], [_prompt(2, 3)]],
    # a mix that continues past the prompt (decode blocks get hashed too)
    "mixed": [[SYSTEM + [5, 6], _prompt(3, 16), SYSTEM], [_prompt(3, 16) + [8, 8, 8], SYSTEM + [5, 6, 7]]],
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_outputs_identical_with_and_without_caching(pair, name):
    off, on = pair
    for batch in WORKLOADS[name]:
        assert _run(on, batch) == _run(off, batch), f"{name}: prefix caching changed the tokens"
    for llm in pair:
        assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.num_blocks


def test_hit_counts_in_tokens():
    llm = _llm(True)
    p = _prompt(5, 12)  # 3 full blocks; the hit is capped at 11 tokens -> 2 blocks
    _run(llm, [p])
    m = llm.get_metrics()
    assert (m["prefix_cache_queries"], m["prefix_cache_hits"]) == (12, 0)
    out = llm.generate([{"prompt_token_ids": p}], GREEDY)[0]
    assert out.metrics.num_cached_tokens == 8
    m = llm.get_metrics()
    assert (m["prefix_cache_queries"], m["prefix_cache_hits"]) == (24, 8)
    assert m["prefix_cache_hit_rate"] == pytest.approx(8 / 24)
    _run(llm, [p[:9] + [1, 1, 1]])  # partial: 2 blocks shared
    assert llm.get_metrics()["prefix_cache_hits"] == 16


def test_prefix_shorter_than_a_block_never_hits():
    llm = _llm(True)
    p = _prompt(6, BS - 1)
    _run(llm, [p])
    _run(llm, [p, p])
    m = llm.get_metrics()
    assert m["prefix_cache_hits"] == 0 and m["prefix_cache_queries"] == 3 * (BS - 1)


def test_no_queries_counted_when_caching_is_off(pair):
    off, _ = pair
    _run(off, [SYSTEM + [1], SYSTEM + [2]])
    m = off.get_metrics()
    assert m["prefix_cache_queries"] == 0 and m["prefix_cache_hits"] == 0 and m["prefix_cache_hit_rate"] == 0.0


def test_stale_hashes_after_lru_eviction():
    """A small cache: later prompts reuse the freed blocks of the first; their old hashes must go."""
    off, on = _llm(False, blocks=10), _llm(True, blocks=10)
    first = _prompt(7, 12)
    seq = [[first], [_prompt(8, 14)], [_prompt(9, 14)], [first], [first[:8] + [4, 4, 4, 4]]]
    for batch in seq:
        assert _run(on, batch) == _run(off, batch)
    m = on.get_metrics()
    assert m["prefix_cache_evictions"] > 0
    kv = on.llm_engine.kv
    for h, holders in kv.allocator.index.items():
        assert holders and all(kv.allocator.hash_of[b] == h for b in holders)
    assert len(kv.allocator.hash_of) == sum(len(h) for h in kv.allocator.index.values())


def test_lru_order_and_tail_first_free():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    s = Sequence("a", list(range(12)), GREEDY)
    assert bm.allocate_slots(s, 12)
    table = bm.block_ids(s)
    bm.free(s)
    # freed tail first: the last block of the chain sits at the head side of the freed ones
    assert list(bm.allocator.queue)[-3:] == table[::-1]
    t = Sequence("b", list(range(12)), GREEDY)
    hit = bm.get_computed_blocks(t)
    assert hit == table[:2], "capped at len - 1 = 11 tokens: two blocks"
    assert bm.allocate_slots(t, 12 - 8, hit)
    assert bm.block_ids(t)[:2] == table[:2] and t.num_computed_tokens == 0, "the manager never changes seq"


def test_hash_chain():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(ROOT_HASH, (1, 2, 3, 4))
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8]), "the parent matters"
    assert hash_block_tokens(h1, [5, 6, 7, 8], extra_keys=("lora", 1)) != hash_block_tokens(h1, [5, 6, 7, 8])


# -- property tests ------------------------------------------------------------------------------
class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions (with cache hits), decodes, forks and frees; every slot's content is tracked.

    A fake KV cache records which token each slot holds; copy-on-write copies it and computing
    tokens writes it. Every live sequence must always read back its own tokens, whatever the
    sharing, caching and eviction did.
    """

    NUM_BLOCKS = 12

    def __init__(self):
        super().__init__()
        self.slots = {}
        self.bm = BlockManager(self.NUM_BLOCKS, BS, enable_prefix_caching=True, copy_block=self._copy)
        self.seqs = []

    def _copy(self, src, dst):
        for o in range(BS):
            if src * BS + o in self.slots:
                self.slots[dst * BS + o] = self.slots[src * BS + o]
            else:
                self.slots.pop(dst * BS + o, None)

    def _compute(self, seq):
        for pos in range(seq.num_computed_tokens, len(seq)):
            block = self.bm.tables[seq.seq_id][pos // BS]
            refs = self.bm.ref_count(block)
            assert refs == 1, f"writing into block {block} shared by {refs} tables"
            self.slots[self.bm.slot_mapping(seq, pos, pos + 1)[0]] = seq.token_ids[pos]
        seq.num_computed_tokens = len(seq)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, tokens):
        seq = Sequence("r", tokens, GREEDY)
        hit = self.bm.get_computed_blocks(seq)
        assert len(hit) * BS <= len(tokens) - 1
        if self.bm.allocate_slots(seq, len(tokens) - len(hit) * BS, hit):
            self.bm.record_prefix_lookup(seq, len(hit) * BS)
            seq.num_computed_tokens = len(hit) * BS  # the scheduler's job: cached tokens count as computed
            self._compute(seq)
            self.seqs.append(seq)
        else:
            assert not self.bm.tables.get(seq.seq_id), "a failed allocation must change nothing"

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 50), token=st.integers(0, 2))
    def decode(self, i, token):
        seq = self.seqs[i % len(self.seqs)]
        seq.output_token_ids.append(token)
        if self.bm.allocate_slots(seq, 1):
            self._compute(seq)
        else:
            seq.output_token_ids.pop()

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 50))
    def fork(self, i):
        parent = self.seqs[i % len(self.seqs)]
        child = parent.fork(len(self.seqs), None)
        self.bm.fork(parent, child)
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 50))
    def free(self, i):
        self.bm.free(self.seqs.pop(i % len(self.seqs)))

    @invariant()
    def ref_counts_equal_holders(self):
        holders = {}
        for blocks in self.bm.tables.values():
            for b in blocks:
                holders[b] = holders.get(b, 0) + 1
        for b in range(self.bm.num_blocks):
            refs = self.bm.ref_count(b)
            assert refs == holders.get(b, 0), f"block {b}: ref {refs}"
            in_queue = b in self.bm.allocator.queue
            assert in_queue == (refs == 0), f"block {b} free={in_queue} ref={refs}"

    @invariant()
    def index_points_at_matching_blocks(self):
        for h, holders in self.bm.allocator.index.items():
            for b in holders:
                assert self.bm.allocator.hash_of[b] == h

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq in self.seqs:
            slots = self.bm.slot_mapping(seq, 0, seq.num_computed_tokens)
            for pos, slot in enumerate(slots):
                assert self.slots.get(slot) == seq.token_ids[pos], f"seq {seq.seq_id} pos {pos}"

    def teardown(self):
        for seq in self.seqs:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.NUM_BLOCKS
        assert not self.bm.tables and not self.bm.hashes, "per-sequence state leaked"
        assert self.bm.prefix_hits <= self.bm.prefix_queries


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


def test_factory_runs_the_given_stage3_parts_with_prefix_caching():
    """Stage 3's parts (here: the package's, counting their calls) drop into the engine's manager: same
    tokens and the same hits as the built-in manager, and the engine called each of them."""
    from tinypaged.kv import block_manager as bm
    from tinypaged.kv.block_pool import PrefixCache, hash_chain

    calls = dict.fromkeys(["append_slot", "free_table", "hash_chain", "longest_cached_prefix", "register"], 0)

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call

    class Cache(PrefixCache):
        def register(self, block_id, block_hash):
            calls["register"] += 1
            super().register(block_id, block_hash)

    parts = dict(PrefixCache=Cache, append_slot=counted("append_slot", bm.append_slot),
                 free_table=counted("free_table", bm.free_table), hash_chain=counted("hash_chain", hash_chain),
                 longest_cached_prefix=counted("longest_cached_prefix", bm.longest_cached_prefix))
    shared = _prompt(7, 10)
    prompts = [shared + _prompt(8, 3), shared + _prompt(9, 5)]
    built_in = _llm(True)
    want = _run(built_in, prompts), _run(built_in, prompts)
    llm = LLM(model="tiny", dtype="float64", device="cpu", block_size=BS, num_gpu_blocks_override=64,
              enable_prefix_caching=True, kv_cache_manager=BlockManager.factory(**parts))
    assert (_run(llm, prompts), _run(llm, prompts)) == want
    assert llm.llm_engine.kv.stats()["prefix_cache_hits"] == built_in.llm_engine.kv.stats()["prefix_cache_hits"] > 0
    assert all(n > 0 for n in calls.values()), calls
