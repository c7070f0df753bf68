"""Hostile input to ``python -m tinypaged serve`` and its HTTP API: one-line CLI errors naming the flag,
OpenAI's error shape for every refusal (naming the right field), nothing silently ignored, and an over-long
prompt refused by its size before the engine's thread spends time tokenizing it.

Each test reproduces a finding of a hostile-input run (issue 32) on the "tiny" model.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tinypaged import LLM
from tinypaged.entrypoints import server as server_module
from tinypaged.__main__ import main
from tinypaged.entrypoints.server import ServerThread, create_app

pytestmark = pytest.mark.usefixtures("shared_weights")

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def tiny():
    llm = LLM("tiny", dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=256,
              block_size=4, max_num_seqs=8, history_size=0)
    srv = ServerThread(create_app(llm, "tiny", max_queued=64))
    yield srv
    srv.close()


@pytest.fixture
def tokenized(tiny, monkeypatch):
    """Counts the requests the engine's thread was asked to tokenize and check (``make_request``)."""
    engine = tiny.app.state.server.engine
    calls = []
    real = engine.make_request

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "make_request", counting)
    return calls


def openai_error(r: httpx.Response, status: int) -> dict:
    """The body is OpenAI's error shape (no FastAPI ``detail``), with the expected status."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and body["error"]["message"]
    return body["error"]


def post(srv, body=None, path="/v1/completions", content=None):
    headers = {"content-type": "application/json"} if content is not None else None
    return httpx.post(srv.url + path, json=body, content=content, headers=headers, timeout=60)


# -- the command line ---------------------------------------------------------------------------------------
@pytest.fixture
def no_model_load(monkeypatch):
    """A refused flag must be refused before the model is loaded (and before any server starts)."""
    def loaded(args):
        raise AssertionError("the model was loaded: the flag was not checked first")

    monkeypatch.setattr(server_module, "build_llm", loaded)


@pytest.mark.parametrize("flags, words", [
    (["--kv-cache-manager", "nosuchmodule:X"], "argument --kv-cache-manager: no module named 'nosuchmodule'"),
    (["--scheduler-cls", "nosuchmodule.sub:X"], "argument --scheduler-cls: no module named 'nosuchmodule'"),
    (["--scheduling-policy", "static"], "argument --scheduling-policy: static is now --scheduler-cls static"),
    (["--attention-backend", "nosuchmodule:f"], "argument --attention-backend: no module named 'nosuchmodule'"),
    (["--attention-backend", "cuda"], "argument --attention-backend: 'cuda': give torch, sdpa, triton, or MODULE:NAME"),
    (["--kv-cache-manager", "json:NoSuchName"], "argument --kv-cache-manager: json has no 'NoSuchName'"),
    (["--kv-cache-manager", "missing_file.py:X"], "argument --kv-cache-manager: missing_file.py: no such file"),
    (["--port", "-1"], "argument --port: a port is a number in 1..65535, got -1"),
    (["--port", "99999"], "argument --port: a port is a number in 1..65535, got 99999"),
    (["--port", "http"], "argument --port: 'http' is not a port number"),
    (["--max-queued-requests", "-5"], "argument --max-queued-requests: must be an integer >= 0, got -5"),
])
def test_bad_serve_flags_are_one_line_errors_naming_the_flag(no_model_load, capsys, flags, words):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "tiny", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("code, words", [
    ("X = 1\nraise RuntimeError('my bug')\n", "RuntimeError: my bug (at {plugin}:2)"),
    ("X = 1\nraise ValueError('my bug')\n", "ValueError: my bug (at {plugin}:2)"),
    ("X = 1\nimport nosuchdependency\n", "ModuleNotFoundError: No module named 'nosuchdependency'"),
    ("X = (1,\n", "SyntaxError: '(' was never closed"),
])
def test_a_plugin_file_that_fails_to_import_names_the_flag_and_the_problem(no_model_load, capsys, tmp_path, code,
                                                                           words):
    plugin = tmp_path / "my_manager.py"
    plugin.write_text(code)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "tiny", "--kv-cache-manager", f"{plugin}:X"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert f"argument --kv-cache-manager: importing {plugin} failed: " + words.format(plugin=plugin) in err, err


def test_a_port_in_use_is_exit_2_naming_the_port_before_the_model_loads(no_model_load, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "tiny", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--port {port}: 127.0.0.1:{port} is already in use" in err, err


def test_a_negative_queue_bound_is_refused_by_the_app_too():
    llm = LLM("tiny", dtype="float32", device="cpu", num_gpu_blocks_override=16, block_size=4)
    with pytest.raises(ValueError, match=r"max_queued \(--max-queued-requests\) must be an integer >= 0, got -5"):
        create_app(llm, "tiny", max_queued=-5)


@pytest.mark.skipif(sys.platform == "win32", reason="stops the server with SIGINT (Ctrl-C)")
def test_serve_binds_first_serves_and_stops_on_ctrl_c(tmp_path):
    """The whole command in a process: a bad plug-in is one line, no traceback; a good run serves on the
    socket it bound before loading the model, and Ctrl-C stops it with status 0."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tinypaged", "serve", "--model", "tiny", "--num-gpu-blocks-override", "64"]
    bad = subprocess.run(cmd + ["--kv-cache-manager", "nosuchmodule:X"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # the engine in-process (a thread): tests/test_process_server.py runs the default, an engine-core process
    proc = subprocess.Popen(cmd + ["--port", str(port), "--no-multiprocessing"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the server never answered"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [1, 2], "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert f"serving model 'tiny' at http://127.0.0.1:{port} (engine core in this process (a thread))" in err, err
    assert '"POST /v1/completions" 200' in err, err  # the access log: one line per request


# -- bodies that are not JSON objects, routes that do not exist --------------------------------------------
@pytest.mark.parametrize("content, words", [
    (b'{"prompt": "caf\xe9", "max_tokens": 2}', "not valid UTF-8 (byte 15)"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"prompt": [1, 2], "max_tokens": 2,}', "not valid JSON: Expecting property name enclosed in double quotes"),
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object, got a JSON list"),
    (b"", "not valid JSON"),
])
def test_bodies_that_are_not_json_objects_get_openais_error_shape(tiny, content, words):
    for path in ("/v1/completions", "/v1/chat/completions"):
        err = openai_error(post(tiny, path=path, content=content), 400)
        assert words in err["message"] and err["param"] is None and err["type"] == "invalid_request_error"


def test_unknown_routes_and_methods_get_openais_error_shape(tiny):
    err = openai_error(httpx.get(tiny.url + "/v1/nothing"), 404)
    assert "GET /v1/nothing: no such route" in err["message"] and err["type"] == "not_found_error"
    r = httpx.get(tiny.url + "/v1/completions")
    err = openai_error(r, 405)
    assert "GET /v1/completions: method not allowed" in err["message"] and r.headers["allow"] == "POST"


# -- the field an error names -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [1, 2], "n": 300}, "n"),  # more forked samples than max_num_seqs
    ("/v1/completions", {"prompt": [1, 2], "stop_token_ids": [10**6]}, "stop_token_ids"),  # outside the vocabulary
    ("/v1/completions", {"prompt": [1, 2], "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
])
def test_errors_name_the_field_at_fault(tiny, path, body, param):
    err = openai_error(post(tiny, body, path), 400)
    assert err["param"] == param and (param in err["message"] or param == "prompt"), err


def test_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(tiny):
    """As vLLM's server: not a silent cap at the context (a greedy request would run to max_model_len)."""
    err = openai_error(post(tiny, {"prompt": [1, 2], "max_tokens": MAX_MODEL_LEN}), 400)
    assert err["param"] == "max_tokens", err
    assert (f"max_tokens is too large: {MAX_MODEL_LEN}. This model's maximum context length is {MAX_MODEL_LEN} "
            f"tokens and your request has 2 input tokens") in err["message"], err
    fits = post(tiny, {"prompt": [1, 2], "max_tokens": MAX_MODEL_LEN - 2, "temperature": 0})  # exactly the rest
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] <= MAX_MODEL_LEN - 2


@pytest.mark.parametrize("field", ["max_tokens", "temperature", "n", "top_p", "top_k", "seed", "min_tokens"])
def test_booleans_are_not_numbers(tiny, tokenized, field):
    err = openai_error(post(tiny, {"prompt": [1, 2], field: True}), 400)
    assert err["param"] == field and "expected a number, got true" in err["message"]
    err = openai_error(post(tiny, {"messages": [{"role": "user", "content": "hi"}], field: False},
                            "/v1/chat/completions"), 400)
    assert err["param"] == field
    assert tokenized == []


def test_booleans_are_not_token_ids(tiny):
    assert openai_error(post(tiny, {"prompt": [True, 2]}), 400)["param"] == "prompt"
    assert openai_error(post(tiny, {"prompt": [1], "stop_token_ids": [True]}), 400)["param"].startswith(
        "stop_token_ids")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": True}
    assert openai_error(post(tiny, chat, "/v1/chat/completions"), 400)["param"] == "max_completion_tokens"


# -- what is not implemented is refused by name ---------------------------------------------------------------------
@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "logprobs", 1),
    ("/v1/completions", "logprobs", 0),  # OpenAI: the sampled token's logprob
    ("/v1/completions", "echo", True),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", "end"),
    ("/v1/completions", "presence_penalty", 0.5),
    ("/v1/completions", "frequency_penalty", -1),
    ("/v1/completions", "repetition_penalty", 1.2),
    ("/v1/completions", "logit_bias", {"5": 10}),
    ("/v1/completions", "prompt_logprobs", 1),
    ("/v1/chat/completions", "logprobs", True),
    ("/v1/chat/completions", "top_logprobs", 3),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
])
def test_unimplemented_fields_are_refused_by_name(tiny, tokenized, path, field, value):
    body = {"prompt": [1, 2]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    err = openai_error(post(tiny, {**body, field: value}, path), 400)
    assert err["param"] == field and f"{field}=" in err["message"] and "not supported" in err["message"]
    assert tokenized == []


def test_fields_that_ask_for_nothing_are_accepted(tiny):
    body = {"prompt": [1, 2], "max_tokens": 2, "logprobs": None, "echo": False, "best_of": 1, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logit_bias": {}, "suffix": None, "user": "someone"}
    r = post(tiny, body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": False,
            "response_format": {"type": "text"}, "tools": []}
    assert post(tiny, chat, "/v1/chat/completions").status_code == 200


# -- size: refused before the engine's thread tokenizes anything --------------------------------------------------
def test_a_huge_prompt_is_refused_by_size_before_tokenizing(tiny, tokenized):
    srv = tiny.app.state.server
    assert srv.max_prompt_chars is not None and srv.max_prompt_chars < 5_000_000
    err = openai_error(post(tiny, {"prompt": "x" * 5_000_000, "max_tokens": 2}), 400)
    assert err["param"] == "prompt" and f"max_model_len ({MAX_MODEL_LEN})" in err["message"]
    err = openai_error(post(tiny, {"prompt": ["ok", "y " * srv.max_prompt_chars]}), 400)
    assert err["param"] == "prompt" and err["message"].startswith("prompt[1] is")
    err = openai_error(post(tiny, {"prompt": [5] * (MAX_MODEL_LEN + 1)}), 400)
    assert err["param"] == "prompt" and f"{MAX_MODEL_LEN + 1} token ids" in err["message"]
    err = openai_error(post(tiny, {"messages": [{"role": "user", "content": "z" * (srv.max_prompt_chars + 1)}]},
                            "/v1/chat/completions"), 400)
    assert err["param"] == "messages"
    assert tokenized == []  # none of them reached the engine's thread
    assert post(tiny, {"prompt": "short", "max_tokens": 2}).status_code == 200
    assert len(tokenized) == 1  # (the counter does count what does reach it)


def test_a_prompt_just_under_the_bound_still_gets_the_engines_own_answer(tiny, tokenized):
    """The size bound only refuses what can never fit: under it the engine decides (here: too long)."""
    srv = tiny.app.state.server
    err = openai_error(post(tiny, {"prompt": "hello " * (MAX_MODEL_LEN + 10)}), 400)
    assert err["param"] == "prompt" and "longer than max_model_len" in err["message"]
    assert len("hello " * (MAX_MODEL_LEN + 10)) < srv.max_prompt_chars and len(tokenized) == 1


def test_a_body_over_the_size_bound_is_413_before_it_is_read_whole(tiny, tokenized, monkeypatch):
    srv = tiny.app.state.server
    assert srv.max_body_bytes > 12 * srv.max_prompt_chars  # at least one prompt of the longest allowed text
    monkeypatch.setattr(srv, "max_body_bytes", 1000)
    body = json.dumps({"prompt": "x" * 2000}).encode()
    err = openai_error(post(tiny, content=body), 413)
    assert "over 1000 bytes" in err["message"]

    def chunks():  # no content-length: the bound applies while reading
        for _ in range(10):
            yield body[:500]

    r = httpx.post(tiny.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert "over 1000 bytes" in openai_error(r, 413)["message"]
    assert tokenized == []
