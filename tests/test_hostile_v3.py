"""Hostile inputs and faults, third round (issue 48): no request pattern disables the server, every refusal is a
clear error naming its field, nothing asked for is silently ignored, slow clients are cut off.

One ``python -m tinypaged serve`` process (the engine core in its own process, the default) on the ``tiny`` model is
shared by the module; a small in-process server (``ServerThread``) serves the checks that need a short deadline or a
look inside. Each test failed on the code before issue 48's fixes.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from served import metrics, wait_for_health

from tinypaged import LLM
from tinypaged.entrypoints import server as server_module
from tinypaged.entrypoints.server import ServerThread, create_app

pytestmark = [pytest.mark.skipif(sys.platform == "win32", reason="signals and ipc sockets"),
              pytest.mark.usefixtures("shared_weights")]

MAX_NUM_SEQS, MAX_QUEUED = 4, 4
BOUND = MAX_NUM_SEQS + MAX_QUEUED
KNOBS = ["--model", "tiny", "--dtype", "float32", "--device", "cpu", "--block-size", "16",
         "--num-gpu-blocks-override", "1100", "--max-num-seqs", str(MAX_NUM_SEQS),
         "--max-queued-requests", str(MAX_QUEUED), "--max-model-len", "2048", "--no-access-log"]


class Served:
    """``python -m tinypaged serve`` on a free port of 127.0.0.1; stderr to a file."""

    def __init__(self, tmp):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "serve.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        env.pop("TINYPAGED_ENABLE_MULTIPROCESSING", None)
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tinypaged", "serve", *KNOBS, "--port", str(self.port)],
                                         stdout=subprocess.DEVNULL, stderr=err, env=env)
        wait_for_health(self.proc, self.url, self.log)

    def metrics(self) -> dict:
        return metrics(self.url)

    def idle(self) -> bool:
        m = self.metrics()
        return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0

    def close(self) -> None:
        from tinypaged.entrypoints.core_client import remove_stale_socket_dirs

        if self.proc.poll() is None:
            self.proc.kill()  # its engine core follows (PR_SET_PDEATHSIG)
            self.proc.wait(30)
            remove_stale_socket_dirs()  # what a killed server leaves (the next server's start removes it too)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv = Served(tmp_path_factory.mktemp("hostile_v3"))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def local():
    """The in-process server (the engine on a thread), with a 1 s deadline for a request's head."""
    llm = LLM("tiny", dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=128, block_size=4,
              max_num_seqs=4, history_size=0)
    srv = ServerThread(create_app(llm, "tiny", max_queued=4), header_timeout=1.0)
    yield srv
    srv.close()


def post(srv, body, path="/v1/completions", timeout=60):
    return httpx.post(srv.url + path, json=body, timeout=timeout)


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


# -- 1. lost work --------------------------------------------------------------------------------------------------
HUGE = [("max_tokens", {"max_tokens": 10**30}), ("top_k", {"top_k": 10**30}), ("n", {"n": 2**70}),
        ("min_tokens", {"min_tokens": 10**30}), ("stop_token_ids", {"stop_token_ids": [2**70]}),
        ("prompt", {"prompt": [1, 2**70]})]


def test_integers_beyond_64_bits_are_400s_naming_the_field_and_leak_no_slot(served):
    """Three times the queue bound of them (each once took a slot for good), then a normal request is served."""
    for i in range(3 * BOUND):
        field, extra = HUGE[i % len(HUGE)]
        err = error(post(served, {"prompt": [1, 2], "max_tokens": 2, **extra}), 400)
        assert err["param"] == field, err
    r = post(served, {"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert served.idle()


def test_prompts_per_call_are_capped_at_the_queue_bound(served):
    err = error(post(served, {"prompt": [[1, 2]] * (BOUND + 1), "max_tokens": 2}), 400)
    assert err["param"] == "prompt" and f"more than this server takes in one call" in err["message"], err
    assert f"({BOUND}," in err["message"], err
    ok = post(served, {"prompt": [[1, 2]] * BOUND, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == BOUND


def test_a_client_leaving_a_busy_multi_prompt_call_stops_its_work(served):
    """Events arriving all the time once hid the disconnect: the call kept generating after its client left."""
    body = {"prompt": [[1, 2, 3]] * BOUND, "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        post(served, body, timeout=1.5)
    left = time.monotonic()
    while not served.idle():
        assert time.monotonic() - left < 3.0, "the call ran on after its client left"
        time.sleep(0.1)


def test_a_chat_of_more_messages_than_max_model_len_is_refused_before_templating(served):
    msgs = [{"role": "user", "content": "x"}] * 2100
    err = error(post(served, {"messages": msgs, "max_tokens": 2}, "/v1/chat/completions"), 400)
    assert err["param"] == "messages" and "messages holds 2100 messages" in err["message"], err


def test_chat_templating_runs_off_the_event_loop(local, monkeypatch):
    srv = local.app.state.server
    where = []
    real = srv.chat_prompt

    def noting(req):
        where.append(threading.current_thread().name)
        return real(req)

    monkeypatch.setattr(srv, "chat_prompt", noting)
    assert post(local, CHAT, "/v1/chat/completions").status_code == 200
    assert where and where[0] != local.thread.name, where  # not uvicorn's (the event loop's) thread


def test_stale_socket_folders_of_killed_servers_are_removed(tmp_path):
    from tinypaged.entrypoints.core_client import SOCKET_DIR_PREFIX, remove_stale_socket_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"{SOCKET_DIR_PREFIX}{dead.pid}-abc123"
    live = tmp_path / f"{SOCKET_DIR_PREFIX}{os.getppid()}-def456"
    other = tmp_path / f"{SOCKET_DIR_PREFIX}notapid"
    for d in (gone, live, other):
        d.mkdir()
        (d / "in").write_text("")
    assert remove_stale_socket_dirs(str(tmp_path)) == [str(gone)]
    assert not gone.exists() and live.exists() and other.exists()


# -- 2. raw errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_p", [1e-46, 5e-324])
def test_a_top_p_that_float32_rounds_to_zero_is_a_400(served, top_p):
    err = error(post(served, {"prompt": [1, 2], "max_tokens": 2, "top_p": top_p, "seed": 1}), 400)
    assert err["param"] == "top_p" and "1.4e-45" in err["message"], err


def test_the_smallest_float32_top_p_samples(served):
    r = post(served, {"prompt": [1, 2], "max_tokens": 3, "top_p": 2.0**-149, "seed": 1, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


@pytest.mark.parametrize("field", ["hwm", "buffer_steps", "max_queue_size"])
def test_a_kv_events_count_beyond_a_c_int_is_exit_2_naming_the_field(monkeypatch, capsys, field):
    from tinypaged.__main__ import main

    def loaded(args):
        raise AssertionError("the model was loaded: the flag was not checked first")

    from tinypaged.entrypoints import core_client

    monkeypatch.setattr(server_module, "build_llm", loaded)
    monkeypatch.setattr(core_client.CoreClient, "start", loaded)
    config = json.dumps({"enable_kv_cache_events": True, field: 10**20})
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "tiny", "--enable-prefix-caching", "--kv-events-config", config])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and f"{field} must be an integer in 1.." in err, err


def test_a_cache_path_naming_a_file_is_one_clear_error(tmp_path, monkeypatch):
    from tinypaged.model import loader

    afile = tmp_path / "cache"
    afile.write_text("not a folder")
    monkeypatch.setenv("TINYPAGED_CACHE", str(afile))
    with pytest.raises(ValueError, match=r"TINYPAGED_CACHE=.*cache is a file, not a folder"):
        loader.load_tokenizer("tiny")
    assert loader.tiny_folder(0) is None  # "tiny" itself falls back to memory


@pytest.mark.parametrize("kind", ["safetensors", "oserror"])
def test_a_full_disk_while_saving_tiny_falls_back_to_memory_leaving_nothing(tmp_path, monkeypatch, kind):
    from safetensors import SafetensorError

    from tinypaged.model import loader

    def full(staging, seed):
        (staging / "model.safetensors").write_bytes(b"")  # what a full disk leaves: an empty file
        if kind == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setenv("TINYPAGED_CACHE", str(tmp_path / "cache"))
    # the loader's own save step, not safetensors.torch.save_file: a module imported meanwhile (transformers'
    # modeling_utils binds save_file at import) would keep the stand-in after the test
    monkeypatch.setattr(loader, "_save_tiny", full)
    assert loader.tiny_folder(0) is None
    assert list((tmp_path / "cache").iterdir()) == []  # no partial entry, no lock file


# -- 3. silently ignored fields ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "guided_regex", "a+"),
    ("/v1/completions", "guided_choice", ["a", "b"]),
    ("/v1/completions", "structured_outputs", {"json": {"type": "object"}}),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "length_penalty", 0.5),
    ("/v1/completions", "spaces_between_special_tokens", False),
    ("/v1/completions", "logits_processors", ["my.module:Proc"]),
    ("/v1/completions", "prompt_embeds", "AAAA"),
    ("/v1/completions", "kv_transfer_params", {"do_remote_decode": True}),
    ("/v1/completions", "truncate_prompt_tokens", 1),
    ("/v1/completions", "priority", 5),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
    ("/v1/chat/completions", "documents", [{"text": "a doc"}]),
    ("/v1/chat/completions", "guided_json", {"type": "object"}),
])
def test_vllm_extensions_not_implemented_are_refused_by_name(served, path, field, value):
    body = {"prompt": [1, 2], "max_tokens": 2} if path == "/v1/completions" else CHAT
    err = error(post(served, {**body, field: value}, path), 400)
    assert err["param"] == field and f"{field}=" in err["message"] and "not supported" in err["message"], err


@pytest.mark.parametrize("min_p", [5, -0.1, True])
def test_an_invalid_min_p_is_a_400(served, min_p):
    err = error(post(served, {"prompt": [1, 2], "max_tokens": 2, "min_p": min_p}), 400)
    assert err["param"] == "min_p", err


def test_min_p_one_keeps_only_the_likeliest_token_as_vllm(served):
    """vLLM's min_p: tokens below min_p x the top probability are dropped; at 1 only the likeliest is left."""
    body = {"prompt": [[5, 6, 7], [11, 402, 9]], "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    greedy = post(served, {**body, "temperature": 0}).json()["choices"]
    hot = post(served, {**body, "temperature": 1.5, "min_p": 1.0, "seed": 3}).json()["choices"]
    assert [c["token_ids"] for c in hot] == [c["token_ids"] for c in greedy]


def test_allowed_token_ids_restrict_every_pick_as_vllm(served):
    allowed = [7, 11, 300]
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        body = {"prompt": [1, 2, 3], "max_tokens": 6, "ignore_eos": True, "return_token_ids": True,
                "allowed_token_ids": allowed, **extra}
        r = post(served, body)
        assert r.status_code == 200, r.text
        assert set(r.json()["choices"][0]["token_ids"]) <= set(allowed), r.json()
    for bad in ([], [49152], [-1]):
        err = error(post(served, {"prompt": [1, 2], "max_tokens": 2, "allowed_token_ids": bad}), 400)
        assert err["param"] == "allowed_token_ids", err


def test_bad_words_are_never_generated_as_vllm(served):
    """A word of the greedy output that is one token with and one without its space (vLLM then bans both forms):
    banned, neither comes again."""
    from tinypaged.model.loader import load_tokenizer

    tok = load_tokenizer("tiny")
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    ids = post(served, body).json()["choices"][0]["token_ids"]

    def forms(t):
        word = tok.decode([t]).strip()
        plain, spaced = (tok.encode(w, add_special_tokens=False) for w in (word, " " + word))
        return word, plain, spaced

    word, plain, spaced = next(forms(t) for t in ids if forms(t)[0].isalpha() and len(forms(t)[1]) == 1
                               and len(forms(t)[2]) == 1 and t in forms(t)[1] + forms(t)[2])
    r = post(served, {**body, "bad_words": [word]})
    assert r.status_code == 200, r.text
    assert not {plain[0], spaced[0]} & set(r.json()["choices"][0]["token_ids"]), (word, r.json())
    err = error(post(served, {"prompt": [1, 2], "max_tokens": 2, "bad_words": ["  "]}), 400)
    assert err["param"] == "bad_words", err


def test_a_multi_token_bad_word_bans_its_last_token_only_after_its_prefix():
    import torch
    from types import SimpleNamespace as NS

    from tinypaged.sampling.sampler import ban_bad_words

    params = NS(bad_words_token_ids=[[5, 6, 7], [9]])
    seqs = [NS(params=params, output_token_ids=[1, 5, 6]), NS(params=params, output_token_ids=[5, 1])]
    out = ban_bad_words(torch.zeros(2, 10), seqs)
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [7, 9]  # after 5, 6: 7 is banned; 9 always
    assert torch.isinf(out[1]).nonzero().flatten().tolist() == [9]


def sse_bodies(r: httpx.Response) -> list:
    assert r.status_code == 200, r.text
    lines = [ln[len("data: "):] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_the_running_counts_on_every_chunk(served, path):
    """vLLM's ``continuous_usage_stats``: each chunk's usage counts the tokens streamed so far (here, the
    ``token_ids`` of the chunks up to and including it), and the last chunk (no choices) has the totals."""
    base = CHAT if "chat" in path else {"prompt": [[1, 2, 3], [4, 5]]}
    body = {**base, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_bodies(post(served, body, path))
    *running, last = chunks
    assert last["choices"] == [] and running, chunks
    seen = 0
    for ch in running:
        seen += sum(len(c.get("token_ids") or []) for c in ch["choices"])
        u = ch["usage"]
        assert u is not None and u["completion_tokens"] == seen, (ch, seen)
        assert u["total_tokens"] == u["prompt_tokens"] + seen and u["prompt_tokens"] == last["usage"]["prompt_tokens"]
    assert last["usage"]["completion_tokens"] == seen == 5 * (2 if "chat" in path else 4), last
    # without it, only the last chunk carries usage (as before)
    plain = sse_bodies(post(served, {**body, "stream_options": {"include_usage": True}}, path))
    assert all(ch["usage"] is None for ch in plain[:-1]) and plain[-1]["usage"] == last["usage"]


@pytest.mark.parametrize("opts", [{"include_usage": True, "continuous_usage_stats": "yes"},
                                  {"include_usage": True, "continuous_usage_stats": 1},
                                  {"continuous_usage_stats": True}])
def test_a_bad_continuous_usage_stats_is_a_400_naming_it(served, opts):
    body = {"prompt": [1, 2], "max_tokens": 2, "stream": True, "stream_options": opts}
    err = error(post(served, body), 400)
    assert err["param"] == "stream_options.continuous_usage_stats", err


def test_their_defaults_ask_for_nothing_and_are_accepted(served):
    body = {"prompt": [1, 2], "max_tokens": 2, "use_beam_search": False, "length_penalty": 1.0,
            "spaces_between_special_tokens": True, "skip_special_tokens": True, "include_stop_str_in_output": False,
            "priority": 0, "bad_words": [], "allowed_token_ids": None, "logits_processors": None,
            "stream_options": None}
    assert post(served, body).status_code == 200
    chat = {**CHAT, "add_generation_prompt": True, "continue_final_message": False, "documents": None,
            "chat_template": None, "chat_template_kwargs": {}}
    assert post(served, chat, "/v1/chat/completions").status_code == 200


def chat_tokens(msgs, **kw) -> int:
    from tinypaged.model.loader import load_tokenizer

    tok = load_tokenizer("tiny")
    return len(tok.encode(tok.apply_chat_template(msgs, tokenize=False, **kw), add_special_tokens=False))


def test_add_generation_prompt_and_continue_final_message_reach_the_template(served):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    for kw in ({"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True},
               {"add_generation_prompt": True}):
        r = post(served, {"messages": msgs, "max_tokens": 1, **kw}, "/v1/chat/completions")
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == chat_tokens(msgs, **kw), kw
    assert chat_tokens(msgs, add_generation_prompt=False, continue_final_message=True) < \
        chat_tokens(msgs, add_generation_prompt=False) < chat_tokens(msgs, add_generation_prompt=True)
    both = {"messages": msgs, "max_tokens": 1, "continue_final_message": True}  # add_generation_prompt defaults true
    assert error(post(served, both, "/v1/chat/completions"), 400)["param"] == "continue_final_message"
    clash = {**CHAT, "chat_template_kwargs": {"tokenize": True}}
    assert error(post(served, clash, "/v1/chat/completions"), 400)["param"] == "chat_template_kwargs"


def test_render_refuses_token_ids_outside_the_vocabulary(served):
    err = error(post(served, {"prompt": [1, 49152]}, "/v1/completions/render"), 400)
    assert err["param"] == "prompt" and "outside the vocabulary (0..49151)" in err["message"], err
    ok = post(served, {"prompt": [1, 49151]}, "/v1/completions/render")
    assert ok.status_code == 200 and ok.json()[0]["token_ids"] == [1, 49151]


# -- 4. slow clients -------------------------------------------------------------------------------------------------
def trickle(srv, data: bytes, every: float = 0.2, limit: float = 8.0) -> tuple[float, bytes]:
    """Send ``data`` a byte every ``every`` s until the server closes the connection (or ``limit`` s pass):
    (seconds until the close, what the server answered)."""
    start = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=limit) as sock:
        sock.settimeout(every)
        for i in range(int(limit / every)):
            try:
                sock.send(data[i % len(data):i % len(data) + 1])
            except OSError:  # reset: closed
                break
            try:
                got = sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if not got:
                break
            answer += got
        return time.monotonic() - start, answer


def test_a_client_trickling_its_headers_is_cut_off(local):
    took, _ = trickle(local, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000)
    assert took < 3.0, took  # the head deadline is 1 s here (HEADER_TIMEOUT_S, 10 s, in serve)


def test_a_client_trickling_its_body_gets_a_408(local, monkeypatch):
    monkeypatch.setattr(local.app.state.server, "body_timeout", 1.0)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
    with socket.create_connection(("127.0.0.1", local.port), timeout=10) as sock:
        sock.sendall(head)
        start = time.monotonic()
        answer = b""
        sock.settimeout(0.2)
        while time.monotonic() - start < 8 and b"\r\n\r\n" not in answer:
            try:
                sock.send(b" ")
                answer += sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - start < 4.0


# -- last: SIGTERM stops the shared server gracefully ------------------------------------------------------------------
def test_sigterm_is_a_graceful_shutdown_with_status_0(served):
    body = {"prompt": [5, 6, 7], "max_tokens": 24, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        served.proc.send_signal(signal.SIGTERM)  # the open stream still completes
        rest = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert served.proc.wait(120) == 0, served.log.read_text()
    assert "Traceback" not in served.log.read_text()


# -- stalls: a hostile call must not freeze the other streams ------------------------------------------------------
def _gaps_while(served, hostile) -> tuple[float, list]:
    """The largest gap between two chunks of a concurrent stream while ``hostile()`` runs (its results too)."""
    arrivals, started = [], threading.Event()

    def stream():
        body = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    started.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert started.wait(60)
    time.sleep(0.3)
    mark = time.monotonic()
    results = hostile()
    end = time.monotonic()
    t.join(120)
    assert not t.is_alive()
    during = [a for a in arrivals if mark <= a] + [end]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(arrivals) > 10, len(arrivals)
    return max(gaps + [0.0]), results


@pytest.fixture(scope="module")
def quiet(tmp_path_factory):
    """A server of its own for the stall tests (the shared one may be busy or dead from earlier tests)."""
    srv = Served(tmp_path_factory.mktemp("stalls"))
    yield srv
    srv.close()


STALL_S = 3.0  # a token of the other stream comes well within this (tiny model, shared CPUs); blocking takes longer


def test_half_a_million_prompts_is_a_quick_400_that_stalls_no_stream(quiet):
    served = quiet
    def hostile():
        start = time.monotonic()
        r = post(served, {"prompt": [[1]] * 500_000, "max_tokens": 1})
        return r, time.monotonic() - start

    gap, (r, took) = _gaps_while(served, hostile)
    err = error(r, 400)
    assert "max_num_seqs + max_queued" in err["message"], err
    assert took < 6 and gap < STALL_S, (took, gap)  # before the count came first: ~8 s under load


def test_a_chat_of_60000_messages_stalls_no_stream(quiet):
    served = quiet
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(60_000)]

    def hostile():
        return post(served, {"messages": msgs, "max_tokens": 1}, "/v1/chat/completions", timeout=120)

    gap, r = _gaps_while(served, hostile)
    assert r.status_code in (200, 400), r.text[:300]  # 400: too long for max_model_len
    assert gap < STALL_S, gap
