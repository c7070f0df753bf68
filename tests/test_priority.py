"""vLLM's priority scheduling (issue 48's ``priority`` field): ``scheduling_policy="priority"`` orders the waiting
queue by (priority, arrival), lower first, and preempts the running request with the largest priority value (then
the latest arrival) when the KV cache runs out; a non-zero priority under "fcfs" is refused, as vLLM refuses it.
Priority changes the order of work, never a request's tokens. Offline (``LLM.generate(priority=[...])``) and served
(the ``priority`` field of both routes, in-process and through the engine-core process)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import httpx
import pytest
from served import start_server, wait_for_health

from tinypaged import LLM, EngineConfig, SamplingParams
from tinypaged.entrypoints.server import ServerThread, create_app
from tinypaged.sched.policies import BlockCounter, FcfsOrder, PriorityOrder, schedule_step
from tinypaged.sched.radix_policy import CacheAwareOrder

pytestmark = pytest.mark.usefixtures("shared_weights")

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(11 * i + 5 * j) % 3000 + 7 for j in range(4 + 3 * i)]} for i in range(5)]


def tiny(**kw):
    kw = {"dtype": "float64", "device": "cpu", "block_size": 4, "max_model_len": 128, "history_size": 0, **kw}
    return LLM("tiny", **kw)


def finish_order(llm, prompts, priority=None, params=PARAMS):
    """The prompts' indices in the order their requests finished, and each one's tokens."""
    order = []
    outs = llm.generate(prompts, params, priority=priority,
                        on_step=lambda step: order.extend(o.request_id for o in step.finished))
    index = {o.request_id: i for i, o in enumerate(outs)}
    return [index[r] for r in order], [o.outputs[0].token_ids for o in outs]


# -- the knob -----------------------------------------------------------------------------------------------------
def test_policy_names_are_vllms():
    assert EngineConfig(model="tiny").scheduling_policy == "fcfs"  # vLLM's default
    for name in ("fcfs", "priority", "lpm"):
        assert EngineConfig(model="tiny", scheduling_policy=name).scheduling_policy == name
    with pytest.raises(ValueError, match=r"scheduling_policy='fifo': use 'fcfs', 'priority', 'lpm'"):
        EngineConfig(model="tiny", scheduling_policy="fifo")


def test_lpm_is_nameable_and_changes_no_tokens():
    from tinypaged.sched.radix_policy import CacheAwareOrder

    llm = tiny(scheduling_policy="lpm", enable_prefix_caching=True)
    order = llm.llm_engine.scheduler.order
    assert isinstance(order, CacheAwareOrder) and order.order == "lpm"
    shared = [{"prompt_token_ids": [9] * 12 + p["prompt_token_ids"]} for p in PROMPTS]
    assert finish_order(llm, shared)[1] == finish_order(tiny(), shared)[1]


def test_serve_flag_takes_the_policy_names():
    import argparse

    from tinypaged.entrypoints.cli_args import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    for name in ("fcfs", "priority", "lpm"):
        assert ap.parse_args(["--scheduling-policy", name]).scheduling_policy == name
    assert ap.parse_args(["--scheduler-cls", "static"]).scheduler_cls == "static"
    with pytest.raises(SystemExit):
        ap.parse_args(["--scheduling-policy", "fifo"])


# -- order ----------------------------------------------------------------------------------------------------------
def test_priority_orders_the_waiting_queue_ties_by_arrival():
    """One request at a time: they finish in (priority, arrival) order under "priority", arrival order under fcfs."""
    prio = [3, 1, 2, 1, 0]
    order, tokens = finish_order(tiny(scheduling_policy="priority", max_num_seqs=1), PROMPTS, prio)
    assert order == [4, 1, 3, 2, 0]
    fcfs_order, fcfs_tokens = finish_order(tiny(max_num_seqs=1), PROMPTS)
    assert fcfs_order == [0, 1, 2, 3, 4]
    assert tokens == fcfs_tokens  # the order changed, the content did not


def test_same_tokens_as_fcfs_under_preemption():
    """Batched, with a KV cache too small for everyone (preemptions on both sides): each request's tokens are
    fcfs's, whatever its priority."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    knobs = dict(max_num_seqs=4, num_gpu_blocks_override=14)
    preempted = []
    llm = tiny(scheduling_policy="priority", **knobs)
    outs = llm.generate(PROMPTS, params, priority=[2, 0, 1, 0, 3],
                        on_step=lambda step: preempted.extend(step.preempted))
    ref = tiny(**knobs).generate(PROMPTS, params)
    assert preempted, "the cache was meant to be too small: nothing was preempted"
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


# -- preemption -----------------------------------------------------------------------------------------------------
def _running(*specs):
    """Running requests as the step sees them (the engine's QueuedRequest shape): (name, priority, arrival)."""
    return [SimpleNamespace(request_id=name, num_new_tokens=1, num_seqs=1,
                            seqs=(SimpleNamespace(priority=p, times=SimpleNamespace(arrival=t)),))
            for name, p, t in specs]


@pytest.mark.parametrize("specs, fcfs_victim, priority_victim", [
    # admission order A, B, C; each holds one full block, one block is free: two of them must grow, one yields
    ([("A", 0, 0.0), ("B", 5, 1.0), ("C", 1, 2.0)], "C", "B"),  # the largest priority value yields
    ([("A", 2, 0.0), ("B", 2, 1.0), ("C", 0, 2.0)], "C", "B"),  # equal priorities: the latest arrival yields
])
def test_preemption_takes_the_lowest_priority(specs, fcfs_victim, priority_victim):
    def victims(order):
        running = _running(*specs)
        kv = BlockCounter(num_blocks=4, block_size=4, held={r.request_id: 4 for r in running})
        plan = schedule_step(order.rank_running(running), [], 64, 8, kv)
        return [r.request_id for r in plan.preempted]

    assert victims(FcfsOrder()) == [fcfs_victim]
    assert victims(PriorityOrder()) == [priority_victim]


def test_engine_preempts_the_lowest_priority_running_request():
    """Through the engine: A (priority 9) runs first, B and C (0 and 1) join it, the three outgrow the cache; the first
    one preempted is A, the largest priority value, though admitted first (under fcfs: C, the latest admitted)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    knobs = dict(max_num_seqs=3, num_gpu_blocks_override=12)

    def first_victim(policy, priority):
        engine = tiny(scheduling_policy=policy, **knobs).llm_engine
        engine.add_request("A", PROMPTS[0], params, priority=priority[0])
        preempted = list(engine.step().preempted)
        for name, prompt, prio in zip("BC", PROMPTS[1:3], priority[1:]):
            engine.add_request(name, prompt, params, priority=prio)
        while engine.scheduler.has_unfinished():
            preempted += engine.step().preempted
        assert preempted, "the cache was meant to be too small: nothing was preempted"
        return preempted[0].request_id

    assert first_victim("fcfs", [0, 0, 0]) == "C"
    assert first_victim("priority", [9, 0, 1]) == "A"
    assert first_victim("priority", [0, 1, 5]) == "C"
    assert first_victim("priority", [0, 5, 1]) == "B"


# -- refusals -------------------------------------------------------------------------------------------------------
def test_priority_needs_the_priority_policy():
    llm = tiny()
    with pytest.raises(ValueError, match=r"priority\[1\]=2 is not supported: priority scheduling is not enabled "
                                         r"\(scheduling_policy='fcfs'\)"):
        llm.generate(PROMPTS[:2], PARAMS, priority=[0, 2])
    assert not llm.llm_engine.requests  # nothing was queued
    assert len(llm.generate(PROMPTS[:2], PARAMS, priority=[0, 0])) == 2  # 0 is every request's default


@pytest.mark.parametrize("priority, error, message", [
    ([1.5, 0], TypeError, r"priority\[0\] must be an integer"),
    ([True, 0], TypeError, r"priority\[0\] must be an integer"),
    ([0, 2**70], ValueError, r"priority\[1\]=1180591620717411303424 is out of range"),
    ([0, -2**63 - 1], ValueError, r"priority\[1\]=-9223372036854775809 is out of range"),
    ([0], ValueError, r"Got 1 priority values for 2 prompts"),
    (3, TypeError, r"priority must be a list of integers, one per prompt"),
    ("01", TypeError, r"priority must be a list of integers"),
])
def test_bad_priority_values_are_refused_by_name(priority, error, message):
    llm = tiny(scheduling_policy="priority")
    with pytest.raises(error, match=message):
        llm.generate(PROMPTS[:2], PARAMS, priority=priority)
    assert not llm.llm_engine.requests
    with pytest.raises(TypeError, match=r"Request x: priority must be an integer"):
        llm.llm_engine.make_request("x", PROMPTS[0], PARAMS, priority=None)


# -- served ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers():
    """Two in-process servers on the same model: "priority" and the default "fcfs"."""
    knobs = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=128, block_size=4,
                 max_num_seqs=4, history_size=0)
    srv = {name: ServerThread(create_app(LLM("tiny", scheduling_policy=name, **knobs), "tiny"))
           for name in ("priority", "fcfs")}
    yield srv
    for s in srv.values():
        s.close()


def _post(url, body, path="/v1/completions"):
    return httpx.post(url + path, json=body, timeout=60)


def _completion(url, priority, path="/v1/completions"):
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    if path == "/v1/completions":
        body["prompt"] = [5, 6, 7, 8]
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]
    if priority is not None:
        body["priority"] = priority
    return _post(url, body, path)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_server_takes_priority_with_the_priority_policy(servers, path):
    plain = _completion(servers["fcfs"].url, None, path)
    assert plain.status_code == 200, plain.text
    for prio in (-3, 0, 5, 2**63 - 1):
        r = _completion(servers["priority"].url, prio, path)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0] == plain.json()["choices"][0]  # same content whatever the priority


@pytest.mark.parametrize("server, value, message", [
    ("fcfs", 5, "priority=5 is not supported: priority scheduling is not enabled"),
    ("priority", True, "priority must be an integer"),
    ("priority", 1.5, "priority must be an integer"),
    ("priority", "1", "priority must be an integer"),
    ("priority", 2**70, "priority=1180591620717411303424 is out of range"),
])
def test_server_refuses_bad_priority_by_name(servers, server, value, message):
    r = _completion(servers[server].url, value)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and message in err["message"], err
    assert _completion(servers[server].url, 0).status_code == 200  # nothing leaked, the server still serves


@pytest.mark.skipif(sys.platform == "win32", reason="ipc sockets")
def test_engine_core_process_carries_priority(tmp_path):
    """``serve --scheduling-policy priority`` (the engine core in its own process): the field reaches the core;
    one beyond 64 bits is a 400 naming it before the core sees it."""
    log = tmp_path / "serve.log"
    proc, url = start_server(["--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks-override", "128",
                              "--max-num-seqs", "4", "--scheduling-policy", "priority"], log)
    try:
        wait_for_health(proc, url, log)
        ok = [_completion(url, p) for p in (0, 4, -4)]
        assert all(r.status_code == 200 for r in ok), [r.text for r in ok]
        assert len({str(r.json()["choices"][0]["text"]) for r in ok}) == 1
        for value, message in ((2**70, "is out of range"), (False, "must be an integer")):
            err = _completion(url, value).json()["error"]
            assert err["param"] == "priority" and message in err["message"], err
    finally:
        proc.kill()
        proc.wait(30)


# -- the seams' registries --------------------------------------------------------------------------------------------
def test_radix_is_a_kv_cache_manager_name_with_the_same_tokens():
    from tinypaged.kv.radix_cache import RadixKVManager

    llm = tiny(kv_cache_manager="radix")
    assert isinstance(llm.llm_engine.scheduler.kv, RadixKVManager) and llm.llm_engine.config.kv_layout == "paged"
    assert finish_order(llm, PROMPTS)[1] == finish_order(tiny(), PROMPTS)[1]


def test_serve_help_is_made_from_the_registries():
    import argparse

    from tinypaged.config import ATTENTION_BACKENDS, KV_MANAGERS, SCHEDULERS, SCHEDULING_POLICIES
    from tinypaged.entrypoints.cli_args import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    helps = {a.dest: a.help for a in ap._actions}
    for dest, registry in (("kv_cache_manager", KV_MANAGERS), ("scheduling_policy", SCHEDULING_POLICIES),
                           ("attention_backend", ATTENTION_BACKENDS), ("scheduler_cls", SCHEDULERS)):
        for name, label in registry.items():
            assert f"{name}: {label}" in helps[dest]
        for name in registry:
            assert ap.parse_args([f"--{dest.replace('_', '-')}", name]).__dict__[dest] == name
    ap.format_help()  # argparse can render every label


# -- scheduler_cls: vLLM's knob for a custom scheduler ---------------------------------------------------------------
def test_scheduler_cls_takes_static_and_plug_ins_in_the_policy_s_order():
    from tinypaged.sched.policies import PlanPolicy
    from tinypaged.sched.radix_policy import CacheAwareOrder
    from tinypaged.sched.registry import make_scheduler
    from tinypaged.sched.static import StaticScheduler

    def my_step(running, waiting, budget, max_num_seqs, kv):
        return schedule_step(running, waiting, budget, max_num_seqs, kv)

    def config(**kw):
        return EngineConfig(model="tiny", device="cpu", **kw)

    static = config(scheduler_cls="static")
    assert isinstance(make_scheduler(static, None), StaticScheduler) and static.enable_chunked_prefill is False
    assert not static.has_plugins and config(scheduler_cls=my_step).has_plugins
    assert make_scheduler(config(scheduler_cls=my_step), None).step.step_fn is my_step
    assert isinstance(make_scheduler(config(scheduler_cls=my_step, scheduling_policy="priority"), None).order,
                      PriorityOrder)
    lpm = make_scheduler(config(scheduler_cls=PlanPolicy(my_step), scheduling_policy="lpm"), None)
    assert isinstance(lpm.order, CacheAwareOrder) and lpm.step.step_fn is my_step
    # the same tokens and order as the built-in step
    prio = [3, 1, 2, 1, 0]
    assert finish_order(tiny(scheduler_cls=my_step, scheduling_policy="priority", max_num_seqs=1), PROMPTS, prio) \
        == finish_order(tiny(scheduling_policy="priority", max_num_seqs=1), PROMPTS, prio)


@pytest.mark.parametrize("knobs, error, message", [
    (dict(scheduler_cls="orca"), ValueError, r"scheduler_cls='orca': use 'static', a schedule_step-like function"),
    (dict(scheduler_cls=5), TypeError, r"scheduler_cls must be 'static', a schedule_step-like function"),
    (dict(scheduler_cls=type("NoPlan", (), {})), TypeError, r"scheduler_cls=NoPlan is a class without a plan"),
    (dict(scheduler_cls="static", scheduling_policy=CacheAwareOrder("lpm")), ValueError,
     r"scheduling_policy=CacheAwareOrder\(\.\.\.\) orders the requests a step function plans over"),
    (dict(scheduler_cls="static", scheduling_policy="priority"), ValueError,
     r"scheduling_policy='priority' orders the requests a step function plans over: scheduler_cls='static' admits"),
    (dict(scheduler_cls="static", enable_chunked_prefill=True), ValueError,
     r"enable_chunked_prefill=True contradicts scheduler_cls='static'"),
])
def test_bad_scheduler_cls_is_refused_by_name(knobs, error, message):
    with pytest.raises(error, match=message):
        EngineConfig(model="tiny", device="cpu", **knobs)
