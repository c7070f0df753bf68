"""Detokenization and stop strings live in the API server's process, as vLLM v1's ``OutputProcessor``.

Two ``python -m tinypaged serve`` processes on 127.0.0.1, the ``tiny`` model and the same knobs: one with the engine
in-process (``--no-multiprocessing``: the engine searches stop strings) and one with the engine core in its own
process (the core sends token ids only; ``core_client.py`` detokenizes, finds stop strings and stops the sample in the
core). Over HTTP both must answer the same: text, ``finish_reason``, ``stop_reason``, usage, and streamed deltas that
add up to the text. Stop strings are cut from the tiny model's own output, so they really fire.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from served import wait_for_health

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="signals")

KNOBS = ["--model", "tiny", "--dtype", "float32", "--device", "cpu", "--block-size", "16",
         "--num-gpu-blocks-override", "160", "--max-num-seqs", "16", "--no-access-log"]
PROMPTS = ["Hello, my name is", "The capital of France is"]
SAMPLED = {"prompt": "Once upon a time", "n": 2, "temperature": 0.8, "seed": 11}


class Serve:
    """``python -m tinypaged serve`` in a subprocess (started without waiting: both servers load at once)."""

    def __init__(self, tmp, *flags):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp / f"serve-{port}.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        env.pop("TINYPAGED_ENABLE_MULTIPROCESSING", None)
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tinypaged", "serve", *KNOBS, "--port", str(port),
                                          *flags], stdout=subprocess.DEVNULL, stderr=err, env=env,
                                         start_new_session=True)  # its engine core too: killed as a group

    def ready(self) -> "Serve":
        wait_for_health(self.proc, self.url, self.log)
        return self

    def post(self, body: dict) -> dict:
        r = httpx.post(self.url + "/v1/completions", json={"max_tokens": 16, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, body: dict) -> dict:
        """The streamed answer folded into the non-streamed shape: text = the deltas joined."""
        body = {"max_tokens": 16, **body, "stream": True, "stream_options": {"include_usage": True}}
        choices, usage = {}, None
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                usage = chunk["usage"] or usage
                for c in chunk["choices"]:
                    mine = choices.setdefault(c["index"], {"index": c["index"], "text": "", "finish_reason": None,
                                                           "stop_reason": None})
                    mine["text"] += c["text"]
                    if c["finish_reason"] is not None:
                        mine["finish_reason"], mine["stop_reason"] = c["finish_reason"], c["stop_reason"]
        return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}

    def metrics(self) -> dict:
        """``/metrics`` by name; ``vllm:request_success_total`` by label as ``...:abort``, ``...:stop``, ..."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                key = name.split("{")[0]
                if 'finished_reason="' in name:
                    key += ":" + name.split('finished_reason="')[1].split('"')[0]
                out[key] = float(value)
        return out

    def wait_idle(self) -> dict:
        deadline = time.monotonic() + 60
        while True:
            m = self.metrics()
            if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
                return m
            assert time.monotonic() < deadline, m
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from tinypaged.model.loader import smollm2_folder

    try:
        smollm2_folder()
    except FileNotFoundError:
        pytest.skip("the tiny model borrows SmolLM2's tokenizer, which is not installed here: no text")
    tmp = tmp_path_factory.mktemp("process_detok")
    started = [Serve(tmp, "--no-multiprocessing"), Serve(tmp)]
    try:
        yield [s.ready() for s in started]
    finally:
        for s in started:
            s.close()


def _fold(body: dict) -> dict:
    return {"choices": [{k: c[k] for k in ("index", "text", "finish_reason", "stop_reason")} for c in body["choices"]],
            "usage": body["usage"]}


def _boundary_stop(srv, prompt: str) -> tuple[str, str]:
    """A stop string made of the last two characters of one token's text and the first two of the next (found
    nowhere earlier in the text), and the full greedy text. Without stop strings a stream sends each token's
    text with that token (return_token_ids shows one id per chunk), so chunks are token boundaries."""
    body = {"prompt": prompt, "temperature": 0, "max_tokens": 16, "stream": True, "return_token_ids": True}
    pieces = []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                (c,) = json.loads(line[6:])["choices"]
                assert len(c["token_ids"]) <= 1
                if c["token_ids"]:
                    pieces.append(c["text"])
    full = "".join(pieces)
    for k in range(1, len(pieces) - 1):
        head = "".join(pieces[:k + 1])
        stop = head[-2:] + pieces[k + 1][:2]
        if len(head) >= 4 and len(pieces[k + 1]) >= 2 and "\ufffd" not in stop and full.find(stop) == len(head) - 2:
            return stop, full
    pytest.skip("no token boundary with two plain characters on each side")


def test_stop_strings_over_http_are_the_same_in_both_servers(servers):
    threaded, process = servers
    greedy = [threaded.post({"prompt": p, "temperature": 0})["choices"][0]["text"] for p in PROMPTS]
    words = greedy[0].split()
    mid = next(w for w in words[2:] if len(w) >= 3 and "\ufffd" not in w)  # a word a few tokens in
    across, text1 = _boundary_stop(threaded, PROMPTS[1])
    assert text1 == greedy[1]
    ref = threaded.post({**SAMPLED, "max_tokens": 16})["choices"]
    first, second = ref[0]["text"], ref[1]["text"]
    early = next(first[i:i + 10] for i in range(1, len(first) - 10)
                 if first[i - 1] == " " and "\ufffd" not in first[i:i + 10] and first[i:i + 10] not in second)
    cases = [
        ({"prompt": PROMPTS[0], "temperature": 0, "stop": [mid]}, [("stop", mid, greedy[0][:greedy[0].find(mid)])]),
        ({"prompt": PROMPTS[1], "temperature": 0, "stop": ["zz@@zz", across]},
         [("stop", across, greedy[1][:greedy[1].find(across)])]),
        ({"prompt": PROMPTS[1], "temperature": 0, "stop": ["zz@@zz"]}, [("length", None, greedy[1])]),
        ({**SAMPLED, "max_tokens": 16, "stop": [early]},
         [("stop", early, first[:first.find(early)]), ("length", None, second)]),
    ]
    with ThreadPoolExecutor(2) as pool:  # the two servers at once (each answers its requests one at a time)
        runs = list(pool.map(lambda s: [(_fold(s.post(body)), s.stream(body)) for body, _ in cases], servers))
    for i, (body, want) in enumerate(cases):
        answers = [runs[0][i][0], runs[1][i][0], runs[0][i][1], runs[1][i][1]]
        got = [(c["finish_reason"], c["stop_reason"], c["text"]) for c in answers[0]["choices"]]
        assert got == want, body  # the stop string fired (or not) where the model's own text has it
        for other in answers[1:]:
            assert other == answers[0], body  # same text, reasons and usage; the deltas add up to the text


def test_a_stopped_sample_frees_its_blocks_in_the_core_while_its_sibling_runs(servers):
    """n=2: the server's stop string ends sample 0; the core stops running it at once (StopSample), sample 1 runs
    on. A hang-up then aborts the rest; nothing stays running and every block comes back."""
    threaded, process = servers
    ref = threaded.post({**SAMPLED, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True})["choices"]
    stop = ref[0]["text"][-12:].lstrip()
    assert stop and "\ufffd" not in stop
    sent = len(ref[0]["token_ids"])
    body = {**SAMPLED, "max_tokens": 1500, "ignore_eos": True, "stop": [stop], "stream": True,
            "return_token_ids": True}
    counts = {0: 0, 1: 0}
    with httpx.stream("POST", process.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    counts[c["index"]] += len(c["token_ids"])
            if counts[1] >= sent + 3:
                break
        during = process.metrics()  # asked after the StopSample was sent: the core has handled it
        assert counts[0] == sent, counts  # sample 0 got nothing past its stop string
    assert during["vllm:num_requests_running"] == 1 and during["vllm:kv_cache_usage_perc"] > 0, during
    process.wait_idle()  # the hang-up aborted sample 1 in the core


def test_stop_string_finishes_free_everything_at_once(servers):
    """n=1: the response ends only once the core has freed the request (the first scrape shows nothing held), not
    when the server alone has seen the stop string."""
    threaded, process = servers
    text = threaded.post({"prompt": PROMPTS[0], "temperature": 0})["choices"][0]["text"]
    stop = next(w for w in text.split()[2:] if len(w) >= 3 and "\ufffd" not in w)
    body = {"prompt": PROMPTS[0], "temperature": 0, "max_tokens": 1500, "ignore_eos": True, "stop": [stop]}
    answer = process.post(body)["choices"][0]
    assert (answer["finish_reason"], answer["stop_reason"]) == ("stop", stop)
    m = process.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0, m


@pytest.mark.parametrize("kind", [0, 1], ids=["threaded", "process"])
def test_a_hang_up_counts_under_finished_reason_abort(servers, kind):
    srv = servers[kind]
    key = "vllm:request_success_total:abort"
    before = srv.metrics().get(key, 0)
    body = {"prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
    srv.wait_idle()
    deadline = time.monotonic() + 30
    while srv.metrics().get(key, 0) != before + 1:
        assert time.monotonic() < deadline, srv.metrics()
        time.sleep(0.05)


class _Outbox:
    """The core's output socket, kept in a list."""

    def __init__(self):
        self.sent = []

    def send(self, data, *flags, **kw):
        self.sent.append(data)


@pytest.mark.usefixtures("shared_weights")
def test_the_core_sends_token_ids_only_and_stops_one_sample_when_told():
    """In-process, no sockets: the core gets no stop strings, has nothing to decode with (the ``EngineCore`` holds
    no tokenizer, detokenizer or output processor; its samples' text stays empty), and ``StopSample`` frees one
    sample's blocks at once; the last sample stopped ends the request."""
    from tinypaged import SamplingParams
    from tinypaged.config import EngineConfig
    from tinypaged.engine.core import EngineCore
    from tinypaged.entrypoints import engine_core as ec

    config = EngineConfig(model="tiny", dtype="float32", device="cpu", block_size=4, num_gpu_blocks_override=64)
    engine = EngineCore(config)  # as the core's main builds it: the server owns text
    import msgspec

    assert not {"tokenizer", "detokenizer", "output_processor", "detokenize"} & set(dir(engine))
    out = _Outbox()
    core = ec.EngineCoreProc(engine, None, out, os.getppid())
    params = ec.params_message(SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=40, stop=["the"]))
    assert "stop" not in ec.Params.__struct_fields__ and "text" not in ec.Token.__struct_fields__
    core.handle(ec.Add("r", "Hello", [1, 2, 3, 4, 5], params))
    for _ in range(6):
        core.step()
    running, usage = len(engine.scheduler.running), engine.kv.usage
    core.handle(ec.StopSample("r", 0))
    assert (running, len(engine.scheduler.running)) == (2, 1) and engine.kv.usage < usage
    core.handle(ec.StopSample("r", 1))
    assert not engine.has_unfinished_requests() and engine.kv.usage == 0
    msgs = [msgspec.msgpack.decode(m, type=ec.FromCore) for m in out.sent]
    tokens = [t for m in msgs if isinstance(m, ec.Outputs) for t in m.tokens]
    assert sorted({t.index for t in tokens}) == [0, 1] and all(t.finish_reason is None for t in tokens)
    (end,) = [f for m in msgs if isinstance(m, ec.Outputs) for f in m.finished]
    assert end.request_id == "r" and [c.index for c in end.choices] == [0, 1]
    assert not core.live


class _Socket:
    def __init__(self):
        self.sent = []

    def send(self, data, *flags, **kw):
        self.sent.append(data)


class _Tokenizer:
    PIECES = {1: "ab", 2: "c", 3: "de", 4: "f"}

    def decode(self, ids, skip_special_tokens=True):
        if 66 in ids:
            raise RuntimeError("a broken tokenizer")
        return "".join(self.PIECES[i] for i in ids)


def _client_with(params, n_requests=1):
    """A ``CoreClient`` that was never started: its input socket is a list, its tokenizer a table."""
    from tinypaged.entrypoints.core_client import CoreClient
    from tinypaged.entrypoints.engine_loop import Submission

    client = CoreClient({"model": "tiny"})
    client.channel.to_core, client.outputs._tokenizer = _Socket(), _Tokenizer()
    events = []
    for k in range(n_requests):
        rid = f"r{k}"
        client.requests.live[rid] = Submission(rid, events.append, 3, params.n)
        client.requests.texts[rid] = (params, {})
        client.requests.count += 1
    return client, events


def test_the_server_side_detokenizer_cuts_stops_the_sample_in_the_core_and_drops_its_surplus():
    """The server's half alone (no processes): the engine's Detokenizer rules on token ids from the core."""
    import msgspec

    from tinypaged import SamplingParams
    from tinypaged.entrypoints import engine_core as ec

    client, events = _client_with(SamplingParams(n=2, stop=["cd"], max_tokens=4))
    tok = ec.Token
    client._handle(ec.Outputs([tok("r0", 0, 1), tok("r0", 1, 1)], []))
    client._handle(ec.Outputs([tok("r0", 0, 2), tok("r0", 1, 4)], []))
    client._handle(ec.Outputs([tok("r0", 0, 3), tok("r0", 1, 4)], []))  # "abcde": "cd" spans two tokens
    client._handle(ec.Outputs([tok("r0", 0, 4), tok("r0", 1, 4, "length")], []))  # 0: made before StopSample
    client._handle(ec.Outputs([], [ec.Finished("r0", [ec.Choice(0, "abort", None), ec.Choice(1, "length", None)])]))
    sent = [msgspec.msgpack.decode(m, type=ec.ToCore) for m in client.channel.to_core.sent]
    assert sent == [ec.StopSample("r0", 0)]
    text = {i: "".join(e.text for e in events if e.index == i) for i in (0, 1)}
    assert text == {0: "ab", 1: "abfff"}  # cut before the stop string; held-back text all sent by the end
    assert sum(len(e.token_ids) for e in events if e.index == 0) == 3  # the surplus token was dropped
    ends = [(e.index, e.finish_reason, e.stop_reason) for e in events if e.finished]
    assert ends == [(0, "stop", "cd"), (1, "length", None)] and client.num_in_flight == 0 and not client.requests.texts


def test_a_decode_that_raises_fails_its_request_only():
    import msgspec

    from tinypaged import SamplingParams
    from tinypaged.entrypoints import engine_core as ec

    client, events = _client_with(SamplingParams(max_tokens=4), n_requests=2)
    client._handle(ec.Outputs([ec.Token("r0", 0, 66), ec.Token("r1", 0, 1)], []))
    assert [msgspec.msgpack.decode(m, type=ec.ToCore) for m in client.channel.to_core.sent] == [ec.Abort(["r0"])]
    assert [(e.request_id, e.finished, e.error is not None) for e in events] == [("r0", True, True),
                                                                                 ("r1", False, False)]
    assert events[1].text == "ab" and client.num_in_flight == 1
