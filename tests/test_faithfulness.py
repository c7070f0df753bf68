"""Regression tests for places where tinypaged differed from vLLM (each failed before its fix).

min_tokens, stop strings inside the min_tokens window, max_num_seqs with n > 1, swap preemption and
sharing, the free queue's order, extra keys in prefix hashes, interrupted calls, argument errors,
and parallel sampling by fork (paper, v0) or fan-out (v1).
"""

import functools

import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.kv.block_manager import BlockManager
from tinypaged.worker.kv_cache import KVCacheTensors
from tinypaged.sequence import Sequence

pytestmark = pytest.mark.usefixtures("shared_weights", "one_thread")

PROMPT = {"prompt_token_ids": [11, 402, 9, 77, 1234, 5, 6]}


@functools.lru_cache(maxsize=None)
def tiny(**kw):
    kw = {"dtype": "float64", "device": "cpu", "block_size": 4, "max_model_len": 96,
          "num_gpu_blocks_override": 128, **kw}
    return LLM("tiny", **kw)


def greedy(llm, prompt=PROMPT, **kw):
    return llm.generate(prompt, SamplingParams(**{"temperature": 0, "max_tokens": 12, **kw}))[0].outputs[0]


# -- 1, 2: min_tokens ------------------------------------------------------------------------------
def test_min_tokens_suppresses_stop_token_ids():
    first = greedy(tiny(), ignore_eos=True).token_ids[0]
    out = greedy(tiny(), stop_token_ids=[first], min_tokens=3)
    assert out.token_ids[0] != first, "a stop token must not be sampled before min_tokens"
    assert len(out.token_ids) >= 3


def test_min_tokens_suppresses_eos():
    llm = tiny()
    saved = llm.llm_engine.eos_token_ids
    first = greedy(llm, ignore_eos=True).token_ids[0]
    llm.llm_engine.eos_token_ids = {first}  # pretend the greedy first token is EOS
    try:
        out = greedy(llm, min_tokens=2, max_tokens=6)
    finally:
        llm.llm_engine.eos_token_ids = saved
    assert out.token_ids[0] != first and len(out.token_ids) >= 2


def test_stop_string_inside_the_min_tokens_window_is_not_matched():
    llm = tiny()
    full = greedy(llm, ignore_eos=True, max_tokens=16)
    tok = llm.get_tokenizer()
    early = tok.decode(full.token_ids[:2], skip_special_tokens=True)
    stop = early[-2:] if len(early) >= 2 else early
    assert stop, "the first tokens must decode to some text"
    out = greedy(llm, ignore_eos=True, max_tokens=16, min_tokens=4, stop=[stop])
    window = tok.decode(full.token_ids[:4], skip_special_tokens=True)
    assert out.text.startswith(window), f"text of the first 4 tokens was cut: {out.text!r}"
    assert len(out.token_ids) > 4


# -- 3: max_num_seqs with n > 1 ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fork", "fanout"])
def test_max_num_seqs_holds_with_parallel_samples(mode):
    llm = tiny(max_num_seqs=4, parallel_sampling=mode)
    seen = []
    llm.generate([PROMPT, {"prompt_token_ids": [5, 6, 7]}], SamplingParams(n=4, max_tokens=6, seed=1),
                 on_step=lambda s: seen.append(len(llm.llm_engine.scheduler.running)))
    assert max(seen) <= 4


def test_n_larger_than_max_num_seqs_is_refused_for_fork():
    with pytest.raises(ValueError, match="max_num_seqs"):
        tiny(max_num_seqs=2).generate(PROMPT, SamplingParams(n=4))


# -- 4: swap keeps sharing --------------------------------------------------------------------------
def test_swap_out_and_in_keeps_shared_blocks_shared():
    t = KVCacheTensors(1, 32, 1, 2, __import__("torch").float32, "cpu", block_size=4, num_cpu_blocks=8)
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    parent = Sequence("r", list(range(16)), SamplingParams())
    assert bm.allocate_slots(parent, 16)
    parent.num_computed_tokens = 16
    child = parent.fork(1, None)
    bm.fork(parent, child)
    assert bm.num_blocks - bm.num_free_blocks == 4
    bm.swap_out([parent, child])
    t.move_blocks(*bm.take_block_moves())  # the worker's part: the manager only decides
    assert bm.num_free_blocks == 8 and len(bm.cpu_free) == 4, "shared blocks move to CPU once"
    assert bm.can_swap_in([parent, child])
    bm.swap_in([parent, child])
    t.move_blocks(*bm.take_block_moves())
    assert bm.num_blocks - bm.num_free_blocks == 4 and bm.block_ids(parent) == bm.block_ids(child)
    assert bm.stats()["kv_blocks_shared"] == 4 and len(bm.cpu_free) == 8


def test_swap_in_leaves_room_for_the_next_token():
    bm = BlockManager(5, 4, num_cpu_blocks=8)
    seq = Sequence("r", list(range(16)), SamplingParams())
    bm.allocate_slots(seq, 16)
    seq.num_computed_tokens = 16
    bm.swap_out([seq])
    other = Sequence("o", [1], SamplingParams())
    bm.allocate_slots(other, 1)  # 4 free: the 4 swapped blocks fit, the next token would not
    assert not bm.can_swap_in([seq])


def test_engine_swap_preemption_with_forked_samples_matches_recompute():
    base = dict(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=16)
    params = SamplingParams(n=3, max_tokens=10, seed=3, temperature=0.8)
    prompts = [{"prompt_token_ids": list(range(5 + i, 15 + i))} for i in range(3)]
    swap = LLM("tiny", dtype="float64", device="cpu", block_size=4, preemption_mode="swap", **base)
    roomy = LLM("tiny", dtype="float64", device="cpu", block_size=4, max_num_seqs=8, num_gpu_blocks_override=200)
    got = [[c.token_ids for c in o.outputs] for o in swap.generate(prompts, params)]
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params)]
    assert got == want
    assert swap.get_metrics()["num_preemptions"] > 0
    assert swap.get_metrics()["kv_blocks_used"] == 0 and len(swap.llm_engine.kv.cpu_free) > 0


# -- 5: the free queue's order -----------------------------------------------------------------------
def test_free_queue_keeps_cached_prefixes_over_partial_blocks():
    """The issue's repro: 4 blocks of 4 tokens, one of them held by another request throughout."""
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    other = Sequence("d", [7], SamplingParams())
    bm.allocate_slots(other, 1)
    a = Sequence("a", list(range(9)), SamplingParams())
    bm.allocate_slots(a, 8)  # two full, hashed blocks
    bm.free(a)
    b = Sequence("b", list(range(4)) + [50, 51], SamplingParams())
    hit = bm.get_computed_blocks(b)
    assert len(hit) == 1
    bm.allocate_slots(b, 2, hit)  # one hashed block (a hit) and one partial block
    bm.free(b)
    c = Sequence("c", [90], SamplingParams())
    bm.allocate_slots(c, 1)  # one new block: must be the useless partial one
    again = Sequence("a2", list(range(9)), SamplingParams())
    assert len(bm.get_computed_blocks(again)) == 2, "A's prefix must still hit both blocks"


# -- 6: extra keys -----------------------------------------------------------------------------------
def test_extra_keys_reach_the_hash():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = Sequence("a", list(range(9)), SamplingParams(), extra_keys="tenant-1")
    bm.allocate_slots(a, 9)
    same = Sequence("b", list(range(9)), SamplingParams(), extra_keys="tenant-1")
    other = Sequence("c", list(range(9)), SamplingParams(), extra_keys="tenant-2")
    assert len(bm.get_computed_blocks(same)) == 2
    assert bm.get_computed_blocks(other) == []


def test_cache_salt_from_the_prompt_separates_tenants():
    llm = LLM("tiny", dtype="float64", device="cpu", block_size=4, num_gpu_blocks_override=64,
              enable_prefix_caching=True)
    ids = list(range(20, 40))
    llm.generate({"prompt_token_ids": ids, "cache_salt": "x"}, SamplingParams(max_tokens=2))
    llm.generate({"prompt_token_ids": ids, "cache_salt": "y"}, SamplingParams(max_tokens=2))
    assert llm.get_metrics()["prefix_cache_hits"] == 0
    llm.generate({"prompt_token_ids": ids, "cache_salt": "x"}, SamplingParams(max_tokens=2))
    assert llm.get_metrics()["prefix_cache_hits"] == 16


# -- 7: interrupted calls leave nothing behind --------------------------------------------------------
def _fresh():
    return LLM("tiny", dtype="float64", device="cpu", block_size=4, num_gpu_blocks_override=128, max_model_len=96)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupted_generate_aborts_its_requests(error):
    llm = _fresh()
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(8)]
    steps = []

    def on_step(step):
        steps.append(step)
        if len(steps) == 3:
            raise error("interrupted")

    with pytest.raises(error):
        llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), on_step=on_step)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.kv.usage == 0
    before = llm.get_metrics()
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=50, ignore_eos=True))[0]
    after = llm.get_metrics()
    assert len(out.outputs[0].token_ids) == 50
    computed = (after["num_prefill_tokens"] - before["num_prefill_tokens"]) + \
        (after["num_generated_tokens"] - before["num_generated_tokens"])
    assert computed == 3 + 50, "the next call computes only its own tokens"


def test_closed_stream_aborts_its_requests():
    llm = _fresh()
    stream = llm.generate_stream([{"prompt_token_ids": [4, 5, 6]}] * 4, SamplingParams(max_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.kv.usage == 0


def test_abort_request_frees_a_queued_request():
    llm = _fresh()
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3, 4, 5]}, SamplingParams(max_tokens=20))
    engine.add_request("b", {"prompt_token_ids": [6, 7]}, SamplingParams(max_tokens=20))
    engine.step()
    engine.abort_request(["a", "b", "unknown"])
    assert not engine.has_unfinished_requests() and engine.kv.usage == 0
    assert engine.get_metrics()["num_requests_aborted"] == 2


# -- 8: argument errors name the field ------------------------------------------------------------------
@pytest.mark.parametrize("kw, words", [
    (dict(stop=5), "stop must be a string or a list"),
    (dict(max_tokens="3"), "max_tokens must be an integer"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids must hold integers"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(min_tokens="2"), "min_tokens must be an integer"),
])
def test_bad_sampling_params_name_the_field(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_bad_prompts_name_the_problem():
    llm = tiny()
    with pytest.raises(TypeError, match="prompts must be"):
        llm.generate(None)
    with pytest.raises(TypeError, match="prompt_token_ids must be integers"):
        llm.generate({"prompt_token_ids": [1.0, 2.7]})
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate(PROMPT, {"max_tokens": 3})
    assert not llm.llm_engine.has_unfinished_requests(), "nothing was queued"


# -- parallel sampling: fork (paper, v0) and fan-out (v1) -------------------------------------------------
def test_fanout_children_are_independent_requests_with_seed_plus_index():
    llm = tiny(parallel_sampling="fanout")
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for k, child in enumerate(out.outputs):
        alone = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=7 + k, max_tokens=8, ignore_eos=True))[0]
        assert child.token_ids == alone.outputs[0].token_ids


def test_fanout_shares_the_prompt_only_through_the_prefix_cache():
    prompt = {"prompt_token_ids": list(range(100, 133))}
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=4)
    stats = {}
    for mode in ("fork", "fanout"):
        for caching in (False, True):
            llm = LLM("tiny", dtype="float64", device="cpu", block_size=4, num_gpu_blocks_override=128,
                      parallel_sampling=mode, enable_prefix_caching=caching)
            llm.generate(prompt, params)
            stats[mode, caching] = llm.get_metrics()["num_prefill_tokens"]
    assert stats["fork", False] == stats["fork", True] == 33, "fork prefills the prompt once"
    assert stats["fanout", False] == 4 * 33, "fan-out without caching prefills it n times"
    assert stats["fanout", True] == 33 + 3 * (33 - 32), "fan-out with caching reuses the 8 full blocks"


# -- metrics ask the KV manager, never its type --------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(kv_cache_manager="contiguous", reservation_policy="max", kv_cache_tokens=400,
                                     num_gpu_blocks_override=None, scheduler_cls="static"),
                                dict(kv_cache_manager="paged", parallel_sampling="fork")], ids=["contiguous", "paged-fork"])
def test_kv_waste_is_allocated_slots_minus_slots_holding_tokens(kw):
    llm = tiny(**kw)
    engine = llm.llm_engine
    seen = []

    def watch(step):
        m = engine.get_metrics()
        running = engine.scheduler.running
        if "kv_reserved_tokens" in m:  # contiguous: reserved regions minus the written prefix of each
            assert m["kv_waste_tokens"] == m["kv_reserved_tokens"] - m["kv_token_states"]
        else:  # paged forks share their prompt's blocks: a shared block's slots are filled once
            filled = {}
            for s in running:
                for i, b in enumerate(engine.kv.block_ids(s)):
                    filled[b] = max(filled.get(b, 0), min(4, max(0, s.num_computed_tokens - 4 * i)))
            assert m["kv_waste_tokens"] == m["kv_blocks_used"] * 4 - sum(filled.values())
        seen.append(m["kv_waste_tokens"])

    n = 1 if kw["kv_cache_manager"] == "contiguous" else 2
    llm.generate(PROMPT, SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True), on_step=watch)
    assert max(seen) > 0 and engine.get_metrics()["kv_waste_tokens"] == 0
