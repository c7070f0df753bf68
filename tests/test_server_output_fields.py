"""The server passes vLLM's ``include_stop_str_in_output`` and ``skip_special_tokens`` into SamplingParams: the
answer's text is the offline ``LLM.generate`` text with the same fields, streamed or not; a non-boolean is a 400
naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.entrypoints.server import ServerThread, create_app

KNOBS = dict(dtype="float32", device="cpu", num_gpu_blocks_override=64, block_size=4, max_num_seqs=8)
PROMPT = [1, 2, 3, 5, 9]


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny", **KNOBS)


@pytest.fixture(scope="module")
def served():
    srv = ServerThread(create_app(LLM("tiny", history_size=0, **KNOBS), "tiny", 64))
    yield srv
    srv.close()


def post(served, body, stream=False):
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 12, "ignore_eos": True, **body}
    if not stream:
        r = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
        return r.status_code, r.json()
    text, reason = "", None
    with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice.get("finish_reason") or reason
    return text, reason


def reference(offline, **kw):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)
    return offline.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(offline, served, stream):
    full = reference(offline).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3
    ref = reference(offline, stop=[stop], include_stop_str_in_output=True)
    assert ref.text.endswith(stop) and ref.finish_reason == "stop"
    got = post(served, {"stop": [stop], "include_stop_str_in_output": True}, stream)
    if stream:
        assert got == (ref.text, "stop")
    else:
        status, body = got
        assert status == 200, body
        assert body["choices"][0]["text"] == ref.text and body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false(offline, served, stream):
    special = sorted(set(offline.get_tokenizer().all_special_ids))[0]
    ref = reference(offline, allowed_token_ids=[special], skip_special_tokens=False)
    assert ref.text and ref.text != reference(offline, allowed_token_ids=[special]).text
    got = post(served, {"allowed_token_ids": [special], "skip_special_tokens": False}, stream)
    text = got[0] if stream else got[1]["choices"][0]["text"]
    assert text == ref.text


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "skip_special_tokens"])
def test_a_non_boolean_is_a_400_naming_the_field(served, field):
    status, body = post(served, {field: "yes"})
    assert status == 400 and field in json.dumps(body), body


def test_the_process_core_applies_both_fields(offline, tmp_path):
    """``serve`` with the engine core in its own process: ``core_client.py`` detokenizes with the same fields."""
    from test_process_detok import Serve

    full = reference(offline).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    special = sorted(set(offline.get_tokenizer().all_special_ids))[0]
    srv = Serve(tmp_path)
    try:
        srv.ready()
        base = {"prompt": PROMPT, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
        for extra, kw in [({"stop": [stop], "include_stop_str_in_output": True},
                           dict(stop=[stop], include_stop_str_in_output=True)),
                          ({"allowed_token_ids": [special], "skip_special_tokens": False},
                           dict(allowed_token_ids=[special], skip_special_tokens=False))]:
            ref = reference(offline, **kw)
            assert srv.post({**base, **extra})["choices"][0]["text"] == ref.text
            assert srv.stream({**base, **extra})["choices"][0]["text"] == ref.text
    finally:
        srv.close()
