"""Stage 1: the contiguous KV cache, from the allocator's pieces up to the engine running on it."""

import random

import pytest
import torch

from tinypaged import LLM, SamplingParams
from tinypaged.course import checks
from tinypaged.kv.contiguous import (
    ContiguousAllocator,
    ContiguousKVManager,
    first_fit,
    free_holes,
    reservation_tokens,
)
from tinypaged.model.loader import tiny_hf_model
from tinypaged.sequence import Sequence


# -- reservation policies ---------------------------------------------------------------------
def test_pow2_is_the_smallest_power_of_two_at_least_the_final_length():
    got = [reservation_tokens("pow2", n, 4096) for n in (0, 1, 2, 3, 4, 5, 1023, 1024, 1025)]
    assert got == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]


@pytest.mark.parametrize("final_len,want", [(1, (2048, 1, 1)), (3, (2048, 4, 3)), (300, (2048, 512, 300)),
                                            (1500, (2048, 2048, 1500)), (2048, (2048, 2048, 2048))])
def test_reservation_policies(final_len, want):
    assert tuple(reservation_tokens(p, final_len, 2048) for p in ("max", "pow2", "oracle")) == want


def test_reservation_never_exceeds_max_model_len_and_unknown_policy_is_refused():
    assert reservation_tokens("pow2", 300, 400) == 400
    with pytest.raises(ValueError, match="unknown reservation policy 'guess'"):
        reservation_tokens("guess", 10, 2048)
    with pytest.raises(ValueError, match="unknown reservation_policy 'guess'"):
        ContiguousKVManager(100, "guess", 64)
    with pytest.raises(ValueError, match="kv_cache_tokens >= 1"):
        ContiguousKVManager(0, "oracle", 64)


# -- holes and first-fit ----------------------------------------------------------------------
def test_free_holes_and_first_fit_take_the_lowest_address():
    holes = free_holes([(2, 3), (8, 1)], 16)
    assert holes == [(0, 2), (5, 3), (9, 7)]
    assert first_fit(holes, 2) == 0
    assert first_fit(holes, 3) == 5  # first fit, although (9, 7) is also large enough
    assert first_fit(holes, 7) == 9
    assert first_fit(holes, 8) is None


def test_allocator_first_fit_reuses_the_lowest_hole_and_merges_freed_neighbours():
    a = ContiguousAllocator(20, "oracle", 20)
    assert [a.allocate(k, 5) for k in range(4)] == [0, 5, 10, 15]
    assert a.allocate("full", 1) is None and "full" not in a.regions
    a.free(1)
    a.free(2)
    assert a.holes() == [(5, 10)]  # the two freed neighbours form one hole
    assert a.allocate("x", 3) == 5 and a.allocate("y", 3) == 8
    assert a.holes() == [(11, 4)]
    u = a.usage({0: 5, 3: 2, "x": 1})
    assert (u["reserved"], u["free"], u["largest_hole"], u["token_states"]) == (16, 4, 4, 8)
    with pytest.raises(ValueError, match="already holds"):
        a.allocate("x", 1)
    with pytest.raises(IndexError, match="outside"):
        a.slot("y", 3)


def test_external_fragmentation_really_happens():
    """Enough free slots in total, yet no single hole is large enough: the request must wait."""
    a = ContiguousAllocator(12, "oracle", 12)
    for k in "xyz":
        a.allocate(k, 4)
    a.free("x")
    a.free("z")
    assert a.usage({})["free"] == 8 and a.usage({})["largest_hole"] == 4
    assert a.allocate("big", 5) is None
    a.free("y")  # only when the middle region leaves do the holes merge
    assert a.allocate("big", 5) == 0


def test_allocator_invariants_under_random_allocations():
    rng = random.Random(0)
    a = ContiguousAllocator(200, "oracle", 200)
    live = []
    for i in range(2000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.randrange(1, 30)
            start = a.allocate(i, size)
            if start is None:
                assert all(gap < size for _, gap in a.holes())  # refused only when no hole fits
            else:
                live.append(i)
        regions = sorted((s, n) for s, n, _ in a.regions.values())
        for (s, n), (nxt, _) in zip(regions, regions[1:]):
            assert s + n <= nxt  # no overlap
        assert a.usage({})["reserved"] == sum(n for _, n in regions)
        assert a.usage({})["reserved"] + sum(g for _, g in a.holes()) == a.capacity


# -- the engine's manager ---------------------------------------------------------------------
def _seq(prompt_len, max_tokens):
    return Sequence("r", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("policy,want", [("max", 256), ("pow2", 64), ("oracle", 40)])
def test_manager_reserves_by_policy_and_refuses_to_outgrow(policy, want):
    kv = ContiguousKVManager(1000, policy, 256)
    seq = _seq(30, 10)
    assert kv.allocate_slots(seq, 30)
    assert kv.region(seq) == (0, want)
    assert kv.slot_mapping(seq, 7, 9) == [7, 8]
    st = kv.stats()
    assert (st["kv_reserved_tokens"], st["kv_token_states"]) == (want, 0)
    seq.num_computed_tokens = want
    with pytest.raises(RuntimeError, match="outgrew"):
        kv.allocate_slots(seq, 1)
    kv.free(seq)
    assert kv.stats()["kv_reserved_tokens"] == 0 and kv.region(seq) is None and kv.usage == 0


class _ListAllocator:
    """A learner-style allocator with its own state (a list, no ``regions``), the stage-1 assignment's methods."""

    def __init__(self, capacity, policy, max_model_len):
        self.capacity, self.policy, self.max_model_len, self.placed = capacity, policy, max_model_len, []

    def holes(self):
        return free_holes(sorted((s, n) for _, s, n, _ in self.placed), self.capacity)

    def allocate(self, seq_id, final_len):
        size = reservation_tokens(self.policy, final_len, self.max_model_len)
        start = first_fit(self.holes(), size)
        if start is not None:
            self.placed.append((seq_id, start, size, final_len))
        return start

    def free(self, seq_id):
        self.placed = [r for r in self.placed if r[0] != seq_id]

    def slot(self, seq_id, position):
        start, size = next((s, n) for i, s, n, _ in self.placed if i == seq_id)
        if not 0 <= position < size:
            raise IndexError(position)
        return start + position

    def usage(self, written):
        reserved = sum(n for _, _, n, _ in self.placed)
        will_hold = sum(min(final, n) for _, _, n, final in self.placed)
        states = sum(written.get(i, 0) for i, _, _, _ in self.placed)
        return {"reserved": reserved, "token_states": states, "reservation_waste": will_hold - states,
                "internal_fragmentation": reserved - will_hold, "free": self.capacity - reserved,
                "largest_hole": max((n for _, n in self.holes()), default=0)}


def test_a_learner_allocator_and_reservation_drop_into_the_engine_manager():
    """The manager uses only the assignment's methods, so an allocator with other state runs the engine (the
    stage-1 serving check's seam, ``ContiguousKVManager.factory``) and gives the built-in manager's tokens."""
    calls = []

    def my_reservation(policy, final_len, max_model_len):
        calls.append(final_len)
        return reservation_tokens(policy, final_len, max_model_len)

    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=8)
    mine = tiny(reservation_policy="pow2", kv_cache_manager=ContiguousKVManager.factory(_ListAllocator, my_reservation))
    got = mine.generate(prompts, params)
    kv = mine.llm_engine.kv
    assert isinstance(kv.allocator, _ListAllocator) and kv.allocator.placed == [] and kv.usage == 0
    assert calls and set(calls) == {18}  # every request's reservation went through the given function
    want = tiny(kv_cache_manager="contiguous", reservation_policy="pow2").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


# -- the engine on a contiguous cache ---------------------------------------------------------
PROMPTS = [list(range(5 + i, 15 + i)) for i in range(5)]  # five 10-token prompts


def tiny(**kw):
    kw = {"dtype": "float64", "device": "cpu", "max_model_len": 64, "kv_cache_tokens": 40, **kw}
    return LLM("tiny", **kw)


@pytest.mark.parametrize("scheduler", ["static", None])
def test_full_arena_makes_requests_wait_and_stats_add_up(scheduler):
    """40 slots, 18 reserved per request (oracle: 10 + 8): two at a time, the rest wait their turn."""
    llm = tiny(kv_cache_manager="contiguous", reservation_policy="oracle", scheduler_cls=scheduler)
    kv = llm.llm_engine.kv
    seen = []

    def on_step(step):
        m = llm.get_metrics()
        running = llm.llm_engine.scheduler.running
        assert m["kv_reserved_tokens"] == 18 * len(running) <= 40
        assert m["kv_token_states"] == sum(s.num_computed_tokens for s in running)
        assert m["kv_token_states"] + m["kv_reservation_waste"] + m["kv_internal_fragmentation"] == m["kv_reserved_tokens"]
        assert m["kv_reserved_tokens"] + m["kv_free_tokens"] == 40
        assert m["kv_largest_hole"] <= m["kv_free_tokens"]
        seen.append((len(running), m["num_waiting"]))

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8),
                        on_step=on_step)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * 5
    assert max(r for r, _ in seen) == 2 and any(w > 0 for _, w in seen)  # requests really waited
    m = llm.get_metrics()
    assert (m["num_requests_finished"], m["num_preemptions"], m["kv_reserved_tokens"]) == (5, 0, 0)
    assert m["num_generated_tokens"] == 40 and m["num_prefill_tokens"] == 50
    assert kv.allocator.regions == {} and kv.live == {}


def test_max_policy_reserves_max_model_len_per_request():
    llm = tiny(kv_cache_manager="contiguous", reservation_policy="max", scheduler_cls="static", kv_cache_tokens=130)
    running = []
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=4),
                 on_step=lambda s: running.append(llm.get_metrics()["kv_reserved_tokens"]))
    assert max(running) == 2 * 64  # 130 // 64 = 2 requests at once, whatever their length


def test_never_fitting_request_is_a_clear_value_error():
    llm = tiny(kv_cache_manager="contiguous", reservation_policy="max")  # reserves 64 > 40 slots
    with pytest.raises(ValueError, match="can never fit in the KV cache"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4))
    llm = tiny(kv_cache_manager="contiguous", reservation_policy="oracle")
    with pytest.raises(ValueError, match="needs up to 50 tokens"):
        llm.generate([{"prompt_token_ids": list(range(3, 33))}], SamplingParams(max_tokens=20))
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued


def test_contiguous_gives_the_same_tokens_as_paged_and_transformers():
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    contiguous = tiny(kv_cache_manager="contiguous", reservation_policy="pow2", scheduler_cls="static").generate(prompts, params)
    paged = tiny(kv_cache_manager="paged", block_size=4, kv_cache_tokens=256).generate(prompts, params)
    hf = tiny_hf_model(seed=0).double()
    for p, c, pg in zip(PROMPTS, contiguous, paged):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert c.outputs[0].token_ids == pg.outputs[0].token_ids == ref


# -- the stage-1 checks must fail on wrong code ----------------------------------------------
def _wrong_reservation(policy, final_len, max_model_len):
    if policy == "pow2":
        return reservation_tokens(policy, final_len, 1 << 30)  # forgets the max_model_len cap
    return reservation_tokens(policy, final_len, max_model_len)


def _wrong_holes(regions, capacity):
    return free_holes(regions, capacity)[:-1] if regions else [(0, capacity)]  # drops the tail hole


def _best_fit(holes, size):
    fitting = [(gap, start) for start, gap in holes if gap >= size]
    return min(fitting)[1] if fitting else None


@pytest.mark.parametrize("name,wrong", [
    ("reservation_tokens", _wrong_reservation),
    ("reservation_tokens", lambda p, f, m: f),  # everything is "oracle"
    ("free_holes", _wrong_holes),
    ("free_holes", lambda regions, capacity: [(0, capacity - sum(s for _, s in regions))]),
    ("first_fit", _best_fit),
    ("first_fit", lambda holes, size: holes[0][0] if holes else None),
])
def test_stage1_checks_fail_on_wrong_code(name, wrong):
    status, msg = checks.evaluate(name, wrong)
    assert status == checks.FAIL and msg



def _my_reservation(policy, final_len, max_model_len):
    """A learner's reservation_tokens, written another way."""
    if policy == "max":
        return max_model_len
    size = final_len if policy == "oracle" else 1 << max(final_len - 1, 0).bit_length()
    return min(size, max_model_len)


def test_serving_check_runs_the_engine_manager_only_over_the_notebooks_own_parts():
    """The stage-1 serving check's plug-in is the package's seam (ContiguousKVManager.factory): its preflight
    accepts the learner's allocator and reservation inside and refuses the package's (marks for its code)."""
    from tinypaged.course.checks import stage01
    from tinypaged.kv import contiguous

    stage01._preflight({"kv_cache_manager": ContiguousKVManager.factory(_ListAllocator, _my_reservation)})
    with pytest.raises(TypeError, match="allocator must be your ContiguousAllocator"):
        stage01._preflight({"kv_cache_manager": ContiguousKVManager.factory(contiguous.ContiguousAllocator,
                                                                             _my_reservation)})
    with pytest.raises(TypeError, match="your reservation_tokens"):
        stage01._preflight({"kv_cache_manager": ContiguousKVManager.factory(_ListAllocator,
                                                                             contiguous.reservation_tokens)})
    with pytest.raises(TypeError, match="kv_cache_manager"):
        stage01._preflight({})
