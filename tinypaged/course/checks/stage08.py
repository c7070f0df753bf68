"""Stage 8 checks: the stream that turns engine outputs into server-sent events and aborts on disconnect.

* ``sse_stream(call, events, include_usage)`` on crafted event sequences: a real ``_Call`` of the server
  (``tinypaged.entrypoints.server``) whose engine side is a stand-in that records aborts, events put in its queue
  by the case. The case reads the stream line by line (or hangs up after some lines, as a client that goes away)
  and records every line as it arrives (the JSON of a ``data:`` line, ``"[DONE]"``), and which requests were
  aborted. Cases: a completion with usage, a chat with ``n`` = 2 (the role chunk first), events that settle no
  text, a finish that repeats (an abort after the end), an engine error mid-stream, and hang-ups; hidden cases are
  random interleavings of prompts and samples, drawn from the seed.
* ``serve_sse``: the same function behind the real server (``create_app(..., stream=sse_stream)``) on the ``tiny``
  model, on 127.0.0.1: two streamed completions must carry the offline engine's greedy tokens, end with
  ``data: [DONE]`` after the usage chunk, and a client that hangs up mid-stream must get its request aborted (the
  engine's count of aborted requests goes up by one; the server's engine steps are slowed so that the request
  cannot finish first) and its KV blocks back (``/metrics``).

The reference is the package's own :func:`tinypaged.entrypoints.streaming.sse_stream`, which the server runs by
default.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import time

from tinypaged.course.checks import Case, register
from tinypaged.course.checks._util import rng
from tinypaged.entrypoints.streaming import sse_stream

WAIT = 10.0  # seconds a case waits for the next line before it calls the stream stuck (the events are all queued)


class _Loop:
    """The engine side of a crafted call: it only records what was aborted."""

    def __init__(self):
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class _Server:
    model_name = "tiny"

    def __init__(self):
        self.loop = _Loop()


def _call(chat: bool, prompts: int, n: int, with_ids: bool):
    from tinypaged.entrypoints.engine_loop import Submission
    from tinypaged.entrypoints.server import _Call

    call_id = "chatcmpl-8" if chat else "cmpl-8"
    subs = [Submission(f"{call_id}-{i}", deliver=lambda ev: None, num_prompt_tokens=3 + i) for i in range(prompts)]
    call = _Call(_Server(), call_id, chat, prompts * n, n, with_ids, subs)
    call.created = 0  # a time stamp: the same for the reference's run and yours
    return call


def _event(prompt: int, index: int, text: str = "", ids=(), finish: str | None = None, error: str | None = None):
    from tinypaged.entrypoints.engine_loop import Event

    return prompt, Event(f"r{prompt}", index, text, list(ids), finished=finish is not None or error is not None,
                         finish_reason=finish, stop_reason=None, error=error)


def _line(text) -> object:
    """What one yielded item is: the JSON of a ``data:`` line, "[DONE]", or what is wrong with it."""
    if not isinstance(text, str):
        return f"not a string: a {type(text).__name__}"
    if not (text.startswith("data: ") and text.endswith("\n\n")):
        return f"not a server-sent event 'data: ...\\n\\n': {text[:60]!r}"
    body = text[len("data: "):-2]
    if body == "[DONE]":
        return "[DONE]"
    try:
        return json.loads(body)
    except ValueError:
        return f"data that is not JSON: {body[:60]!r}"


def _drive(impl, t, *, chat=False, prompts=1, n=1, with_ids=False, include_usage=False, script=(), hang_up=None):
    """Run ``impl`` on a crafted call: record its lines, then what it aborted."""
    call = _call(chat, prompts, n, with_ids)

    async def main():
        events: asyncio.Queue = asyncio.Queue()
        for item in script:
            events.put_nowait(item)
        stream = _stream_of(impl, call, events, include_usage)
        lines, ended = [], "the stream ended"
        try:
            while hang_up is None or len(lines) < hang_up:
                try:
                    lines.append(_line(await asyncio.wait_for(anext(stream), WAIT)))
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    ended = "the stream waited for an event after the last one (it should have ended)"
                    break
            else:
                ended = "the client hung up"
        finally:
            await stream.aclose()  # a client that goes away: the server closes the stream
        return lines, ended

    lines, ended = _run(main())
    t("the stream's lines, in order (JSON of each data: line)", lines)
    t("how the stream ended", ended)
    t("requests aborted (in order; each once)", call.server.loop.aborted)


def _run(coro):
    """Run ``coro`` to the end on a fresh event loop, in this thread (so the checks' tripwire sees the stream's
    frames), also from a notebook, whose kernel's own loop is running here: it is set aside meanwhile."""
    outer = asyncio._get_running_loop()
    asyncio._set_running_loop(None)
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        asyncio._set_running_loop(outer)


def _stream_of(impl, *args):
    """``impl(*args)`` as an async generator; an unfinished stub (an ``async def`` that only raises) raises here."""
    stream = impl(*args)
    if inspect.iscoroutine(stream):
        try:
            stream.send(None)  # a stub raises NotImplementedError here: not written yet
        except StopIteration:
            pass
        finally:
            stream.close()
        raise TypeError("sse_stream must be an async generator: an `async def` that yields its lines")
    if not inspect.isasyncgen(stream):
        raise TypeError(f"sse_stream must be an async generator (`async def` with `yield`), it returned a "
                        f"{type(stream).__name__}")
    return stream


def _case(label, hint, **kw):
    return Case(label, lambda impl, t: _drive(impl, t, **kw), hint)


@register("08", "sse_stream", reference=lambda: sse_stream, points=4)
def cases_sse_stream(hidden):
    if hidden is None:
        return [
            _case("a completion, with usage",
                  "one chunk per event that settled text, the finish in the last piece, then the usage chunk "
                  "(empty choices), then data: [DONE]; nothing is aborted when every choice finished",
                  include_usage=True, with_ids=True,
                  script=[_event(0, 0, "Hello", [11]), _event(0, 0, ",", [12]), _event(0, 0, " world", [13], "length")]),
            _case("chat, n=2",
                  "a chat stream opens with one chunk giving every choice its role; choices of one prompt are "
                  "numbered prompt x n + sample; no usage chunk unless asked",
                  chat=True, n=2,
                  script=[_event(0, 1, "B"), _event(0, 0, "A"), _event(0, 0, "a", (), "stop"),
                          _event(0, 1, "b", (), "length")]),
            _case("events that settle nothing",
                  "an event with no text and no tokens sends nothing (the detokenizer holds back an incomplete "
                  "character), unless it finishes its choice",
                  script=[_event(0, 0, "", []), _event(0, 0, "x", [5]), _event(0, 0, "", [], "stop")]),
            _case("a finish that repeats",
                  "a choice's finish is sent once: a later finished event for a closed choice (an abort after it "
                  "ended) sends nothing",
                  prompts=2, script=[_event(0, 0, "p", [], "length"), _event(1, 0, "q"), _event(0, 0, "", [], "abort"),
                                     _event(1, 0, "r", [], "stop")]),
            _case("an engine error mid-stream",
                  "an event carrying an error ends the stream with one error event (OpenAI's error shape) and "
                  "data: [DONE], no usage chunk; the call's other requests are aborted",
                  prompts=2, include_usage=True,
                  script=[_event(0, 0, "ok"), _event(1, 0, "fine"), _event(0, 0, error="CUDA out of memory"),
                          _event(1, 0, "never sent")]),
            _case("the client hangs up",
                  "closing the stream early (a disconnect) must abort every request of the call, once, so the "
                  "engine frees their blocks at once",
                  prompts=2, include_usage=True, hang_up=2,
                  script=[_event(0, 0, "a"), _event(1, 0, "b"), _event(0, 0, "c"), _event(1, 0, "d", [], "length")]),
            _case("a chat client hangs up after the role chunk",
                  "a stream closed before any event was read still aborts the call's requests",
                  chat=True, hang_up=1, script=[_event(0, 0, "x")]),
        ]
    r = rng(hidden, 81)
    cases = []
    for k in range(6):
        prompts, n = r.randint(1, 3), r.randint(1, 3)
        chat = r.random() < 0.4
        remaining = {(p, i): r.randint(0, 4) for p in range(prompts) for i in range(n)}
        script, token = [], 100
        while remaining:
            p, i = r.choice(sorted(remaining))
            left = remaining[(p, i)]
            finish = None if left else r.choice(["stop", "length"])
            text = r.choice(["", "a", " b", "cd", "\u00e9"]) if r.random() < 0.9 else ""
            ids = [token] if text else []
            token += 1
            script.append(_event(p, i, text, ids, finish))
            if left:
                remaining[(p, i)] = left - 1
            else:
                del remaining[(p, i)]
        if r.random() < 0.25:  # the engine fails one of the requests part way
            at = r.randint(0, len(script) - 1)
            script.insert(at, _event(script[at][0], 0, error="the step raised"))
        hang_up = r.randint(1, len(script)) if r.random() < 0.4 else None
        kw = dict(chat=chat, prompts=prompts, n=n, with_ids=r.random() < 0.5, include_usage=r.random() < 0.5,
                  script=script, hang_up=hang_up)
        desc = (f"random {'chat' if chat else 'completion'}: {prompts} prompt(s) x n={n}, {len(script)} events"
                + (f", hang-up after {hang_up} line(s)" if hang_up else ""))
        cases.append(_case(desc, "compare with the visible cases: order, finishes once, error, usage, [DONE], "
                                 "abort on hang-up", **kw))
    return cases


# ---------------------------------------------------------------- serving real HTTP traffic through it

PROMPTS = ([1, 2, 3], [5, 9, 11, 13])
MAX_TOKENS = 8
LONG = 300  # tokens asked for by the client that hangs up: the engine is slowed so that it cannot finish first
STEP_DELAY = 0.02  # seconds added to each engine step while the hang-up is tested (300 steps: at least 6 s)
TINY = dict(dtype="float32", device="cpu", num_gpu_blocks_override=128, block_size=4, max_num_seqs=8, history_size=0,
            max_model_len=512)
SERVE_STEPS = ("greedy tokens of each streamed choice (return_token_ids)", "finish reasons",
               "the usage chunk's completion_tokens", "every line is a data: line, data: [DONE] the last one",
               "after a client hung up mid-stream: the engine aborted its request (once)",
               "after the hang-up: requests running, KV cache usage (percent)")


def _metric(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class _SlowedEngine:
    """An engine whose ``step`` first sleeps ``delay`` seconds (0: not at all); everything else is the engine's own."""

    def __init__(self, engine):
        self.engine, self.delay = engine, 0.0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, *args, **kwargs):
        if self.delay:
            time.sleep(self.delay)
        return self.engine.step(*args, **kwargs)


class _Slowed:
    """What the check's server serves: ``llm`` (``create_app`` reads its ``llm_engine``) with slowable steps."""

    def __init__(self, llm):
        self.llm_engine = _SlowedEngine(llm.llm_engine)


def _serve_run(impl, t):
    import httpx

    from tinypaged import LLM
    from tinypaged.entrypoints.server import ServerThread, create_app

    if not callable(impl):
        raise TypeError("pass your sse_stream function")
    if not inspect.isasyncgenfunction(impl):
        _stream_of(impl, None, None, False)  # not written yet, or not an async generator: say so before serving
    llm = LLM("tiny", **TINY)
    served = _Slowed(llm)
    srv = ServerThread(create_app(served, "tiny", stream=impl))
    try:
        body = {"model": "tiny", "prompt": [list(p) for p in PROMPTS], "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        lines = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                raise RuntimeError(f"the server answered {r.status_code}: {r.read()[:300]!r}")
            lines = [line for line in r.iter_lines() if line]
        ids, finish, usage = [[] for _ in PROMPTS], [None] * len(PROMPTS), None
        well_formed = bool(lines) and lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            parsed = _line(line + "\n\n")
            if not isinstance(parsed, dict):
                well_formed = False
                continue
            for c in parsed.get("choices") or []:
                ids[c["index"]] += c.get("token_ids") or []
                finish[c["index"]] = c.get("finish_reason") or finish[c["index"]]
            usage = parsed.get("usage") or usage
        t(SERVE_STEPS[0], ids)
        t(SERVE_STEPS[1], finish)
        t(SERVE_STEPS[2], (usage or {}).get("completion_tokens"))
        t(SERVE_STEPS[3], well_formed)

        served.llm_engine.delay = STEP_DELAY
        aborts_before = llm.llm_engine.counters["num_requests_aborted"]
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": list(PROMPTS[1]), "max_tokens": LONG, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            stream = r.iter_lines()  # one iterator: the connection stays open until the block ends
            first = next((line for line in stream if line.startswith("data: ")), None)
            running_while_streaming = int(_metric(httpx.get(srv.url + "/metrics").text, "vllm:num_requests_running"))
        deadline, text = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            text = httpx.get(srv.url + "/metrics").text
            if _metric(text, "vllm:num_requests_running") == 0:
                break
            time.sleep(0.05)
        aborted = llm.llm_engine.counters["num_requests_aborted"] - aborts_before
        t(SERVE_STEPS[4], first is not None and aborted == 1)
        left = [int(_metric(text, "vllm:num_requests_running")), round(100 * _metric(text, "vllm:kv_cache_usage_perc"))]
        t(SERVE_STEPS[5], left)
        if os.environ.get("TINYPAGED_PROBE") != "1":
            print(f"your sse_stream served {len(PROMPTS)} streamed completions over HTTP: {len(lines)} server-sent "
                  f"events, {sum(map(len, ids))} tokens, [DONE] last: {well_formed}")
            print(f"a client hung up after its first event: running while it streamed {running_while_streaming}, "
                  f"aborted {int(aborted)}, running after {left[0]}, KV cache usage after {left[1]}%")
    finally:
        served.llm_engine.delay = 0.0
        srv.close()


def _serve_expected(hidden):
    from tinypaged import LLM, SamplingParams

    outs = LLM("tiny", **TINY).generate([{"prompt_token_ids": list(p)} for p in PROMPTS],
                                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return [{"steps": [[SERVE_STEPS[0], ids], [SERVE_STEPS[1], ["length"] * len(PROMPTS)],
                       [SERVE_STEPS[2], sum(map(len, ids))], [SERVE_STEPS[3], True], [SERVE_STEPS[4], True],
                       [SERVE_STEPS[5], [0, 0]]]}]


@register("08", "sse_stream", points=2, expected=_serve_expected, trace=False, name="serve_sse",
          forbidden=lambda: [sse_stream])
def cases_serve_sse(hidden):
    return [Case(f"the tiny model over HTTP through your stream: {len(PROMPTS)} streamed completions, one hang-up",
                 _serve_run, "run check('sse_stream', ...) first: the server sends exactly what your stream yields",
                 step_hints=((SERVE_STEPS[4], "a client that hangs up closes the stream (CancelledError at your "
                                              "await, or aclose at a yield): abort in a finally"),))]
