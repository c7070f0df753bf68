"""``python -m tinypaged serve``: the engine behind an OpenAI-compatible HTTP API (as ``vllm serve``).

FastAPI routes on uvicorn's event loop. The engine runs in one of two ways (``Server``):

* ``serve``'s default, as vLLM v1: the engine core in its own process (``engine_core.py``), reached through
  ``CoreClient`` (``core_client.py``) over ZeroMQ with msgspec messages (vLLM v1 today): this process does HTTP,
  validation, tokenization, detokenization, stop strings and server-sent events; the core schedules, executes,
  samples and applies the token rules, and sends token ids. ``TINYPAGED_ENABLE_MULTIPROCESSING=0`` (vLLM's
  ``VLLM_ENABLE_V1_MULTIPROCESSING``) or ``--no-multiprocessing`` keeps the engine in-process instead;
* ``create_app(llm, ...)`` (tests, notebooks) and that in-process mode: one background thread of this
  process steps the engine (``EngineLoop``), sharing the interpreter with the event loop.

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

from tinypaged.entrypoints.cli_args import build_llm, check_kv_events, core_args, multiprocessing_enabled
from tinypaged.entrypoints.core_client import CoreClient
from tinypaged.entrypoints.engine_loop import EngineDead, EngineLoop, Event, Overloaded, ShuttingDown
from tinypaged.sampling_params import SamplingParams
from tinypaged.entrypoints.server_metrics import ServerMetrics
from tinypaged.entrypoints.streaming import sse_stream

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
    """The routes' shared state: the engine loop, its tokenizer, metrics and the served name.

    ``engine`` is an ``LLM`` (its engine stepped by a thread of this process, ``EngineLoop``) or a started
    ``CoreClient`` (the engine core in its own process; ``self.engine`` is then None)."""

    def __init__(self, engine, model_name: str, max_queued: int = 256):
        self.model_name = model_name
        self.metrics = ServerMetrics(model_name)
        self._tok = None
        if isinstance(engine, CoreClient):
            if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 0:
                raise ValueError(f"max_queued (--max-queued-requests) must be an integer >= 0, got {max_queued!r}")
            self.llm, self.engine, self.loop = None, None, engine
            engine.max_queued, engine.observer = max_queued, self.metrics
            self.max_model_len, max_num_seqs = engine.max_model_len, engine.max_num_seqs
        else:
            self.llm, self.engine = engine, engine.llm_engine
            self.loop = EngineLoop(self.engine, self.engine.detokenizer.stream_text, max_queued, self.metrics)
            self.loop.refuse_long_max_tokens = True  # a 400 naming both numbers, as vLLM's server
            self.max_model_len, max_num_seqs = self.engine.config.max_model_len, self.engine.config.max_num_seqs
        self.metrics.watch(self.loop)
        self.created = int(time.time())
        # the size bounds (module docstring), fixed before the loop starts: checks cost O(1) on the event loop
        tok = self.tokenizer
        longest = 0 if isinstance(tok, _NoTokenizer) else max(map(len, tok.get_vocab()), default=0)
        self.max_prompt_chars = 2 * longest * self.max_model_len if longest else None  # None: ids only
        per_prompt = max(12 * (self.max_prompt_chars or 0), 16 * self.max_model_len)  # ids: "1234567, "
        self.max_body_bytes = 2**20 + per_prompt * (max_num_seqs + max_queued)

    @property
    def tokenizer(self):
        if self._tok is None:
            if self.engine is None:  # the core runs elsewhere: this process has its own copy (it detokenizes too)
                self._tok = self.loop.tokenizer or _NoTokenizer()
            else:
                try:
                    self._tok = self.engine.tokenizer
                except ValueError:
                    self._tok = _NoTokenizer()
        return self._tok

    def engine_prompt(self, request_id: str, prompt):
        """The prompt as the engine core takes it: text is tokenized here (off the core's step loop), so the
        core only validates. Unchanged for the in-process loop (the engine tokenizes)."""
        if self.engine is not None:
            return prompt
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if "prompt_token_ids" in prompt:
            return prompt
        text = prompt["prompt"]
        if isinstance(self.tokenizer, _NoTokenizer):
            raise ValueError(f"Model {self.model_name!r} ships no tokenizer: send the prompt as token ids")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800") has no UTF-8 form to tokenize
            raise ValueError(f"Request {request_id}: the prompt is not valid Unicode text: {text[e.start:e.end]!r} "
                             f"at character {e.start} is a lone surrogate") from None
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text)}

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


def create_app(llm, model_name: str, max_queued: int = 256, stream=None, access_log: bool = False,
               banner: str | None = None):
    """The ASGI app around one ``LLM`` (its engine is stepped by the app's own loop thread) or a started
    ``CoreClient`` (the engine core process). ``stream``: the function that turns a call's events into server-sent
    events (default ``streaming.sse_stream``; stage 8's learners' own). ``access_log``: one line per request on the
    ``tinypaged`` logger; ``banner``: a line logged once the app has started (serve's URL and model)."""
    server = Server(llm, model_name, max_queued)
    server.sse_stream = stream or sse_stream

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if isinstance(server.loop, EngineLoop):
            server.loop.start()
        if banner:
            logger.info("%s", banner)
        yield
        drained = server.loop.drain(timeout=30)  # uvicorn has already waited for open responses
        server.loop.stop()
        logger.info("server stopped (%s)", "drained" if drained else "aborted what was left")

    app = FastAPI(title="tinypaged", lifespan=lifespan)
    app.state.server = server
    if access_log:
        app.add_middleware(AccessLog)

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
        dead = getattr(server.loop, "dead", None)
        if dead is not None:
            err = APIError(503, f"the engine core process has died ({dead}); the server is exiting", None,
                           "engine_dead")
            return JSONResponse(error_body(err), status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "tinypaged",
                                            "max_model_len": server.max_model_len}]}

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

    @app.post("/v1/completions/render")
    async def render_completions(request: Request):
        """vLLM's render API: each prompt's token ids, nothing generated (vllm-router's kv_aware asks it, stage 9)."""
        req = await _parse(request, server, CompletionRequest)
        out = []
        for i, prompt in enumerate(server.completion_prompts(req)):
            if isinstance(prompt, str):
                if isinstance(server.tokenizer, _NoTokenizer):
                    raise APIError(400, f"model {model_name!r} has no tokenizer: send token ids", "prompt")
                prompt = {"prompt_token_ids": await asyncio.to_thread(server.tokenizer.encode, prompt)}
            out.append({"request_id": f"render-{i}", "token_ids": list(prompt["prompt_token_ids"])})
        return out

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
            deliver = (lambda ev, i=i: aio.call_soon_threadsafe(events.put_nowait, (i, ev)))
            sub = await asyncio.to_thread(
                lambda rid=rid, prompt=prompt, deliver=deliver:
                    server.loop.submit(rid, server.engine_prompt(rid, prompt), params, deliver))
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
    except EngineDead as exc:
        raise APIError(503, str(exc), None, "engine_dead") from None
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

    def piece(self, c: int, ev: Event) -> dict:
        """Choice ``c``'s part of the streamed chunk for ``ev`` (after ``_take`` has booked it)."""
        reason, stop_reason = self.finish[c] if ev.finished else (None, None)
        out: dict[str, Any] = {"index": c, "logprobs": None, "finish_reason": reason, "stop_reason": stop_reason}
        if self.chat:
            out["delta"] = {"content": ev.text} if ev.text else {}
        else:
            out["text"] = ev.text
        if self.with_ids:
            out["token_ids"] = ev.token_ids
        return out

    def _chunk(self, choices: list, usage=None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.server.model_name, "choices": choices, "usage": usage}
        return f"data: {json.dumps(body)}\n\n"

    def stream(self, events: asyncio.Queue, include_usage: bool):
        """SSE chunks as tokens settle; closing the stream early (a disconnect) aborts the call. The server's
        stream function (``create_app(stream=...)``; default ``streaming.sse_stream``, stage 8's assignment)."""
        return self.server.sse_stream(self, events, include_usage)


class AccessLog:
    """One line per request once its response has ended (uvicorn's access log, with the duration of a stream):
    ``127.0.0.1:50312 "POST /v1/completions" 200 0.412s``. ``serve --no-access-log`` turns it off."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            client = scope.get("client") or ("-", 0)
            logger.info('%s:%s "%s %s" %d %.3fs', client[0], client[1], scope["method"], scope["path"], status[0],
                        time.perf_counter() - start)


# -- command line -------------------------------------------------------------------------------------
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


DEATH_GRACE_S = 2.0  # after the engine core dies: 503s and error events for this long, then the server exits


def serve(args) -> int:
    import threading

    import uvicorn

    from tinypaged.engine.llm_engine import configure_logging

    if args.max_queued_requests < 0:  # before the model loads (the parser refuses it too)
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    check_kv_events(args)
    in_process = not multiprocessing_enabled(args)
    sock = bind_socket(args.host, args.port)
    client = None
    server = None
    try:
        configure_logging()
        name = args.served_model_name or args.model
        if in_process:
            engine, where = build_llm(args), "in this process (a thread)"
        else:
            def on_death(why):  # on the client's reader thread: let streams end and new requests see 503s
                def leave():
                    if server is not None:
                        server.should_exit = True

                threading.Timer(DEATH_GRACE_S, leave).start()

            client = CoreClient(core_args(args), args.max_queued_requests, on_death=on_death).start()
            engine, where = client, f"in its own process (pid {client.pid})"
        host = f"[{args.host}]" if ":" in args.host else args.host
        banner = f"serving model {name!r} at http://{host}:{args.port} (engine core {where}); Ctrl-C to stop"
        app = create_app(engine, name, args.max_queued_requests, access_log=getattr(args, "access_log", True),
                         banner=banner)
        # uvicorn handles Ctrl-C: it stops accepting, lets open responses finish, then runs the
        # lifespan's shutdown (the engine loop drains and stops; the core process is shut down)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                               timeout_graceful_shutdown=30))
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the Ctrl-C again once it has shut down
            server.run(sockets=[sock])
    finally:
        sock.close()
        if client is not None:
            client.stop()  # idempotent: no engine core outlives the server
    if client is not None and client.dead is not None:
        logger.error("exiting: the engine core process died (%s)", client.dead)
        return 1
    return 0 if server.started else 3  # 3: uvicorn's "startup failed" (the app's lifespan raised, say)
