"""Stage 4: the scheduler. Scheduling must never change what greedy decoding produces, and the
continuous policy must follow vLLM v1's rules (running first, budget, chunking, preemption)."""

import functools
import logging

import pytest

from tinypaged import LLM, EngineConfig, SamplingParams

pytestmark = pytest.mark.usefixtures("shared_weights")


def tiny(**kw):
    kw = {"dtype": "float64", "device": "cpu", "block_size": 4, "max_model_len": 128, **kw}
    return LLM("tiny", **kw)


# Prompts of different lengths and output lengths, so requests finish at different steps.
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 4000 + 5 for j in range(n)]}
           for i, n in enumerate([5, 23, 9, 40, 14, 3])]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in [12, 4, 9, 6, 15, 7]]


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@functools.lru_cache(maxsize=None)
def reference():
    """Static batching, one request at a time, plenty of memory: the plainest possible schedule."""
    return token_ids(tiny(scheduling_policy="static", max_num_seqs=1, num_gpu_blocks_override=256).generate(PROMPTS, PARAMS))


CONFIGS = {
    "static-4": dict(scheduling_policy="static", max_num_seqs=4),
    "static-8-contiguous": dict(scheduling_policy="static", max_num_seqs=8, kv_cache="contiguous", kv_cache_tokens=1024),
    "seqs-1": dict(max_num_seqs=1),
    "seqs-2": dict(max_num_seqs=2),
    "seqs-8": dict(max_num_seqs=8),
    "budget-8-chunked": dict(max_num_seqs=4, max_num_batched_tokens=8),
    "budget-16-chunked": dict(max_num_seqs=4, max_num_batched_tokens=16),
    "budget-64-chunked": dict(max_num_seqs=8, max_num_batched_tokens=64),
    "budget-128-not-chunked": dict(max_num_seqs=8, max_num_batched_tokens=128, enable_chunked_prefill=False),
    "contiguous": dict(max_num_seqs=8, kv_cache="contiguous", kv_cache_tokens=1024),
    "preempt-recompute": dict(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=16),
    "preempt-recompute-not-chunked": dict(max_num_seqs=8, max_num_batched_tokens=128, enable_chunked_prefill=False,
                                          num_gpu_blocks_override=16),
    "preempt-swap": dict(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=16,
                         preemption_mode="swap"),
    "preempt-recompute-prefix-cache": dict(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=16,
                                           enable_prefix_caching=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_do_not_depend_on_scheduling(name):
    kw = {"num_gpu_blocks_override": 256, **CONFIGS[name]}
    llm = tiny(**kw)
    assert token_ids(llm.generate(PROMPTS, PARAMS)) == reference()
    preemptions = llm.get_metrics()["num_preemptions"]
    if name.startswith("preempt"):
        assert preemptions > 0, "the tiny cache was meant to force preemptions"
    else:
        assert preemptions == 0


def test_smollm2_static_equals_continuous_with_chunks_and_preemption():
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village,"]
    sp = SamplingParams(temperature=0, max_tokens=6)
    base = dict(device="cpu", block_size=4, max_model_len=64)
    static = LLM("smollm2-135m", scheduling_policy="static", num_gpu_blocks_override=64, **base).generate(prompts, sp)
    cont = LLM("smollm2-135m", max_num_seqs=3, max_num_batched_tokens=8, num_gpu_blocks_override=7, **base)
    outs = cont.generate(prompts, sp)
    assert token_ids(outs) == token_ids(static)
    assert cont.get_metrics()["num_preemptions"] > 0


# -- the continuous policy, one step at a time ------------------------------------------------------
def run_steps(llm, prompts, params):
    steps = []
    llm.generate(prompts, params, on_step=steps.append)
    return steps


def test_budget_is_respected_every_step_and_long_prompt_is_chunked():
    llm = tiny(max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks_override=256)
    steps = run_steps(llm, PROMPTS, PARAMS)
    assert all(s.num_tokens > 0 for st in steps for s in st.scheduled)
    assert max(sum(s.num_tokens for s in st.scheduled) for st in steps) == 16
    for h in llm.llm_engine.history:
        assert h["num_prefill_tokens"] + h["num_decode_tokens"] <= 16
    # request 3 has a 40-token prompt: it is prefilled in pieces of at most 16 tokens
    chunks = [s.num_tokens for st in steps for s in st.scheduled if s.seq.request_id == "3" and s.kind == "prefill"]
    assert sum(chunks) == 40 and len(chunks) >= 3 and max(chunks) <= 16


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    llm = tiny(max_num_seqs=8, max_num_batched_tokens=48, enable_chunked_prefill=False, max_model_len=48,
               num_gpu_blocks_override=256)
    steps = run_steps(llm, PROMPTS, PARAMS)
    chunks = [s.num_tokens for st in steps for s in st.scheduled if s.seq.request_id == "3" and s.kind == "prefill"]
    assert chunks == [40]
    assert steps[0].trace() == "step   0 | 0:p5 1:p23 2:p9"  # 40 more would pass the budget: request 3 waits


def test_running_requests_are_scheduled_before_new_ones():
    llm = tiny(max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks_override=256)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [5] * 6}, sp)
    engine.add_request("b", {"prompt_token_ids": [6] * 6}, sp)
    assert engine.step().trace() == "step   0 | a:p6 b:p6"
    engine.add_request("c", {"prompt_token_ids": list(range(10, 40))}, sp)
    step = engine.step()
    assert step.trace() == "step   1 | a:d1 b:d1 c:p14"  # decodes first, the prompt gets what is left
    assert [s.kind for s in step.scheduled] == ["decode", "decode", "prefill"]


def test_max_num_seqs_caps_the_batch():
    llm = tiny(max_num_seqs=2, num_gpu_blocks_override=256)
    steps = run_steps(llm, PROMPTS, PARAMS)
    assert max(len(st.scheduled) for st in steps) == 2
    assert max(h["num_running"] for h in llm.llm_engine.history) == 2


@pytest.fixture
def preempting_run():
    llm = tiny(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=12)
    steps = run_steps(llm, PROMPTS, PARAMS)
    return llm, steps


def test_preemption_victim_is_the_last_admitted_and_nothing_is_admitted(preempting_run):
    llm, steps = preempting_run
    preempting = [st for st in steps if st.preempted]
    assert preempting
    running_before: list[str] = []  # admission order of running requests before each step
    for st in steps:
        ids = [s.seq.request_id for s in st.scheduled]
        if st.preempted:
            # the victims are the tail of the running list, newest first
            victims = [v.request_id for v in st.preempted]
            assert victims == running_before[::-1][: len(victims)], (st.trace(), running_before)
            assert set(ids) <= set(running_before) - set(victims), f"admitted something new: {st.trace()}"
        # rebuild the running list: previous running minus victims, plus newly admitted, minus finished
        running_before = [r for r in running_before if r not in {v.request_id for v in st.preempted}]
        running_before += [r for r in ids if r not in running_before]
        running_before = [r for r in running_before if r not in {o.request_id for o in st.finished}]


def test_preemptions_are_counted_and_logged(caplog):
    logger = logging.getLogger("tinypaged")
    logger.addHandler(caplog.handler)
    try:
        llm = tiny(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=12)
        steps = []
        outs = llm.generate(PROMPTS, PARAMS, on_step=steps.append)
    finally:
        logger.removeHandler(caplog.handler)
    n = sum(len(st.preempted) for st in steps)
    assert n > 0
    assert llm.get_metrics()["num_preemptions"] == n
    assert sum(o.metrics.num_preemptions for o in outs) == n
    assert llm.llm_engine.history[-1]["num_preemptions"] == n
    logged = [r for r in caplog.records if "Preempted" in r.getMessage()]
    assert len(logged) == n and f"Total preemptions: {n}" in logged[-1].getMessage()
    assert all(" | preempted " in st.trace() for st in steps if st.preempted)


def test_recompute_keeps_generated_tokens_and_requeues_at_the_front():
    llm = tiny(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=12)
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"r{i}", p, sp)
    while engine.has_unfinished_requests():
        step = engine.step()
        if step.preempted:
            victim = step.preempted[-1]
            assert engine.scheduler.waiting[0] is victim
            assert victim.num_computed_tokens == 0 and engine.kv.block_ids(victim) == []
            assert len(victim) > victim.num_prompt_tokens or victim.output_token_ids == []
            kept = list(victim.output_token_ids)
            engine.step()  # recomputing resumes from the kept tokens: a prefill of prompt + outputs
            assert victim.output_token_ids[: len(kept)] == kept
            break
    else:
        pytest.fail("no preemption happened")


def test_swap_preemption_moves_blocks_to_cpu_and_back():
    llm = tiny(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=12, preemption_mode="swap")
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"r{i}", p, sp)
    swapped = False
    while engine.has_unfinished_requests():
        step = engine.step()
        for v in step.preempted:
            assert v.status.value == "swapped" and v.num_computed_tokens > 0 and engine.kv.block_ids(v) == []
            swapped = True
    assert swapped


# -- requests and configs that are wrong ------------------------------------------------------------
def test_add_request_rejects_only_the_bad_request():
    llm = tiny(max_num_seqs=4, num_gpu_blocks_override=16)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("good-1", {"prompt_token_ids": [5, 6, 7]}, sp)
    engine.add_request("good-2", {"prompt_token_ids": [8, 9]}, sp)
    engine.step()
    with pytest.raises(ValueError, match="too-long.*max_model_len"):
        engine.add_request("too-long", {"prompt_token_ids": [5] * 200}, sp)
    with pytest.raises(ValueError, match="huge.*never fit"):
        engine.add_request("huge", {"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=50))
    with pytest.raises(ValueError, match="bad-ids.*vocabulary"):
        engine.add_request("bad-ids", {"prompt_token_ids": [5, 10**9]}, sp)
    with pytest.raises(ValueError, match="good-1.*already in use"):
        engine.add_request("good-1", {"prompt_token_ids": [5]}, sp)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step().finished]
    assert sorted(finished) == ["good-1", "good-2"]


def test_generate_validates_every_request_before_any_work():
    llm = tiny(num_gpu_blocks_override=64)
    ok = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=r"Request 1\b.*longer than max_model_len"):
        llm.generate([ok, {"prompt_token_ids": [5] * 300}, ok])
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.get_metrics()["num_steps"] == 0


@pytest.mark.parametrize("kw, knob", [
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(scheduler="fifo"), "scheduler"),
    (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(preemption_mode="swap", kv_cache="contiguous"), "preemption_mode"),
])
def test_impossible_configs_name_the_knob(kw, knob):
    with pytest.raises(ValueError, match=knob):
        EngineConfig(model="tiny", **kw)


@pytest.mark.parametrize("kw", [
    dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128, max_num_seqs=8),
    dict(scheduling_policy="static", max_num_batched_tokens=64, max_model_len=128, max_num_seqs=8),
])
def test_budget_below_max_model_len_needs_chunked_prefill(kw):
    with pytest.raises(ValueError, match="max_num_batched_tokens.*max_model_len.*enable_chunked_prefill"):
        tiny(**kw)


def test_static_batching_leaves_idle_slots_continuous_does_not_wait():
    sp = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in [2, 20, 2, 20]]
    prompts = PROMPTS[:4]
    static = tiny(scheduling_policy="static", max_num_seqs=2, num_gpu_blocks_override=256)
    static.generate(prompts, sp)
    cont = tiny(max_num_seqs=2, num_gpu_blocks_override=256)
    cont.generate(prompts, sp)
    m = static.get_metrics()
    assert m["num_idle_slot_steps"] == 2 * 18  # each batch: one member idles for 18 of its 20 decode steps
    assert 0 < m["idle_slot_fraction"] < 0.5
    assert cont.get_metrics()["num_steps"] < m["num_steps"]


# -- the policy in miniature (scheduler.schedule_step) and the stage-4 checks ------------------------
def test_schedule_step_replays_the_engine():
    """The exercise's pure policy, run over block counts, makes the engine's decisions step by step."""
    from tinypaged.scheduler import BlockCounter, PlanRequest, schedule_step

    llm = tiny(max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks_override=14)
    steps = run_steps(llm, PROMPTS, PARAMS)
    assert any(st.preempted for st in steps)
    base = int(steps[0].scheduled[0].seq.request_id)
    total = {str(base + i): len(p["prompt_token_ids"]) for i, p in enumerate(PROMPTS)}
    max_out = {str(base + i): sp.max_tokens for i, sp in enumerate(PARAMS)}
    out = {r: 0 for r in total}
    computed = {r: 0 for r in total}
    kv = BlockCounter(14, 4)
    running, waiting = [], [PlanRequest(r, 0) for r in total]
    for st in steps:
        for r in running + waiting:
            r.num_new_tokens = total[r.request_id] + out[r.request_id] - computed[r.request_id]
        plan = schedule_step(running, waiting, 16, 4, kv)
        got = [(s.seq.request_id, s.num_tokens) for s in st.scheduled]
        assert (plan.scheduled, plan.preempted) == (got, [v.request_id for v in st.preempted]), st.trace()
        by_id = {r.request_id: r for r in running + waiting}
        for rid in plan.preempted:  # recompute: back to the front of the queue, tokens kept
            running.remove(by_id[rid])
            waiting.insert(0, by_id[rid])
            computed[rid] = 0
        for rid, n in plan.scheduled:
            if by_id[rid] in waiting:
                waiting.remove(by_id[rid])
                running.append(by_id[rid])
            computed[rid] += n
            if computed[rid] == total[rid] + out[rid]:
                out[rid] += 1
                if out[rid] == max_out[rid]:
                    running.remove(by_id[rid])
                    kv.free(by_id[rid])


def _broken_schedule_steps():
    import inspect

    import tinypaged.scheduler as S

    src = inspect.getsource(S.schedule_step)

    def variant(old, new):
        assert old in src
        ns = dict(vars(S))
        exec(src.replace(old, new), ns)
        return ns["schedule_step"]

    return {
        "admits in a preempting step": variant("    if plan.preempted:\n        return plan\n", ""),
        "first victim": variant("victim = pick_victim(running)", "victim = running[0]"),
        "ignores the budget": variant("n = min(req.num_new_tokens, budget)", "n = req.num_new_tokens"),
        "ignores max_num_seqs": variant(" or num_seqs + seqs > max_num_seqs", ""),
        "skips a request that does not fit": variant("        if not kv.allocate(req, n):\n            break",
                                                     "        if not kv.allocate(req, n):\n            continue"),
        "waiting first": variant("    i = 0\n", "    i = len(running)\n"),
    }


@pytest.mark.parametrize("name", list(_broken_schedule_steps()))
def test_schedule_step_check_fails_broken_policies(name):
    from tinypaged.course import checks

    status, msg = checks.evaluate("schedule_step", _broken_schedule_steps()[name])
    assert status == checks.FAIL, name


@pytest.mark.parametrize("broken", [lambda r: r[0], lambda r: r.pop(), lambda r: max(r, key=lambda x: x.num_new_tokens)])
def test_pick_victim_check_fails_broken_choices(broken):
    from tinypaged.course import checks

    assert checks.evaluate("pick_victim", broken)[0] == checks.FAIL
