"""``python -m tinypaged serve``: the engine behind an OpenAI-compatible HTTP API (as ``vllm serve``).

FastAPI routes on uvicorn's event loop; one background thread steps the engine (``EngineLoop``).

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the model's chat template), with
  ``stream: true`` as server-sent events (``data: {...}`` chunks, then ``data: [DONE]``) and
  ``stream_options.include_usage`` for a last chunk carrying ``usage``;
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, vLLM's metric names);
* a client that disconnects aborts its request at once (its blocks are freed);
* a bad body or parameter is a 400 in OpenAI's error shape naming the field; a request that can
  never fit is a 400; past the queue bound the answer is 503; an engine failure is a 500; unknown
  routes (404), wrong methods (405) and bodies that are not UTF-8 JSON objects get the same shape;
* a field tinypaged does not implement (``logprobs``, ``echo``, ``best_of``, penalties, ...) is a 400
  naming it when it asks for something, never silently ignored;
* size bounds, checked before any tokenizing (which runs on the engine's thread and would stall every
  stream): a text prompt longer than ``max_prompt_chars`` characters cannot fit and is a 400. That
  bound is 2 x (the longest vocabulary entry, in characters) x ``max_model_len``: no token covers more
  text than its vocabulary entry, and the factor 2 leaves room for tokenizers that normalize text. A
  body longer than ``max_body_bytes`` is a 413 before it is parsed: 12 bytes (the longest JSON escape of
  one character) per allowed prompt character, for as many prompts as the server can hold at once
  (``max_num_seqs + max_queued``), plus 1 MiB for the other fields.

Besides OpenAI's fields the request bodies take vLLM's extensions that map onto ``SamplingParams``:
``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, and ``return_token_ids`` (each choice
then carries its ``token_ids``, as vLLM does; handy for a model without a tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import re
import sys
import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinypaged.entrypoints.engine_loop import EngineLoop, Event, Overloaded, ShuttingDown
from tinypaged.sampling_params import SamplingParams
from tinypaged.entrypoints.server_metrics import ServerMetrics

logger = logging.getLogger("tinypaged")


# -- request bodies ------------------------------------------------------------------------------------
def _no_bool(value):
    # JSON true/false are not numbers (pydantic's lax mode would read true as 1; vLLM's server refuses it)
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields of OpenAI's (and vLLM's) requests that tinypaged does not implement: each is accepted only with a
# value that asks for nothing (absent, null, or as below: ``off(value, n)`` is true), and otherwise refused by
# name, never silently ignored.
UNIMPLEMENTED = {
    "logprobs": lambda v, n: v is None or v is False,  # completions take a number, chat a boolean
    "top_logprobs": lambda v, n: v is None or v == 0,
    "prompt_logprobs": lambda v, n: v is None,
    "echo": lambda v, n: v is None or v is False,
    "best_of": lambda v, n: v is None or v == n,
    "suffix": lambda v, n: v is None or v == "",
    "presence_penalty": lambda v, n: v is None or v == 0,
    "frequency_penalty": lambda v, n: v is None or v == 0,
    "repetition_penalty": lambda v, n: v is None or v == 1,
    "logit_bias": lambda v, n: v is None or v == {},
    "response_format": lambda v, n: v is None or v == {"type": "text"},
    "tools": lambda v, n: v is None or v == [],
}


class _Sampling(BaseModel):
    # unknown fields are ignored, as OpenAI clients send extras (user, ...)
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Int | None = Field(default=16)
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: Int = -1
    n: Int = 1
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    return_token_ids: bool = False
    # not implemented: refused by name when set (see UNIMPLEMENTED)
    logprobs: Any = None
    top_logprobs: Any = None
    prompt_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    response_format: Any = None
    tools: Any = None

    def refuse_unimplemented(self) -> None:
        for name, off in UNIMPLEMENTED.items():
            value = getattr(self, name)
            if not off(value, self.n):
                raise APIError(400, f"{name}={json.dumps(value)[:80]} is not supported by tinypaged's server; "
                                    f"leave {name} out (or null)", name)

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
                              stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)


class CompletionRequest(_Sampling):
    prompt: str | list[Int] | list[str] | list[list[Int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(err: APIError) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.status}}


def validation_error(errors: list) -> APIError:
    """The first problem pydantic found, as a 400 naming the field (``messages.0.role``)."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # a union's branches add their type to the path (prompt.list[int].0): keep the request's own names
    loc = [x for x in loc if not re.fullmatch(r"(str|int|float|list\[.*\]|function-.*)", x)]
    param = ".".join(loc) or None
    if param == "prompt" and len(errors) > 1:  # no branch of the union matched
        return APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                             "lists of token ids", "prompt")
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", None)
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return APIError(400, f"{param or 'body'}: {msg}", param)


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
        # the size bounds (module docstring), fixed before the loop starts: checks cost O(1) on the event loop
        config = self.engine.config
        self.max_model_len = config.max_model_len
        tok = self.tokenizer
        longest = 0 if isinstance(tok, _NoTokenizer) else max(map(len, tok.get_vocab()), default=0)
        self.max_prompt_chars = 2 * longest * self.max_model_len if longest else None  # None: ids only
        per_prompt = max(12 * (self.max_prompt_chars or 0), 16 * self.max_model_len)  # ids: "1234567, "
        self.max_body_bytes = 2**20 + per_prompt * (config.max_num_seqs + max_queued)

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
            prompts = [p]
        elif not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        elif all(isinstance(x, int) for x in p):
            prompts = [{"prompt_token_ids": list(p)}]
        elif all(isinstance(x, str) for x in p):
            prompts = list(p)
        elif all(isinstance(x, list) for x in p):
            prompts = [{"prompt_token_ids": list(x)} for x in p]
        else:
            raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                                "lists of token ids", "prompt")
        for i, one in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(one, str):
                self.check_text_size(len(one), where, "prompt")
            elif len(one["prompt_token_ids"]) > self.max_model_len:
                raise APIError(400, f"{where} has {len(one['prompt_token_ids'])} token ids, more than max_model_len "
                                    f"({self.max_model_len})", "prompt")
        return prompts

    def check_text_size(self, chars: int, where: str, param: str) -> None:
        """Refuse text that cannot fit in max_model_len tokens by its length alone, before tokenizing it."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise APIError(400, f"{where} is {chars} characters long: it cannot fit in max_model_len "
                                f"({self.max_model_len}) tokens, and text over {self.max_prompt_chars} characters "
                                f"is refused before it is tokenized", param)

    def chat_prompt(self, req: ChatRequest) -> dict:
        tok = self.tokenizer
        if isinstance(tok, _NoTokenizer):
            raise APIError(400, f"model {self.model_name!r} has no tokenizer, so no chat template: use "
                                "/v1/completions with token ids", "messages")
        self.check_text_size(sum(len(m.content) for m in req.messages), "the messages' content", "messages")
        msgs = [{"role": m.role, "content": m.content} for m in req.messages]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}


class _NoTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop",
                   "n", "ignore_eos")


def _param_of(message: str, default: str | None) -> str | None:
    """The request field an engine message is about: the field its (first) problem starts with, or one that
    it names (``n=300 forked samples ...``, ``stop_token_ids [..] are outside ...``)."""
    first = re.sub(r"^(Invalid SamplingParams|Request [^:]*): ", "", message)
    word = re.match(r"\w+", first)
    if word and word.group() in SAMPLING_FIELDS:
        return word.group()
    for field in ("stop_token_ids", "n"):
        if re.search(rf"\b{field}\b(=\d| \[)", first):
            return field
    return default


def _params(req: _Sampling, max_tokens, chat: bool = False) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens)
    except ValueError as exc:
        msg, field = str(exc), _param_of(str(exc), None)
        if chat and field == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
            msg, field = msg.replace("max_tokens", "max_completion_tokens"), "max_completion_tokens"
        raise APIError(400, msg, field) from None


async def _read_json(request: Request, server: Server) -> dict:
    """The body as a JSON object: too long (413), not UTF-8, not JSON, nested too deeply or not an object
    (400) are refused in OpenAI's error shape, before anything else is done with it."""
    limit = server.max_body_bytes
    too_long = (f"the request body is over {limit} bytes, more than any request this server can take "
                f"(max_model_len {server.max_model_len}); send a shorter prompt")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(413, too_long, None)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, too_long, None)
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start}): send JSON encoded "
                            f"as UTF-8", None) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column "
                            f"{exc.colno}", None) from None
    except RecursionError:
        raise APIError(400, "the request body's JSON is nested too deeply to parse", None) from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, got a JSON {type(obj).__name__}", None)
    return obj


async def _parse(request: Request, server: Server, model: type[_Sampling]) -> _Sampling:
    obj = await _read_json(request, server)
    try:
        req = model.model_validate(obj)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", None) from None
    _check_model(req, server.model_name)
    req.refuse_unimplemented()
    return req


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
        return JSONResponse(error_body(validation_error(exc.errors())), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        # the router's own answers (no such route, wrong method) in OpenAI's shape instead of {"detail": ...}
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            err = APIError(404, f"{where}: no such route; this server serves POST /v1/completions, "
                                f"POST /v1/chat/completions, GET /v1/models, GET /health and GET /metrics",
                           None, "not_found_error")
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("allow", "") or (exc.headers or {}).get("Allow", "")
            err = APIError(405, f"{where}: method not allowed on this route (allowed: {allowed})", None)
        else:
            err = APIError(exc.status_code, f"{where}: {exc.detail}", None)
        return JSONResponse(error_body(err), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):  # a bug: Starlette still logs the traceback
        err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}", None, "internal_error")
        return JSONResponse(error_body(err), status_code=500)

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

    # the bodies are parsed by hand (``_parse``), so every refusal has OpenAI's shape and a size bound
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, server, CompletionRequest)
        params = _params(req, req.max_tokens)
        prompts = server.completion_prompts(req)
        return await _serve(server, request, req, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _parse(request, server, ChatRequest)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _params(req, max_tokens, chat=True)
        return await _serve(server, request, req, [server.chat_prompt(req)], params, chat=True)

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
    except (ValueError, TypeError, NotImplementedError) as exc:
        _abort(server, subs)
        raise APIError(400, str(exc), _param_of(str(exc), "messages" if chat else "prompt")) from None
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
def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number in 1..65535, got {value}")
    return value


def int_at_least(lowest: int):
    """An argparse type: an integer >= ``lowest``, or a one-line error naming what was given."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lowest}, got {value}")
        return value

    return parse


def plugin(text: str):
    """An argparse type: ``MODULE:NAME`` or ``path/to/file.py:NAME``, loaded at once, so a bad one is a one-line
    error naming its flag before the model is loaded."""
    try:
        return load_object(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def attention_backend(text: str):
    if text in ("torch", "sdpa", "triton"):
        return text
    if ":" not in text:
        raise argparse.ArgumentTypeError(f"{text!r}: give torch, sdpa, triton, or MODULE:NAME of a decode function")
    return plugin(text)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=port_number, default=8000)
    ap.add_argument("--max-queued-requests", type=int_at_least(0), default=256,
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
    ap.add_argument("--kv-cache-manager", default=None, metavar="MODULE:NAME", type=plugin,
                    help="a KV-manager factory to plug in (e.g. a learner's, from a .py file: path/to/file.py:Name)")
    ap.add_argument("--scheduling-policy", default=None, metavar="MODULE:NAME", type=plugin)
    ap.add_argument("--attention-backend", default=None, type=attention_backend,
                    help="torch (reference), sdpa (torch's fused attention), triton, or MODULE:NAME of a decode "
                         "function (default: sdpa, the fast path)")


def load_object(spec: str):
    """``package.module:name`` or ``path/to/file.py:name`` -> the object. Whatever goes wrong (no such module or
    file, an error while running it, no such name) is a ValueError whose one line says what and where."""
    import importlib
    import importlib.util
    import pathlib
    import traceback

    if ":" not in spec:
        raise ValueError(f"{spec!r}: give MODULE:NAME or path/to/file.py:NAME")
    where, name = spec.rsplit(":", 1)
    if not where or not name:
        raise ValueError(f"{spec!r}: give MODULE:NAME or path/to/file.py:NAME")
    path = pathlib.Path(where)
    if where.endswith(".py") and not path.is_file():
        raise ValueError(f"{where}: no such file")
    try:
        if where.endswith(".py"):
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name and (where == exc.name or where.startswith(exc.name + ".")):  # not one that it imports
            raise ValueError(f"no module named {exc.name!r} (give MODULE:NAME of an importable module, "
                             f"or path/to/file.py:NAME)") from None
        raise ValueError(f"importing {where} failed: {type(exc).__name__}: {exc}") from None
    except BaseException as exc:  # noqa: BLE001 - the plug-in's own code failed (SyntaxError, NameError, exit())
        if isinstance(exc, KeyboardInterrupt):
            raise
        frames = traceback.extract_tb(exc.__traceback__)
        at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        if isinstance(exc, SyntaxError):
            at = f" (at {exc.filename}:{exc.lineno})"
        raise ValueError(f"importing {where} failed: {type(exc).__name__}: {exc}{at}") from None
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
    # the plug-in flags hold the loaded objects (``plugin``); a string (a caller's own namespace) is loaded here
    for flag in ("kv_cache_manager", "scheduling_policy", "attention_backend"):
        value = getattr(args, flag)
        if value is not None:
            if isinstance(value, str) and value not in ("torch", "triton"):
                value = load_object(value)
            knobs[flag] = value
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


def bind_socket(host: str, port: int):
    """The listening socket, bound before the model is loaded: a port in use or a bad host is a ValueError
    naming the flag at once (uvicorn alone would log it after the load and exit with 3)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if sys.platform != "win32":  # as uvicorn: a restart reuses the port at once (on Windows it would share it)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if isinstance(exc, socket.gaierror):
            raise ValueError(f"--host {host}: not an address or host name here ({exc.strerror})") from None
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            reason = "is already in use (another server?)" if exc.errno == errno.EADDRINUSE else \
                "needs privileges to bind (ports below 1024)"
            raise ValueError(f"--port {port}: {host}:{port} {reason}; pick another --port") from None
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None
    sock.set_inheritable(True)
    return sock


def serve(args) -> int:
    import uvicorn

    if args.max_queued_requests < 0:  # before the model loads (the parser refuses it too)
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    sock = bind_socket(args.host, args.port)
    try:
        llm = build_llm(args)
        app = create_app(llm, args.served_model_name or args.model, args.max_queued_requests)
        # uvicorn handles Ctrl-C: it stops accepting, lets open responses finish, then runs the
        # lifespan's shutdown (the engine loop drains and stops)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                               timeout_graceful_shutdown=30))
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the Ctrl-C again once it has shut down
            server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 3  # 3: uvicorn's "startup failed" (the app's lifespan raised, say)
