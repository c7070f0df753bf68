"""``python -m tinypaged serve``: the engine behind an OpenAI-compatible HTTP API (as ``vllm serve``).

FastAPI routes on uvicorn's event loop; one background thread steps the engine (``EngineLoop``).

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the model's chat template), with
  ``stream: true`` as server-sent events (``data: {...}`` chunks, then ``data: [DONE]``) and
  ``stream_options.include_usage`` for a last chunk carrying ``usage``;
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, vLLM's metric names);
* a client that disconnects aborts its request at once (its blocks are freed);
* a bad body or parameter is a 400 in OpenAI's error shape naming the field; a request that can
  never fit is a 400; past the queue bound the answer is 503; an engine failure is a 500.

Besides OpenAI's fields the request bodies take vLLM's extensions that map onto ``SamplingParams``:
``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, and ``return_token_ids`` (each choice
then carries its ``token_ids``, as vLLM does; handy for a model without a tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tinypaged.engine_loop import EngineLoop, Event, Overloaded, ShuttingDown
from tinypaged.sampling_params import SamplingParams
from tinypaged.server_metrics import ServerMetrics

logger = logging.getLogger("tinypaged")


# -- request bodies ------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    # unknown fields are ignored, as OpenAI clients send extras (user, logit_bias, ...)
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=16)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
                              stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(err: APIError) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.status}}


# -- the app -------------------------------------------------------------------------------------------
class Server:
    """The routes' shared state: the engine loop, its tokenizer, metrics and the served name."""

    def __init__(self, llm, model_name: str, max_queued: int = 256):
        self.llm, self.model_name = llm, model_name
        self.engine = llm.llm_engine
        self.metrics = ServerMetrics(model_name)
        self._tok = None
        self.loop = EngineLoop(self.engine, self.engine.detokenizer.stream_text, max_queued, self.metrics)
        self.metrics.watch(self.loop)
        self.created = int(time.time())

    @property
    def tokenizer(self):
        if self._tok is None:
            try:
                self._tok = self.engine.tokenizer
            except ValueError:
                self._tok = _NoTokenizer()
        return self._tok

    # prompts -> engine prompts ----------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list:
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) for x in p):
            return [{"prompt_token_ids": list(x)} for x in p]
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                            "lists of token ids", "prompt")

    def chat_prompt(self, req: ChatRequest) -> dict:
        tok = self.tokenizer
        if isinstance(tok, _NoTokenizer):
            raise APIError(400, f"model {self.model_name!r} has no tokenizer, so no chat template: use "
                                "/v1/completions with token ids", "messages")
        msgs = [{"role": m.role, "content": m.content} for m in req.messages]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}


class _NoTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _params(req: _Sampling, max_tokens) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens)
    except ValueError as exc:
        msg = str(exc)
        field = next((f for f in ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids",
                                  "stop", "n") if f in msg), None)
        raise APIError(400, msg, field) from None


def create_app(llm, model_name: str, max_queued: int = 256):
    """The ASGI app around one ``LLM`` (its engine is stepped by the app's own loop thread)."""
    server = Server(llm, model_name, max_queued)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        yield
        drained = server.loop.drain(timeout=30)  # uvicorn has already waited for open responses
        server.loop.stop()
        logger.info("server stopped (%s)", "drained" if drained else "aborted what was left")

    app = FastAPI(title="tinypaged", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(error_body(exc), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            msg = "the request body is not valid JSON"
        else:
            msg = f"{param or 'body'}: {first.get('msg', 'invalid')}"
        return JSONResponse(error_body(APIError(400, msg, param)), status_code=400)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "tinypaged",
                                            "max_model_len": server.engine.config.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        body = await asyncio.to_thread(server.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check_model(req, model_name)
        prompts = server.completion_prompts(req)
        return await _serve(server, request, req, prompts, _params(req, req.max_tokens), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        _check_model(req, model_name)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await _serve(server, request, req, [server.chat_prompt(req)], _params(req, max_tokens), chat=True)

    return app


def _check_model(req, model_name: str) -> None:
    if req.model is not None and req.model != model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}", "model",
                       "not_found_error")


async def _serve(server: Server, request, req: _Sampling, prompts: list, params: SamplingParams, chat: bool):
    aio = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    kind = "chatcmpl" if chat else "cmpl"
    call_id = server.loop.next_id(kind)
    subs = []
    try:
        for i, prompt in enumerate(prompts):
            rid = f"{call_id}-{i}"
            sub = await asyncio.to_thread(server.loop.submit, rid, prompt, params,
                                          lambda ev, i=i: aio.call_soon_threadsafe(events.put_nowait, (i, ev)))
            subs.append(sub)
    except (ValueError, TypeError) as exc:
        _abort(server, subs)
        raise APIError(400, str(exc), "messages" if chat else "prompt") from None
    except Overloaded as exc:
        _abort(server, subs)
        raise APIError(503, f"server overloaded: {exc}; retry later", None, "server_overloaded") from None
    except ShuttingDown as exc:
        _abort(server, subs)
        raise APIError(503, str(exc), None, "server_shutting_down") from None
    call = _Call(server, call_id, chat, len(prompts) * params.n, params.n, req.return_token_ids, subs)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(call.stream(events, usage), media_type="text/event-stream")
    result = await call.collect(events, request)
    if isinstance(result, APIError):
        return JSONResponse(error_body(result), status_code=result.status)
    return result


def _abort(server: Server, subs) -> None:
    for sub in subs:
        server.loop.abort(sub.request_id)


class _Call:
    """One HTTP call: its requests (one per prompt), their events, and the response they make."""

    def __init__(self, server, call_id, chat, num_choices, n, with_ids, subs):
        self.server, self.id, self.chat, self.n, self.with_ids, self.subs = server, call_id, chat, n, with_ids, subs
        self.num_choices, self.done = num_choices, set()
        self.text = [""] * num_choices
        self.ids: list[list[int]] = [[] for _ in range(num_choices)]
        self.finish: list[tuple] = [(None, None)] * num_choices
        self.created = int(time.time())
        self.error: str | None = None

    def _choice(self, prompt_idx: int, ev: Event) -> int:
        return prompt_idx * self.n + ev.index

    def _take(self, prompt_idx: int, ev: Event) -> int:
        c = self._choice(prompt_idx, ev)
        self.text[c] += ev.text
        self.ids[c] += ev.token_ids
        if ev.error is not None:
            self.error = ev.error
        if ev.finished:
            # a request's last event closes all its samples (aborts and failures come once)
            closing = range(prompt_idx * self.n, (prompt_idx + 1) * self.n) if ev.error or ev.finish_reason == "abort" \
                else [c]
            for k in closing:
                if k not in self.done:
                    self.done.add(k)
                    self.finish[k] = (ev.finish_reason, ev.stop_reason)
        return c

    def usage(self) -> dict:
        prompt = sum(s.num_prompt_tokens for s in self.subs)
        completion = sum(len(x) for x in self.ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _body_choice(self, c: int) -> dict:
        reason, stop_reason = self.finish[c]
        out: dict[str, Any] = {"index": c, "finish_reason": reason, "stop_reason": stop_reason, "logprobs": None}
        if self.chat:
            out["message"] = {"role": "assistant", "content": self.text[c]}
        else:
            out["text"] = self.text[c]
        if self.with_ids:
            out["token_ids"] = self.ids[c]
        return out

    async def collect(self, events: asyncio.Queue, request):
        """Wait for every choice; a client that goes away aborts the call's requests."""
        while len(self.done) < self.num_choices:
            try:
                i, ev = await asyncio.wait_for(events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    _abort(self.server, self.subs)
                    return APIError(499, "client disconnected")
                continue
            self._take(i, ev)
        if self.error is not None:
            return APIError(500, f"the engine failed while running this request: {self.error}", None, "internal_error")
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.server.model_name,
                "choices": [self._body_choice(c) for c in range(self.num_choices)], "usage": self.usage()}

    def _chunk(self, choices: list, usage=None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.server.model_name, "choices": choices, "usage": usage}
        return f"data: {json.dumps(body)}\n\n"

    async def stream(self, events: asyncio.Queue, include_usage: bool):
        """SSE chunks as tokens settle; closing the stream early (a disconnect) aborts the call."""
        try:
            if self.chat:
                yield self._chunk([{"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None} for c in range(self.num_choices)])
            while len(self.done) < self.num_choices:
                i, ev = await events.get()
                was_done = set(self.done)
                c = self._take(i, ev)
                if self.error is not None:
                    err = error_body(APIError(500, f"the engine failed: {self.error}", None, "internal_error"))
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                if ev.text or ev.token_ids or (ev.finished and c not in was_done):
                    reason, stop_reason = self.finish[c] if ev.finished else (None, None)
                    piece: dict[str, Any] = {"index": c, "logprobs": None, "finish_reason": reason,
                                             "stop_reason": stop_reason}
                    if self.chat:
                        piece["delta"] = {"content": ev.text} if ev.text else {}
                    else:
                        piece["text"] = ev.text
                    if self.with_ids:
                        piece["token_ids"] = ev.token_ids
                    yield self._chunk([piece])
            if include_usage and self.error is None:
                yield self._chunk([], self.usage())
            yield "data: [DONE]\n\n"
        finally:
            if len(self.done) < self.num_choices:
                _abort(self.server, self.subs)


# -- command line -------------------------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-queued-requests", type=int, default=256,
                    help="requests that may wait beyond max_num_seqs before the server answers 503 (course)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--num-gpu-blocks-override", type=int, default=None)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--enable-prefix-caching", action="store_true")
    ap.add_argument("--kv-cache-manager", default=None, metavar="MODULE:NAME",
                    help="a KV-manager factory to plug in (e.g. a learner's, from a .py file: path/to/file.py:Name)")
    ap.add_argument("--scheduling-policy", default=None, metavar="MODULE:NAME")
    ap.add_argument("--attention-backend", default="torch", help="torch, triton, or MODULE:NAME of a decode function")


def load_object(spec: str):
    """``package.module:name`` or ``path/to/file.py:name`` -> the object."""
    import importlib
    import importlib.util
    import pathlib

    if ":" not in spec:
        raise ValueError(f"{spec!r}: give MODULE:NAME or path/to/file.py:NAME")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = pathlib.Path(where)
        if not path.is_file():
            raise ValueError(f"{where}: no such file")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"{where} has no {name!r}")
    return getattr(module, name)


def build_llm(args):
    from tinypaged import LLM

    knobs = dict(dtype=args.dtype, device=args.device, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                 num_gpu_blocks_override=args.num_gpu_blocks_override,
                 kv_cache_memory_bytes=args.kv_cache_memory_bytes, enable_prefix_caching=args.enable_prefix_caching,
                 history_size=0)
    if args.kv_cache_manager:
        knobs["kv_cache_manager"] = load_object(args.kv_cache_manager)
    if args.scheduling_policy:
        knobs["scheduling_policy"] = load_object(args.scheduling_policy)
    backend = args.attention_backend
    knobs["attention_backend"] = backend if backend in ("torch", "triton") else load_object(backend)
    return LLM(args.model, **knobs)


class ServerThread:
    """The app on uvicorn in a background thread, on 127.0.0.1 and a free port (tests, benchmarks,
    notebooks); ``close()`` shuts it down the way Ctrl-C does."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0):
        import socket
        import threading

        import uvicorn

        if port == 0:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.app, self.port, self.url = app, port, f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, name="tinypaged-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)

    @property
    def loop(self) -> EngineLoop:
        return self.app.state.server.loop

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def serve(args) -> int:
    import uvicorn

    llm = build_llm(args)
    app = create_app(llm, args.served_model_name or args.model, args.max_queued_requests)
    # uvicorn handles Ctrl-C: it stops accepting, lets open responses finish, then runs the
    # lifespan's shutdown (the engine loop drains and stops)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)
    return 0
