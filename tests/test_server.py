"""The OpenAI-compatible server: API shapes, streaming, disconnect abort, the 400/503 paths, metrics.

A real uvicorn server on 127.0.0.1 (a free port) in a background thread, driven by httpx and by the
official ``openai`` client. The ``tiny`` model (no tokenizer) is checked through token ids
(``return_token_ids``, vLLM's extension); SmolLM2 for text, chat and the openai client.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.entrypoints.server import ServerThread, create_app

TINY_PROMPTS = [[1, 2, 3], [5, 9, 11, 13], [7], [2, 4, 6, 8, 10, 12]]


def RunningServer(llm, name, max_queued=256):
    return ServerThread(create_app(llm, name, max_queued))


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def tiny():
    srv = RunningServer(LLM("tiny", dtype="float32", device="cpu", num_gpu_blocks_override=64, block_size=4,
                            max_num_seqs=8, history_size=0), "tiny", max_queued=64)
    yield srv
    srv.close()


def greedy_ids(prompts, max_tokens):
    llm = LLM("tiny", dtype="float32", device="cpu", num_gpu_blocks_override=64, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outs]


def test_models_and_health(tiny):
    assert httpx.get(tiny.url + "/health").status_code == 200
    body = httpx.get(tiny.url + "/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["tiny"]


def test_completion_matches_the_engine(tiny):
    ref = greedy_ids(TINY_PROMPTS, 6)
    r = httpx.post(tiny.url + "/v1/completions", json={"model": "tiny", "prompt": TINY_PROMPTS, "max_tokens": 6,
                                                       "temperature": 0, "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in body["choices"]] == ref
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": sum(map(len, TINY_PROMPTS)), "completion_tokens": 24,
                             "total_tokens": sum(map(len, TINY_PROMPTS)) + 24}


def _sse(lines):
    chunks = []
    for line in lines:
        if line.startswith("data: "):
            chunks.append(line[6:])
    return chunks


def test_stream_chunks_done_and_usage(tiny):
    ref = greedy_ids([TINY_PROMPTS[1]], 5)[0]
    with httpx.stream("POST", tiny.url + "/v1/completions", timeout=60,
                      json={"prompt": TINY_PROMPTS[1], "max_tokens": 5, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}, "return_token_ids": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(r.iter_lines())
    assert chunks[-1] == "[DONE]"
    bodies = [json.loads(c) for c in chunks[:-1]]
    ids = [t for b in bodies for c in b["choices"] for t in c.get("token_ids", [])]
    assert ids == ref
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 5
    assert [c["finish_reason"] for b in bodies for c in b["choices"] if c["finish_reason"]] == ["length"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2], "temperature": -1}, "temperature"),
    ({"prompt": [1, 2], "top_p": 0}, "top_p"),
    ({"prompt": [1, 2], "n": "two"}, "n"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),  # outside the vocabulary
    ({"prompt": [1, 2], "max_tokens": 5000}, "prompt"),  # can never fit in 64 blocks of 4 tokens
])
def test_bad_requests_are_400_naming_the_field(tiny, body, param):
    r = httpx.post(tiny.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_bad_json_and_unknown_model(tiny):
    r = httpx.post(tiny.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(tiny.url + "/v1/completions", json={"model": "gpt-9", "prompt": [1]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_chat_shape_and_bad_messages(tiny):
    r = httpx.post(tiny.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    for bad in ({"messages": []}, {"messages": [{"role": "wizard", "content": "hi"}]}, {"messages": "hi"}):
        r = httpx.post(tiny.url + "/v1/chat/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages"), r.text


def _wait_idle(srv, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(srv.url + "/metrics").text
        if metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:kv_cache_usage_perc") == 0:
            return text
        time.sleep(0.05)
    raise AssertionError("the server never went idle:\n" + text)


def test_disconnect_aborts_and_frees_blocks(tiny):
    with httpx.stream("POST", tiny.url + "/v1/completions", timeout=60,
                      json={"prompt": TINY_PROMPTS[3], "max_tokens": 200, "temperature": 0, "stream": True,
                            "ignore_eos": True, "return_token_ids": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
    _wait_idle(tiny)
    assert tiny.loop.num_in_flight == 0


def test_queue_bound_gives_503():
    """max_num_seqs 1 and max_queued 0: while one request is in flight a second gets a 503, and once the first
    has ended the same request is served. The engine's steps are held until the test lets them go, so the first
    request is surely in flight however slow the machine is (its admission is counted before it is queued)."""
    llm = LLM("tiny", dtype="float32", device="cpu", num_gpu_blocks_override=64, block_size=4, max_num_seqs=1)
    gate, step = threading.Event(), llm.llm_engine.step

    def held_step(*a, **k):
        if not gate.wait(300):
            raise RuntimeError("the test never released the engine")
        return step(*a, **k)

    llm.llm_engine.step = held_step
    srv = RunningServer(llm, "tiny", max_queued=0)
    first: dict = {}
    worker = threading.Thread(target=lambda: first.setdefault("r", httpx.post(
        srv.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, "ignore_eos": True}, timeout=300)))
    try:
        worker.start()
        deadline = time.monotonic() + 120
        while srv.loop.num_in_flight < 1:
            assert time.monotonic() < deadline, "the first request was never admitted"
            time.sleep(0.01)
        busy = httpx.post(srv.url + "/v1/completions", json={"prompt": [3], "max_tokens": 2}, timeout=60)
        assert busy.status_code == 503 and busy.json()["error"]["type"] == "server_overloaded"
        assert "max_queued (0)" in busy.json()["error"]["message"]
        gate.set()
        worker.join(120)
        assert first["r"].status_code == 200 and first["r"].json()["usage"]["completion_tokens"] == 4
        _wait_idle(srv)
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": [3], "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
    finally:
        gate.set()
        srv.close()


def test_many_streams_some_disconnect(tiny):
    """48 concurrent streams, every third client leaves after its first chunk: the others complete with
    their greedy tokens, malformed requests in between get 400s, and nothing stays allocated."""
    import asyncio

    prompts = [[(7 * i + k) % 200 + 1 for k in range(1 + i % 5)] for i in range(48)]
    ref = greedy_ids(prompts, 8)

    async def one(client, i):
        if i % 8 == 5:
            r = await client.post("/v1/completions", json={"prompt": prompts[i], "temperature": "hot"})
            return ("bad", r.status_code)
        body = {"prompt": prompts[i], "max_tokens": 8, "temperature": 0, "stream": True, "return_token_ids": True}
        ids = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ids += [t for c in json.loads(line[6:])["choices"] for t in c.get("token_ids", [])]
                if i % 3 == 0:
                    return ("left", None)
        return ("done", ids)

    async def main():
        async with httpx.AsyncClient(base_url=tiny.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(48)))

    results = asyncio.run(main())
    for i, (kind, value) in enumerate(results):
        if kind == "bad":
            assert value == 400
        elif kind == "done":
            assert value == ref[i], f"stream {i}"
    assert sum(k == "done" for k, _ in results) >= 20
    text = _wait_idle(tiny)
    assert metric(text, "vllm:num_requests_waiting") == 0
    assert httpx.get(tiny.url + "/health").status_code == 200


def test_metrics_names(tiny):
    httpx.post(tiny.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, timeout=60)
    text = httpx.get(tiny.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total"):
        assert name in text, name
    assert metric(text, "vllm:generation_tokens_total") >= 3


@pytest.fixture(scope="module")
def smol():
    srv = RunningServer(LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=512,
                            kv_cache_memory_bytes=64 * 2**20, enable_prefix_caching=True), "smollm2-135m")
    yield srv
    srv.close()


def test_openai_client_text_chat_and_stream(smol):
    import openai

    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="unused")
    prompt = "The capital of France is"
    comp = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=8, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == comp.choices[0].text
    chat = client.chat.completions.create(model="smollm2-135m", max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "What is 2 + 2?"}])
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    pieces = client.chat.completions.create(model="smollm2-135m", max_tokens=8, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "What is 2 + 2?"}])
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == chat.choices[0].message.content


def test_text_equals_offline_generate(smol):
    """The server's greedy text is the offline LLM.generate text for the same prompt."""
    prompt = "Once upon a time"
    offline = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=512,
                  kv_cache_memory_bytes=64 * 2**20).generate(prompt, SamplingParams(temperature=0, max_tokens=12))
    r = httpx.post(smol.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}, timeout=60)
    assert r.json()["choices"][0]["text"] == offline[0].outputs[0].text
