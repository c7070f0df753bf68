"""The engine core process's client (issue #47): fire-and-forget adds, stats with every output, n > 1 as children.

* ``submit`` sends ``Add`` and returns; the core answers only a refusal (``Rejected``), which ends the request with a
  ``Rejection`` event, and over HTTP that is still a 400 with the engine's message, streaming or not;
* every ``Outputs`` carries the scheduler's stats; the client keeps the latest and ``/metrics`` reads its gauges
  from them without asking the core;
* ``parallel_sampling="fanout"`` (the core says so in ``Ready``): ``n > 1`` is ``n`` child requests ``f"{k}_{id}"``
  (``n=1``, seed ``seed + k``) joined back into the parent's samples; over HTTP the answers equal ``LLM.generate``
  in-process with the same knobs (texts, token ids, finish and stop reasons).

The client's half is checked without processes (a ``CoreClient`` never started: its socket is a list, its tokenizer
a table); the core's half in-process on the ``tiny`` model; the whole on ``python -m tinypaged serve`` (127.0.0.1).
"""

from __future__ import annotations

import json
import os
import signal
import time
from types import SimpleNamespace

import httpx
import msgspec
import pytest
from served import start_server, wait_for_health

from tinypaged import LLM, SamplingParams
from tinypaged.entrypoints import engine_core as ec
from tinypaged.entrypoints.engine_client import Rejection
from test_process_detok import _Socket, _Tokenizer as _PiecesTokenizer


class _Tokenizer(_PiecesTokenizer):
    def decode(self, ids, skip_special_tokens=True):
        if 66 in ids:
            raise RuntimeError("a broken tokenizer")
        return super().decode(ids, skip_special_tokens)


class _Observer:
    def __init__(self):
        self.finished = []

    def on_step(self, result):
        pass

    def on_token_gap(self, seconds):
        pass

    def on_finish(self, sub, out):
        self.finished.append((sub.request_id, [(c.index, c.finish_reason) for c in out.outputs], out.metrics))


def _client(parallel_sampling="fork"):
    """A ``CoreClient`` that was never started, as if its core had said ``Ready``."""
    from tinypaged.entrypoints.core_client import CoreClient

    client = CoreClient({"model": "tiny"}, observer=_Observer())
    client.channel.to_core, client.outputs._tokenizer = _Socket(), _Tokenizer()
    client.max_num_seqs, client.vocab_size, client.parallel_sampling = 4, 8, parallel_sampling
    return client


def _sent(client) -> list:
    out = [msgspec.msgpack.decode(m, type=ec.ToCore) for m in client.channel.to_core.sent]
    client.channel.to_core.sent.clear()
    return out


def test_an_add_is_fire_and_forget_and_a_rejection_is_its_one_event():
    client = _client()
    events = []
    sub = client.submit("r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), events.append,
                        priority=2)
    (add,) = _sent(client)
    assert isinstance(add, ec.Add) and add.priority == 2 and sub.num_prompt_tokens == 3  # the usage's, known here
    assert client.num_in_flight == 1 and not events  # nothing waited for: no Added exists
    assert "Added" not in dir(ec)
    client._handle(ec.Rejected("r", "ValueError", "Request r: priority is not supported by 'fcfs'"))
    (ev,) = events
    assert isinstance(ev, Rejection) and ev.finished and ev.request_id == "r"
    assert isinstance(ev.exception(), ValueError) and "priority" in str(ev.exception())
    assert client.num_in_flight == 0 and not client.requests.texts
    client._handle(ec.Rejected("r", "ValueError", "again"))  # a request ends once
    assert len(events) == 1
    with pytest.raises(ValueError, match="does not fit in 64 bits"):  # checked here: nothing booked, nothing sent
        client.submit("big", {"prompt_token_ids": [1, 2**70]}, SamplingParams(max_tokens=4), events.append)
    assert client.num_in_flight == 0 and not _sent(client)


def test_outputs_carry_stats_and_the_gauges_read_them_without_asking_the_core():
    from tinypaged.entrypoints.server_metrics import ServerMetrics

    client = _client()
    asked = []
    client.engine_metrics = lambda: asked.append(1) or {"num_running": 9, "num_waiting": 9, "kv_cache_usage": 0.9}
    metrics = ServerMetrics("tiny")
    metrics.watch(client)
    text = metrics.render().decode()
    assert asked and "vllm:num_requests_running{model_name=\"tiny\"} 9.0" in text  # no output yet: the core's
    stats = {"num_running": 2, "num_waiting": 1, "num_swapped": 2, "kv_cache_usage": 0.25, "num_preemptions": 3,
             "prefix_cache_queries": 40, "prefix_cache_hits": 16}
    client._handle(ec.Outputs([], [], stats))
    asked.clear()
    text = metrics.render().decode()
    assert not asked and client.stats == stats
    for line in ('vllm:num_requests_running{model_name="tiny"} 2.0', 'vllm:num_requests_waiting{model_name="tiny"} 3.0',
                 'vllm:kv_cache_usage_perc{model_name="tiny"} 0.25', 'vllm:num_preemptions_total{model_name="tiny"} 3.0',
                 'vllm:prefix_cache_hits_total{model_name="tiny"} 16.0'):
        assert line in text, text


def test_fanout_children_join_into_the_parents_samples():
    client = _client("fanout")
    events = []
    sub = client.submit("r", {"prompt_token_ids": [1, 2]}, SamplingParams(n=3, seed=7, max_tokens=3, stop=["cd"]),
                        events.append)
    adds = _sent(client)
    assert [a.request_id for a in adds] == ["0_r", "1_r", "2_r"]  # vLLM's child ids
    assert [(a.params.n, a.params.seed) for a in adds] == [(1, 7), (1, 8), (1, 9)]
    assert sub.num_samples == 3 and client.num_in_flight == 1  # the parent takes one slot
    tok = ec.Token
    client._handle(ec.Outputs([tok("0_r", 0, 1), tok("1_r", 0, 1), tok("2_r", 0, 4)], []))
    client._handle(ec.Outputs([tok("0_r", 0, 4), tok("1_r", 0, 2), tok("2_r", 0, 4)], []))
    client._handle(ec.Outputs([tok("0_r", 0, 4), tok("1_r", 0, 3), tok("2_r", 0, 4, "length")],
                              [ec.Finished("2_r", [ec.Choice(0, "length", None)], None, 0.5, 2.0)]))
    # sample 1's text "abcde" holds the stop string: its child is aborted in the core (not StopSample)
    assert _sent(client) == [ec.Abort(["1_r"], stopped=True)]
    client._handle(ec.Outputs([], [ec.Finished("1_r", [ec.Choice(0, "abort", None)], None, 0.25, 1.0)]))
    assert client.num_in_flight == 1 and client.observer.finished == []
    client.abort("r")  # aborting the parent aborts the children still running
    assert _sent(client) == [ec.Abort(["0_r"])]
    client._handle(ec.Outputs([], [ec.Finished("0_r", [ec.Choice(0, "abort", None)])]))
    assert all(e.request_id == "r" for e in events)
    text = {k: "".join(e.text for e in events if e.index == k) for k in range(3)}
    assert text == {0: "abf", 1: "ab", 2: "fff"}  # an aborted sample: what had settled ("cd" holds one back)
    ends = sorted((e.index, e.finish_reason, e.stop_reason) for e in events if e.finished)
    assert ends == [(0, "abort", None), (1, "stop", "cd"), (2, "length", None)]
    ((rid, choices, m),) = client.observer.finished  # the parent is observed once, when its last child ends
    assert rid == "r" and choices == [(0, "abort"), (1, "stop"), (2, "length")]
    assert (m.time_to_first_token, m.e2e_latency) == (0.25, 2.0)
    assert client.num_in_flight == 0 and not client.requests.live and not client.requests.fanouts


def test_a_rejected_or_failed_child_fails_its_parent_and_aborts_its_siblings():
    client = _client("fanout")
    first, second = [], []
    client.submit("a", {"prompt_token_ids": [1]}, SamplingParams(n=2, max_tokens=3), first.append)
    client.submit("b", {"prompt_token_ids": [1]}, SamplingParams(n=2, max_tokens=3), second.append)
    _sent(client)
    client._handle(ec.Rejected("0_a", "NotImplementedError", "a plug-in's rule"))  # before any event: a Rejection
    assert _sent(client) == [ec.Abort(["1_a"])]
    (ev,) = first
    assert isinstance(ev, Rejection) and ev.request_id == "a" and isinstance(ev.exception(), NotImplementedError)
    client._handle(ec.Outputs([ec.Token("1_a", 0, 1), ec.Token("0_b", 0, 1)], []))  # the aborted sibling's: dropped
    client._handle(ec.Outputs([], [ec.Finished("1_b", [ec.Choice(0, None, None)], "request 1_b failed: nan")]))
    assert _sent(client) == [ec.Abort(["0_b"])]
    assert [(e.index, e.text, e.finished, e.error) for e in second] == [(0, "ab", False, None),
                                                                         (0, "", True, "request 1_b failed: nan")]
    client._handle(ec.Outputs([], [ec.Finished("0_b", [ec.Choice(0, "abort", None)])]))  # ended already: dropped
    assert len(first) == 1 and len(second) == 2 and client.num_in_flight == 0
    assert [c for _, c, _ in client.observer.finished] == [[(0, None), (1, None)]]  # b, as a failure


@pytest.mark.usefixtures("shared_weights")
def test_the_core_answers_only_refusals_and_sends_stats_with_every_output():
    from tinypaged.config import EngineConfig
    from tinypaged.engine.core import EngineCore

    engine = EngineCore(EngineConfig(model="tiny", dtype="float32", device="cpu", block_size=4,
                                     num_gpu_blocks_override=64))
    out = _Socket()
    core = ec.EngineCoreProc(engine, None, out, os.getppid())
    params = ec.params_message(SamplingParams(max_tokens=3, ignore_eos=True))
    core.handle(ec.Add("ok", None, [1, 2, 3], params))
    core.handle(ec.Add("bad", None, [1, 2, 3], params, priority=1))  # a priority under fcfs
    assert [type(m).__name__ for m in (msgspec.msgpack.decode(x, type=ec.FromCore) for x in out.sent)] == ["Rejected"]
    while engine.has_unfinished_requests():
        core.step()
    msgs = [msgspec.msgpack.decode(x, type=ec.FromCore) for x in out.sent]
    (rejected,) = [m for m in msgs if isinstance(m, ec.Rejected)]
    assert rejected.request_id == "bad" and "priority" in rejected.message
    outputs = [m for m in msgs if isinstance(m, ec.Outputs)]
    assert outputs and all(m.stats is not None and set(m.stats) == set(engine.scheduler_stats()) for m in outputs)
    assert outputs[-1].finished[0].request_id == "ok" and outputs[-1].stats["num_running"] == 0
    assert outputs[0].stats["num_running"] == 1 and outputs[0].stats["kv_cache_usage"] > 0


# -- over HTTP: python -m tinypaged serve --parallel-sampling fanout (the engine core in its own process) ------------
KNOBS = dict(dtype="float32", device="cpu", block_size=16, num_gpu_blocks_override=160, max_num_seqs=16)
PROMPT = "Once upon a time"
SAMPLED = dict(n=3, temperature=0.8, seed=11, max_tokens=16)


@pytest.fixture(scope="module", params=["process", "in-process"])
def fanout_server(request, tmp_path_factory):
    """``serve --parallel-sampling fanout``: the engine core in its own process (``CoreClient`` fans out), or in the
    server's (``--no-multiprocessing``: ``LLMEngine`` fans out, ``EngineLoop`` joins the children's tokens)."""
    from tinypaged.model.loader import smollm2_folder

    try:
        smollm2_folder()
    except FileNotFoundError:
        pytest.skip("the tiny model borrows SmolLM2's tokenizer, which is not installed here: no text")
    log = tmp_path_factory.mktemp("process_fanout") / "serve.log"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in KNOBS.items()] + ["--parallel-sampling", "fanout"]
    proc, url = start_server(flags + (["--no-multiprocessing"] if request.param == "in-process" else []), log,
                             start_new_session=True)  # its engine core too: killed as a group
    try:
        wait_for_health(proc, url, log)
        yield SimpleNamespace(url=url, log=log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _post(url, body):
    return httpx.post(url + "/v1/completions", json={"prompt": PROMPT, **SAMPLED, **body}, timeout=120)


def _stream(url, body) -> tuple[int, list]:
    """(status, the chunks or the error body) of a streamed completion."""
    body = {"prompt": PROMPT, **SAMPLED, **body, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        return 200, [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]


def _wait_idle(url):
    from served import metrics

    deadline = time.monotonic() + 60
    while True:
        m = metrics(url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_fanout_over_http_equals_the_in_process_engine(fanout_server):
    llm = LLM("tiny", parallel_sampling="fanout", **KNOBS)
    free = [c.text for c in llm.generate(PROMPT, SamplingParams(**SAMPLED))[0].outputs]
    # stop strings cut from samples 0 and 2's own text (each found in no other sample): they really fire
    stops = []
    for k in (0, 2):
        text = free[k]
        stops.append(next(text[i:i + 6] for i in range(2, len(text) - 6) if text[i - 1] == " "
                          and "\ufffd" not in text[i:i + 6] and all(text[i:i + 6] not in o for o in free if o != text)))
    (ref,) = llm.generate(PROMPT, SamplingParams(**SAMPLED, stop=stops))
    want = [(c.text, list(c.token_ids), c.finish_reason, c.stop_reason) for c in ref.outputs]
    assert [w[2:] for w in want] == [("stop", stops[0]), ("length", None), ("stop", stops[1])]
    body = {"stop": stops, "return_token_ids": True}
    r = _post(fanout_server.url, body)
    assert r.status_code == 200, r.text
    got = [(c["text"], c["token_ids"], c["finish_reason"], c["stop_reason"]) for c in r.json()["choices"]]
    assert got == want
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(ref.prompt_token_ids)  # once for the parent, as in fork mode
    assert usage["completion_tokens"] == sum(len(w[1]) for w in want)
    status, chunks = _stream(fanout_server.url, body)
    assert status == 200
    streamed = {k: ["", [], None, None] for k in range(3)}
    for chunk in chunks:
        for c in chunk["choices"]:
            mine = streamed[c["index"]]
            mine[0] += c["text"]
            mine[1] += c["token_ids"]
            if c["finish_reason"] is not None:
                mine[2], mine[3] = c["finish_reason"], c["stop_reason"]
    assert [tuple(streamed[k]) for k in range(3)] == want
    many = _post(fanout_server.url, {"n": 20, "max_tokens": 2})  # fork would refuse n > max_num_seqs (16) samples
    assert many.status_code == 200 and len(many.json()["choices"]) == 20, many.text
    _wait_idle(fanout_server.url)  # every child ended in the core, its blocks freed


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_request_the_core_refuses_is_a_400_streaming_or_not_and_disturbs_nothing(fanout_server, stream):
    call = _stream if stream else (lambda url, body: (lambda r: (r.status_code, r.json()))(_post(url, body)))
    ok = {"n": 1, "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", fanout_server.url + "/v1/completions", json={"prompt": PROMPT, **ok}, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        for body, param, words in (({"priority": 1}, "priority", "priority"),  # under fcfs: the core's check
                                   ({"n": 1, "max_tokens": 100000}, "max_tokens", "maximum context length")):
            status, err = call(fanout_server.url, body)
            assert status == 400 and err["error"]["param"] == param and words in err["error"]["message"], err
        rest = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"  # the open stream ran on
    _wait_idle(fanout_server.url)
