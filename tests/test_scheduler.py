"""Stage 4: the scheduler. Scheduling must never change what greedy decoding produces, and the
continuous policy must follow vLLM v1's rules (running first, budget, chunking, preemption)."""

import functools
import logging

import pytest

from tinypaged import LLM, EngineConfig, SamplingParams
from tinypaged.interfaces import InvariantError

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
    return token_ids(tiny(scheduler_cls="static", max_num_seqs=1, num_gpu_blocks_override=256).generate(PROMPTS, PARAMS))


CONFIGS = {
    "static-4": dict(scheduler_cls="static", max_num_seqs=4),
    "static-8-contiguous": dict(scheduler_cls="static", max_num_seqs=8, kv_cache_manager="contiguous", kv_cache_tokens=1024),
    "seqs-1": dict(max_num_seqs=1),
    "seqs-2": dict(max_num_seqs=2),
    "seqs-8": dict(max_num_seqs=8),
    "budget-8-chunked": dict(max_num_seqs=4, max_num_batched_tokens=8),
    "budget-16-chunked": dict(max_num_seqs=4, max_num_batched_tokens=16),
    "budget-64-chunked": dict(max_num_seqs=8, max_num_batched_tokens=64),
    "budget-128-not-chunked": dict(max_num_seqs=8, max_num_batched_tokens=128, enable_chunked_prefill=False),
    "contiguous": dict(max_num_seqs=8, kv_cache_manager="contiguous", kv_cache_tokens=1024),
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
    static = LLM("smollm2-135m", scheduler_cls="static", num_gpu_blocks_override=64, **base).generate(prompts, sp)
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
    chunks = [s.num_tokens for st in steps for s in st.scheduled if s.seq.request_id == "3" and s.is_prefill]
    assert sum(chunks) == 40 and len(chunks) >= 3 and max(chunks) <= 16


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    llm = tiny(max_num_seqs=8, max_num_batched_tokens=48, enable_chunked_prefill=False, max_model_len=48,
               num_gpu_blocks_override=256)
    steps = run_steps(llm, PROMPTS, PARAMS)
    chunks = [s.num_tokens for st in steps for s in st.scheduled if s.seq.request_id == "3" and s.is_prefill]
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
    assert [s.is_prefill for s in step.scheduled] == [False, False, True]


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
    level = logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)  # another test may have left the level raised (quiet()): do not depend on order
    try:
        llm = tiny(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=12)
        steps = []
        outs = llm.generate(PROMPTS, PARAMS, on_step=steps.append)
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
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
    (dict(scheduling_policy="fifo"), "scheduling_policy"),
    (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(preemption_mode="swap", kv_cache_manager="contiguous"), "preemption_mode"),
])
def test_impossible_configs_name_the_knob(kw, knob):
    with pytest.raises(ValueError, match=knob):
        EngineConfig(model="tiny", **kw)


@pytest.mark.parametrize("kw", [
    dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128, max_num_seqs=8),
    dict(scheduler_cls="static", max_num_batched_tokens=64, max_model_len=128, max_num_seqs=8),
])
def test_budget_below_max_model_len_needs_chunked_prefill(kw):
    with pytest.raises(ValueError, match="max_num_batched_tokens.*max_model_len.*enable_chunked_prefill"):
        tiny(**kw)


def test_static_batching_leaves_idle_slots_continuous_does_not_wait():
    sp = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in [2, 20, 2, 20]]
    prompts = PROMPTS[:4]
    static = tiny(scheduler_cls="static", max_num_seqs=2, num_gpu_blocks_override=256)
    static.generate(prompts, sp)
    cont = tiny(max_num_seqs=2, num_gpu_blocks_override=256)
    cont.generate(prompts, sp)
    m = static.get_metrics()
    assert m["num_idle_slot_steps"] == 2 * 18  # each batch: one member idles for 18 of its 20 decode steps
    assert 0 < m["idle_slot_fraction"] < 0.5
    assert cont.get_metrics()["num_steps"] < m["num_steps"]


# -- the policy in miniature (policies.schedule_step) and the stage-4 checks ------------------------
def test_schedule_step_replays_the_engine():
    """The exercise's pure policy, run over block counts, makes the engine's decisions step by step."""
    from tinypaged.sched.policies import BlockCounter, PlanRequest, schedule_step

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
        assert ([(r.request_id, n) for r, n in plan.scheduled], [r.request_id for r in plan.preempted]) == \
            (got, [v.request_id for v in st.preempted]), st.trace()
        for req in plan.preempted:  # recompute: back to the front of the queue, tokens kept
            running.remove(req)
            waiting.insert(0, req)
            computed[req.request_id] = 0
        for req, n in plan.scheduled:
            rid = req.request_id
            if req in waiting:
                waiting.remove(req)
                running.append(req)
            computed[rid] += n
            if computed[rid] == total[rid] + out[rid]:
                out[rid] += 1
                if out[rid] == max_out[rid]:
                    running.remove(req)
                    kv.free(req)


def _broken_schedule_steps():
    import inspect

    import tinypaged.sched.policies as P

    src = inspect.getsource(P.schedule_step)

    def variant(old, new):
        assert old in src
        ns = dict(vars(P))
        exec(src.replace(old, new), ns)
        return ns["schedule_step"]

    return {
        "admits in a preempting step": variant("    if plan.preempted:\n        return plan\n", ""),
        "first victim": variant("victim = running[-1]", "victim = running[0]"),
        "ignores the budget": variant("n = min(req.num_new_tokens, budget)", "n = req.num_new_tokens"),
        "ignores max_num_seqs": variant(" or len(running) >= max_num_seqs", ""),
        "skips a request that does not fit": variant("        if not kv.allocate(req, n):\n            break",
                                                     "        if not kv.allocate(req, n):\n            continue"),
        "waiting first": variant("    i = 0\n", "    i = len(running)\n"),
        "returns ids": variant("plan.scheduled.append((req, n))", "plan.scheduled.append((req.request_id, n))"),
    }


@pytest.mark.parametrize("name", list(_broken_schedule_steps()))
def test_schedule_step_check_fails_broken_policies(name):
    from tinypaged.course import checks

    status, msg = checks.evaluate("schedule_step", _broken_schedule_steps()[name])
    assert status == checks.FAIL, name


def _learner_step(running, waiting, budget, max_num_seqs, kv):
    """The stage-4 assignment's shape, written another way: no chunked_prefill parameter, seats counted as
    requests (``len(running)``), the victim the last admitted."""
    from tinypaged.sched.policies import StepPlan

    plan, running, i = StepPlan(), list(running), 0
    while i < len(running) and budget > 0:
        req, n = running[i], min(running[i].num_new_tokens, budget)
        while not kv.allocate(req, n):
            plan.preempted.append(running.pop())
            kv.free(plan.preempted[-1])
            if plan.preempted[-1] is req:
                break
        else:
            plan.scheduled.append((req, n))
            budget, i = budget - n, i + 1
    for req in [] if plan.preempted else waiting:
        n = min(req.num_new_tokens, budget)
        if budget <= 0 or len(running) >= max_num_seqs or not kv.allocate(req, n):
            break
        running.append(req)
        plan.scheduled.append((req, n))
        budget -= n
    return plan


@pytest.mark.parametrize("kw,n", [
    (dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False,
          num_gpu_blocks_override=16), 1),
    (dict(max_num_seqs=5, max_num_batched_tokens=16, num_gpu_blocks_override=30, parallel_sampling="fork"), 3),
    (dict(max_num_seqs=7, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False,
          parallel_sampling="fork", num_gpu_blocks_override=24), 3),
])
def test_a_lesson_shaped_step_runs_every_configuration_like_the_builtin(kw, n):
    """Regression: the engine's kv (StepKV) refuses what only it knows (forked samples' seats, no chunked
    prefill), so the lesson's schedule_step is the engine's and a learner's plugs in under any configuration.
    Before, the built-in step took a chunked_prefill argument (a learner's raised TypeError without chunked
    prefill) and counted forks itself (a learner's broke max_num_seqs with n > 1)."""
    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + 5 + 3 * i))} for i in range(8)]
    params = [SamplingParams(n=n, temperature=0 if n == 1 else 0.8, seed=i, max_tokens=3 + i % 5, ignore_eos=True)
              for i in range(8)]

    def run(policy):
        llm = tiny(scheduler_cls=policy, **kw)
        steps = []
        outs = llm.generate(prompts, params, on_step=steps.append)
        base = int(steps[0].scheduled[0].seq.request_id)
        trace = [[(int(s.seq.request_id) - base, s.num_tokens) for s in st.scheduled] for st in steps]
        return trace, [[c.token_ids for c in o.outputs] for o in outs], llm.get_metrics()["num_preemptions"]

    builtin = run(None)  # the engine's own step
    assert run(_learner_step) == builtin
    assert max(len(step) for step in builtin[0]) >= 2


def test_static_batching_counts_forks_against_max_num_seqs():
    """Regression: a static batch admitted a request whose forks did not fit max_num_seqs (InvariantError)."""
    llm = tiny(scheduler_cls="static", max_num_seqs=5, parallel_sampling="fork", num_gpu_blocks_override=256)
    prompts = [{"prompt_token_ids": list(range(10 + i, 16 + i))} for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs) for o in outs] == [2] * 4
    assert llm.get_metrics()["num_requests_finished"] == 4


# -- swap preemption with n > 1: siblings leave and come back together ------------------------------
@pytest.mark.parametrize("parallel_sampling", ["fork", "fanout"])
def test_swap_with_siblings_that_outgrow_the_cache_completes_like_recompute(parallel_sampling):
    """Regression: two samples of one prompt in 3 blocks of 4. The second sample's decode finds no
    block, and swapping takes the first (already scheduled this step) along: it used to raise
    "scheduled but not running". Back together they can never fit, so they are recomputed."""
    prompt = {"prompt_token_ids": [10, 10, 10]}
    sp = SamplingParams(n=2, max_tokens=6, temperature=0)
    outs, steps = {}, {}
    for mode in ("recompute", "swap"):
        llm = LLM("tiny", dtype="float32", device="cpu", block_size=4, num_gpu_blocks_override=3,
                  preemption_mode=mode, parallel_sampling=parallel_sampling)
        steps[mode] = run_steps(llm, prompt, sp)
        outs[mode] = [c.token_ids for st in steps[mode] for o in st.finished for c in o.outputs]
        assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.kv.usage == 0
    assert outs["swap"] == outs["recompute"] and all(len(t) == 6 for t in outs["swap"])
    swapped = [v for st in steps["swap"] for v in st.preempted]
    if parallel_sampling == "fork":  # one request (v0's sequence group): its samples leave together
        assert len(swapped) == 2 and {v.index for v in swapped} == {0, 1}, "both siblings were swapped together"
    else:  # fanout: each sample is a child request of its own (vLLM v1), preempted alone
        assert swapped and all(len({v.request_id for v in st.preempted}) == len(st.preempted)
                               for st in steps["swap"]), "a fanned-out sample left with another request"
        assert {v.request_id for v in swapped} <= {"0_0", "1_0"}


@pytest.mark.parametrize("parallel_sampling", ["fork", "fanout"])
def test_swapped_siblings_leave_together_and_match_recompute(parallel_sampling):
    """n = 3 samples under memory pressure: a preempted request's running samples go to CPU memory
    as one group (this used to raise "scheduled but not running" when a sibling had already been
    scheduled in that step); forks come back as one group; fanned-out samples are requests of their own and
    go alone; greedy tokens are recompute mode's."""
    params = [SamplingParams(temperature=0, n=3, max_tokens=m, ignore_eos=True) for m in [12, 4, 9, 6, 15, 7]]
    got, resumed, sizes = {}, False, []
    for mode in ("recompute", "swap"):
        llm = tiny(max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=20, preemption_mode=mode,
                   parallel_sampling=parallel_sampling)
        engine = llm.llm_engine
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            engine.add_request(str(i), p, sp)
        outs, groups = [], []
        while engine.has_unfinished_requests():
            st = engine.step()
            outs += st.finished
            ids = {s.seq.seq_id for s in st.scheduled}
            for g in groups:
                if parallel_sampling == "fork" and g & ids:
                    assert g <= ids, "a swapped group of forks resumes all at once"
                    resumed = True
            groups = [g for g in groups if not g & ids]
            if mode == "swap" and st.preempted:
                swapped = {v.seq_id for v in st.preempted if v.status.value == "swapped"}
                sizes.append(len(swapped))
                groups.append(swapped)
        got[mode] = sorted((o.request_id, [c.token_ids for c in o.outputs]) for o in outs)
        assert engine.kv.usage == 0
    assert got["swap"] == got["recompute"]
    if parallel_sampling == "fork":  # one request: its running samples leave and come back as one group
        assert max(sizes) > 1 and resumed, "a request's running samples were swapped out together"
    else:  # fanout: every sample is a child request of its own (vLLM v1), swapped alone
        assert sizes and max(sizes) == 1


# -- the engine runs schedule_step on its own requests ------------------------------------------------
def test_the_step_sees_the_schedulers_requests_and_kv():
    from tinypaged.sched.step_adapter import QueuedRequest, StepKV

    seen = {}

    def step(running, waiting, budget, max_num_seqs, kv):
        from tinypaged.sched.policies import schedule_step

        seen.setdefault("types", set()).update(type(r) for r in list(running) + list(waiting))
        seen["kv"] = type(kv)
        return schedule_step(running, waiting, budget, max_num_seqs, kv)

    llm = tiny(scheduler_cls=step, num_gpu_blocks_override=64)
    sp = SamplingParams(temperature=0, n=2, max_tokens=3, ignore_eos=True)
    outs = llm.generate({"prompt_token_ids": [5, 6, 7]}, sp)
    assert seen == {"types": {QueuedRequest}, "kv": StepKV}
    assert len(outs[0].outputs) == 2


def test_a_plan_of_ids_is_refused_with_the_rule():
    def ids_step(running, waiting, budget, max_num_seqs, kv):
        from tinypaged.sched.policies import schedule_step

        plan = schedule_step(running, waiting, budget, max_num_seqs, kv)
        plan.scheduled = [(r.request_id, n) for r, n in plan.scheduled]
        return plan

    llm = tiny(scheduler_cls=ids_step, num_gpu_blocks_override=64)
    with pytest.raises(InvariantError, match="request objects it was given.*not their ids"):
        llm.generate(PROMPTS[:2], PARAMS[:2])
    assert not llm.llm_engine.has_unfinished_requests()


def test_waiting_requests_are_looked_up_only_as_far_as_the_policy_reads():
    """Per-step work is O(batch): with 40 queued requests and room for 2, a step looks up the
    prefix cache for a few waiting requests, never for the whole queue."""
    llm = tiny(max_num_seqs=2, num_gpu_blocks_override=256, enable_prefix_caching=True)
    engine = llm.llm_engine
    lookups = []
    real = engine.kv.get_computed_blocks
    engine.kv.get_computed_blocks = lambda seq: (lookups.append(seq.seq_id), real(seq))[1]
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(40):
        engine.add_request(f"q{i}", {"prompt_token_ids": [5 + i, 6, 7, 8, 9]}, sp)
    per_step = []
    while engine.has_unfinished_requests():
        before = len(lookups)
        engine.step()
        per_step.append(len(lookups) - before)
    assert max(per_step) <= 3, per_step  # 2 admitted + the first that does not fit


def test_scheduled_seq_kind_is_a_boolean_taken_when_scheduled():
    from tinypaged.sched.output import ScheduledSeq

    llm = tiny(num_gpu_blocks_override=64)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3))
    first, second = engine.step(), engine.step()
    assert [s.is_prefill for s in first.scheduled] == [True] and [s.is_prefill for s in second.scheduled] == [False]
    with pytest.raises(TypeError):
        ScheduledSeq(first.scheduled[0].seq, 1, "prefill")  # the string form is gone


def test_beam_search_appends_through_the_scheduler():
    """The scheduler owns progress: beam tokens are appended by ``Scheduler.append_tokens``, so each
    beam's token times are recorded like a sampled sequence's."""
    from tinypaged import BeamSearchParams

    llm = tiny(num_gpu_blocks_override=64)
    sched = llm.llm_engine.scheduler
    calls, beams = [], []
    real = sched.append_tokens

    def spy(seqs, tokens, logprobs, now=None):
        calls.append(len(seqs))
        beams.extend(seqs)
        return real(seqs, tokens, logprobs, now)

    sched.append_tokens = spy
    out = llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    assert calls and len(out[0].sequences) == 2
    for b in beams:
        assert b.times.first_token is not None and b.times.token_times and b.cumulative_logprob < 0
