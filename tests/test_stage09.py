"""Stage 9: the cache-aware router (the assignment), the routing proxy, the fleet simulator, and the checks.

One test starts real replicas (two in-process tiny-model servers behind the proxy, through the ``router_in_proxy``
check); the rest need no model: the proxy's bounds run against a fake replica, the simulator against itself.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from pathlib import Path

import httpx
import pytest

from tinypaged.course import checks
from tinypaged.course.checks import stage09
from tinypaged.course.grading import notebook as nbk
from tinypaged.entrypoints.router_proxy import RouterProxy, routing_key
from tinypaged.kv.radix_cache import RadixTree
from tinypaged.lab import routing
from tinypaged.lab.fleet_sim import mixed_trace, simulate_fleet
from tinypaged.lab.routing import CacheAwareRouter, RoundRobin, make_policy

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "09_many_engines.ipynb"
EXERCISE = ROOT / "exercises" / "09_many_engines.ipynb"
HIDDEN = 24681


def _definitions(path: Path) -> dict:
    """The notebook's code cells but its test cells (which run the checks) and its __main__ demo, in one namespace."""
    ns = {"__name__": "__submission__"}
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code" and not nbk.is_test(cell):
            exec(compile(nbk.source_of(cell), str(path), "exec"), ns)
    return ns


@pytest.fixture(scope="module")
def notebooks():
    return _definitions(SOLUTION), _definitions(EXERCISE)


def _variant(old: str, new: str):
    """The package's router with one line changed, defined as a notebook would define it."""
    src = inspect.getsource(CacheAwareRouter)
    assert old in src
    ns = {"RadixTree": RadixTree}
    exec(src.replace(old, new), ns)
    return ns["CacheAwareRouter"]


def test_solution_gets_every_point_and_the_untouched_exercise_none(notebooks):
    solved, untouched = notebooks
    for hidden in (None, HIDDEN):
        assert checks.evaluate("cache_aware_router", solved["CacheAwareRouter"], hidden)[0] == checks.PASS
        assert checks.evaluate("cache_aware_router", untouched["CacheAwareRouter"], hidden)[0] == checks.TODO
    # the proxy check refuses an unfinished router before any replica starts (cheap)
    assert checks.evaluate("router_in_proxy", untouched["CacheAwareRouter"])[0] == checks.TODO


@pytest.mark.parametrize("old,new", [
    ("balance_abs_threshold and hi", "balance_abs_threshold or hi"),  # one threshold instead of both
    ("(matched[r], -r)", "(matched[r], r)"),  # ties to the highest index
    ("> self.cache_threshold", ">= self.cache_threshold"),  # at the threshold is not above it
    ("if over > 0:", "if False:"),  # no eviction by size
    ("min(replicas, key=lambda r: self.tree_size(r))", "min(replicas, key=lambda r: self.load[r])"),
])
def test_visible_cases_catch_a_wrong_router(old, new):
    status, msg = checks.evaluate("cache_aware_router", _variant(old, new))
    assert status == checks.FAIL and msg.startswith("case '"), msg


def test_the_router_in_the_proxy_in_front_of_two_real_replicas(notebooks):
    """Six requests through the proxy with the solution's router: the decisions, the replicas' hit tokens those
    decisions earn, outputs equal to the offline engine's greedy tokens, /health (the check records all four)."""
    solved, _ = notebooks
    status, msg = checks.evaluate("router_in_proxy", solved["CacheAwareRouter"])
    assert status == checks.PASS, msg
    # the first recorded step tells a router that ignores the cache apart (without starting replicas again)
    assert stage09._decisions(RoundRobin) != stage09._decisions(solved["CacheAwareRouter"])


def test_router_knobs_are_checked_and_named():
    for kw, knob in ((dict(num_replicas=0), "num_replicas"), (dict(num_replicas=2, cache_threshold=1.5),
                                                              "cache_threshold"),
                     (dict(num_replicas=2, max_tree_size=0), "max_tree_size"),
                     (dict(num_replicas=2, balance_abs_threshold=-1), "balance_abs_threshold")):
        with pytest.raises(ValueError, match=knob):
            CacheAwareRouter(**kw)
    r = CacheAwareRouter(2)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        r.route([])
    with pytest.raises(ValueError, match="finished"):
        r.finished(1)
    assert r.load == [0, 0]
    with pytest.raises(ValueError, match="policy"):
        make_policy("cache-aware", 2)
    with pytest.raises(ValueError, match="lookup"):
        make_policy("precise", 2)


def test_routing_key():
    assert routing_key({"prompt": [5, 6]}) == [5, 6]
    assert routing_key({"prompt": "hi"}) == list(b"hi") == routing_key({"prompt": ["hi"]})
    assert routing_key({"messages": [{"role": "user", "content": "hi"}]}) == list(b"hi")
    with pytest.raises(ValueError, match="prompt"):
        routing_key({"max_tokens": 3})


# ---------------------------------------------------------------- the proxy, against a fake replica

def _fake_replica():
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from tinypaged.entrypoints.server import ServerThread

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict):
        if body.get("stream"):
            async def chunks():
                for i in range(body.get("chunks", 3)):
                    yield f"data: {json.dumps({'i': i})}\n\n".encode()
                    await asyncio.sleep(0 if i < 3 else 0.05)
                yield b"data: [DONE]\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
        return {"echo": body["prompt"]}

    @app.get("/health")
    async def health():
        return {}

    return ServerThread(app)


class _Recorder:
    def __init__(self, answer=0):
        self.answer, self.load, self.calls = answer, 0, []

    def route(self, ids):
        self.calls.append(list(ids))
        if isinstance(self.answer, Exception):
            raise self.answer
        self.load += 1
        return self.answer

    def finished(self, replica):
        self.load -= 1


def test_proxy_passes_requests_and_streams_through_and_gives_the_load_back():
    replica = _fake_replica()
    policy = _Recorder()
    try:
        with RouterProxy(policy, [replica.url]) as proxy, httpx.Client(timeout=30) as c:
            r = c.post(proxy.url + "/v1/completions", json={"prompt": [1, 2, 3]})
            assert r.status_code == 200 and r.json() == {"echo": [1, 2, 3]} and r.headers["x-routed-to"] == "0"
            with c.stream("POST", proxy.url + "/v1/completions", json={"prompt": "ab", "stream": True}) as s:
                lines = [line for line in s.iter_lines() if line]
            assert lines == ['data: {"i": 0}', 'data: {"i": 1}', 'data: {"i": 2}', "data: [DONE]"]
            assert c.get(proxy.url + "/health").status_code == 200
            deadline = time.monotonic() + 10
            while policy.load and time.monotonic() < deadline:  # the stream's finished() runs after its last byte
                time.sleep(0.02)
            assert policy.calls == [[1, 2, 3], list(b"ab")] and policy.load == 0 and proxy.routed == [2]
    finally:
        replica.close()


def test_a_client_that_hangs_up_mid_stream_gives_the_load_back():
    replica = _fake_replica()
    policy = _Recorder()
    try:
        with RouterProxy(policy, [replica.url]) as proxy, httpx.Client(timeout=30) as c:
            with c.stream("POST", proxy.url + "/v1/completions", json={"prompt": [1], "stream": True,
                                                                       "chunks": 200}) as s:
                assert next(s.iter_lines()) == 'data: {"i": 0}' and policy.load == 1
            deadline = time.monotonic() + 10  # the replica would stream for 10 s more
            while policy.load and time.monotonic() < deadline:
                time.sleep(0.02)
            assert policy.load == 0
            assert c.post(proxy.url + "/v1/completions", json={"prompt": [2]}).status_code == 200
    finally:
        replica.close()


def test_proxy_errors_name_the_cause_and_keep_serving():
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    policy = _Recorder()
    with RouterProxy(policy, [dead], max_body_bytes=64) as proxy, httpx.Client(timeout=30) as c:
        r = c.post(proxy.url + "/v1/completions", json={"prompt": [1]})
        assert r.status_code == 502 and "replica 0" in r.json()["error"]["message"] and policy.load == 0
        r = c.post(proxy.url + "/v1/completions", content=b"not json")
        assert r.status_code == 400
        r = c.post(proxy.url + "/v1/completions", json={"prompt": [1] * 100})
        assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
        assert len(policy.calls) == 1  # neither bad request reached the policy
        assert c.get(proxy.url + "/health").status_code == 503
        policy.answer = 5
        r = c.post(proxy.url + "/v1/completions", json={"prompt": [1]})
        assert r.status_code == 500 and "replica 5" in r.json()["error"]["message"]
        policy.answer, policy.load = KeyError("boom"), 0
        r = c.post(proxy.url + "/v1/completions", json={"prompt": [1]})
        assert r.status_code == 500 and "routing policy failed" in r.json()["error"]["message"]
    with pytest.raises(TypeError, match="route"):
        RouterProxy(object(), [dead])


# ---------------------------------------------------------------- the fleet simulator

def test_cache_aware_finds_more_cached_tokens_than_round_robin_in_the_simulator():
    trace = mixed_trace(16 * 20, rate=16 * 4.0, seed=3)
    rr, ca = (simulate_fleet(trace, p, 16) for p in ("round_robin", "cache_aware"))
    assert ca.hit_tokens > 1.5 * rr.hit_tokens
    assert rr.per_replica == [20] * 16  # round robin is even
    assert sum(ca.per_replica) == len(trace) == len(ca.ttft) and min(ca.ttft) > 0
    # the learner's class runs as a policy object too, with the same decisions as the package's name
    assert simulate_fleet(trace, CacheAwareRouter(16), 16).went == ca.went


def test_the_simulator_runs_64_replicas_in_seconds():
    trace = mixed_trace(64 * 30, rate=64 * 4.0, seed=0)
    t0 = time.process_time()
    for policy in ("cache_aware", "precise"):
        res = simulate_fleet(trace, policy, 64)
        assert len(res.ttft) == len(trace) and res.num_replicas == 64
    assert time.process_time() - t0 < 10, "two 64-replica runs took more than 10 CPU seconds"


def test_simulator_inputs_are_checked():
    trace = mixed_trace(10, rate=1.0)
    with pytest.raises(ValueError, match="num_replicas"):
        simulate_fleet(trace, "round_robin", 0)
    with pytest.raises(ValueError, match="policy"):
        simulate_fleet(trace, "random", 2)
    with pytest.raises(ValueError, match="num_requests"):
        mixed_trace(0, rate=1.0)


def test_every_policy_is_a_name_the_simulator_knows():
    trace = mixed_trace(40, rate=8.0, seed=2)
    for name in routing.POLICIES:
        assert sum(simulate_fleet(trace, name, 4).per_replica) == 40


def test_a_router_that_bypasses_matched_fails_and_the_reference_passes(notebooks):
    """``matched`` is the hook a precise router overrides (``PreciseRouter``: what the replicas' KV events say they
    hold). A ``route`` that reads its trees itself routes the same in every other case; the case with a subclass
    told what the replicas hold tells it apart."""
    bypass = _variant("matched = [self.matched(r, key) for r in replicas]",
                      "matched = [len(self.trees[r].match_prefix(key)[0]) for r in replicas]")
    status, msg = checks.evaluate("cache_aware_router", bypass)
    assert status == checks.FAIL and "route asks self.matched" in msg and "self.matched(r, key)" in msg, msg
    reference = _variant("def route(", "def route(")  # the package's code, defined as a notebook defines it
    assert checks.evaluate("cache_aware_router", reference)[0] == checks.PASS
    solved, _ = notebooks
    assert checks.evaluate("cache_aware_router", solved["CacheAwareRouter"])[0] == checks.PASS
    # the told case is the only one the bypass fails: every other visible case routes on the trees alone
    cases = checks.get("cache_aware_router").cases(None)
    told = [c for c in cases if c.label.startswith("route asks self.matched")]
    assert len(told) == 1
