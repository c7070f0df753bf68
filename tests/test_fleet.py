"""The fleet (tinypaged/entrypoints/fleet.py): two ``tinypaged serve`` replicas of the tiny model behind vllm-router.

One fleet for the module (starting it is most of the time); the tests run in file order and the last two change
it: one replica is killed, then everything is stopped and no process may be left."""

import json
import os
import time
import urllib.error
import urllib.request

import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.__main__ import main
from tinypaged.entrypoints import fleet as fleet_mod
from tinypaged.entrypoints.fleet import Fleet, core_sets

PREFIX_A = list(range(300, 364))  # 64 tokens: 4 blocks of 16
PREFIX_B = list(range(1000, 1064))


def _post(url, body, timeout=120):
    return _post_to(url + "/v1/completions", body, timeout)


def _post_to(url, body, timeout=120):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def _ids(url, prompt, max_tokens=4):
    status, out = _post(url, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                              "return_token_ids": True})
    assert status == 200
    return out["choices"][0]["token_ids"]


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _tree(pid):
    out = [pid]
    for c in _children(pid):
        out += _tree(c)
    return out


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def fleet():
    f = Fleet(replicas=2, policy="round_robin", model="tiny", kv_events=True)
    f.start()
    yield f
    f.stop()


def test_bad_fleet_flags_are_refused_before_anything_starts(capsys, monkeypatch):
    monkeypatch.setattr(fleet_mod.Fleet, "start", lambda self: pytest.fail("the fleet was started"))
    for argv, word in ((["fleet", "--replicas", "0"], "--replicas"), (["fleet", "--policy", "fastest"], "--policy"),
                       (["fleet", "--model", "tiny", "--max-num-seqs", "x"], "--max-num-seqs"),
                       (["fleet", "--model", "tiny", "--no-such-flag"], "--no-such-flag")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert word in err and len(err.strip().splitlines()) == 1, err


def test_core_sets_are_disjoint_and_cover():
    assert core_sets(2, [0, 1]) == [[0], [1]]
    assert core_sets(2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert core_sets(3, [0, 1]) == [[0], [1], [0]]  # more replicas than cores: shared, round robin


def test_replicas_and_router_are_up_and_pinned(fleet):
    assert fleet.url.startswith("http://127.0.0.1:")
    assert all(u.startswith("http://127.0.0.1:") for u in fleet.replica_urls)
    assert fleet_mod._get(fleet.url + "/readiness")[0] == 200
    assert all(fleet_mod._get(u + "/health")[0] == 200 for u in fleet.replica_urls)
    for rep in fleet.replicas:
        assert sorted(os.sched_getaffinity(rep.proc.pid)) == rep.cores
        for child in _children(rep.proc.pid):  # the engine core process inherits the replica's cores
            assert sorted(os.sched_getaffinity(child)) == rep.cores
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(fleet.replicas[0].cores) & set(fleet.replicas[1].cores)


def test_router_outputs_equal_offline_greedy(fleet):
    prompts = [list(range(10, 30)), list(range(500, 537)), PREFIX_A[:20] + [7, 8, 9]]
    llm = LLM("tiny")
    offline = [o.outputs[0].token_ids for o in
               llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4, temperature=0))]
    assert [_ids(fleet.url, p) for p in prompts] == offline


def _shared_prefix_hits(fleet, policy, prefix, n=6):
    fleet.restart_router(policy)
    before = fleet.prefix_cache_hits()
    for i in range(n):
        _ids(fleet.url, prefix + [2000 + i, 2001, 2002], max_tokens=2)
    return [a - b for a, b in zip(fleet.prefix_cache_hits(), before)]


def test_cache_aware_gathers_prefix_hits_that_round_robin_spreads(fleet):
    rr = _shared_prefix_hits(fleet, "round_robin", PREFIX_A)
    ca = _shared_prefix_hits(fleet, "cache_aware", PREFIX_B)
    # round robin: each replica computes the prefix once (3 requests each, 2 hits each); cache-aware: one
    # replica computes it once, the other 5 requests hit there
    assert min(rr) > 0, rr
    assert sorted(ca)[0] == 0 and max(ca) > max(rr) and sum(ca) > sum(rr), (rr, ca)


def test_kv_aware_routes_on_the_replicas_real_caches(fleet):
    fleet.restart_router("kv_aware")
    prefix = list(range(3000, 3064))
    # where kv_aware gets a request's tokens: the replica's render API (vLLM's), nothing generated
    status, rendered = _post_to(fleet.replica_urls[0] + "/v1/completions/render", {"model": "tiny", "prompt": prefix})
    assert status == 200 and rendered[0]["token_ids"] == prefix
    # warm replica 1 directly, behind the router's back: only its KV events can tell the router
    status, _ = _post(fleet.replica_urls[1], {"model": "tiny", "prompt": prefix + [1, 2], "max_tokens": 1})
    assert status == 200
    time.sleep(0.5)  # the events travel over ZeroMQ
    before = fleet.metrics()
    for i in range(3):
        status, _ = _post(fleet.url, {"model": "tiny", "prompt": prefix + [10 + i, 11], "max_tokens": 1})
        assert status == 200
    after = fleet.metrics()
    requests = [a["requests"] - b["requests"] for a, b in zip(after, before)]
    assert requests == [0, 3], requests  # every request followed the cached prefix to replica 1
    assert after[1]["prefix_cache_hits"] - before[1]["prefix_cache_hits"] >= 3 * 16


def test_a_killed_replica_is_reported_and_the_other_keeps_serving(fleet):
    fleet.restart_router("round_robin")
    fleet.kill(0)
    report = fleet.check()
    assert len(report) == 1 and "replica 0" in report[0] and "1 of 2 still serving" in report[0]
    assert fleet.check() == []  # reported once
    before = fleet.metrics()[1]["requests"]
    for i in range(4):  # the router's health check (every second) takes replica 0 out; it retries meanwhile
        assert _ids(fleet.url, [40 + i, 41, 42]) is not None
    assert fleet.metrics()[1]["requests"] - before == 4


def test_stop_leaves_no_process(fleet):
    pids = [p for r in fleet.replicas for p in _tree(r.proc.pid)] + _tree(fleet.router.pid)
    assert len(pids) >= 3
    fleet.stop()
    deadline = time.monotonic() + 20
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _running(p)]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(fleet.url + "/readiness", timeout=2)


def test_the_start_up_message_gives_one_request_to_try():
    """``fleet`` prints a curl command for one completion through the router, under the name the replicas serve."""
    url = "http://127.0.0.1:8000"
    line = fleet_mod.example_request(url, "tiny")
    assert line.startswith(f"curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '")
    body = json.loads(line.split(" -d '", 1)[1].rstrip("'"))
    assert body["model"] == "tiny" and body["prompt"] and body["max_tokens"] > 0
    for args in (["--served-model-name", "mine"], ["--served-model-name=mine"]):
        assert json.loads(fleet_mod.example_request(url, "tiny", args).split(" -d '", 1)[1].rstrip("'"))["model"] == "mine"
    import inspect
    assert "example_request(fleet.url" in inspect.getsource(fleet_mod.run)
