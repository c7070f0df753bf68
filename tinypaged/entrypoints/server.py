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
  ``stream_options.include_usage`` for a last chunk carrying ``usage`` (and ``continuous_usage_stats`` for the
  running counts on every chunk);
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, vLLM's metric names);
* a client that disconnects aborts its request at once (its blocks are freed);
* a bad body or parameter is a 400 in OpenAI's error shape naming the field; a request that can
  never fit is a 400; past the queue bound the answer is 503; an engine failure is a 500; unknown
  routes (404), wrong methods (405) and bodies that are not UTF-8 JSON objects get the same shape;
* a call answers (its 200, a stream's first byte) once each of its requests has sent its first event, so a
  request the engine core refuses after ``submit`` (its adds are fire-and-forget) is a 400 too, streamed or
  not (``_Heard``);
* a field tinypaged does not implement (``logprobs``, ``echo``, ``best_of``, penalties, vLLM's ``guided_*``,
  ``structured_outputs``, ``use_beam_search``, chat's ``chat_template``, ...: the
  ``UNIMPLEMENTED`` tables) is a 400 naming it when it asks for something, never silently ignored;
* a number no request can carry (an integer beyond 64 bits) is a 400 naming its field, and no failure of a call
  leaves a request of it booked (every path out of ``_serve`` aborts what it submitted);
* a call holds at most ``max_num_seqs + max_queued`` prompts (more would be a 503 midway: a 400 naming the bound);
  a client that leaves is noticed within ``DISCONNECT_CHECK_S`` while its prompts are submitted and while its
  answer is collected, however busy its events are;
* slow clients: a request's head must arrive within ``HEADER_TIMEOUT_S`` (else the connection is closed), its
  body within ``BODY_TIMEOUT_S`` (else a 408); idle kept-alive connections close after ``--timeout-keep-alive``
  seconds (uvicorn's and vLLM's 5);
* size bounds, checked before any tokenizing (which runs off the event loop: on the engine's thread, or a worker
  thread for chat templates and large bodies): a text prompt longer than ``max_prompt_chars`` characters cannot
  fit and is a 400. That bound is 2 x (the longest vocabulary entry, in characters) x ``max_model_len``: no
  token covers more text than its vocabulary entry, and the factor 2 leaves room for tokenizers that normalize
  text. A body longer than ``max_body_bytes`` is a 413 before it is parsed: 12 bytes (the longest JSON escape
  of one character) per allowed prompt character, for as many prompts as the server can hold at once
  (``max_num_seqs + max_queued``), plus 1 MiB for the other fields. A chat of more than ``max_model_len``
  messages is a 400 as well (each message costs at least one token of the chat template).

Besides OpenAI's fields the request bodies take vLLM's extensions that map onto ``SamplingParams``:
``top_k``, ``min_p``, ``allowed_token_ids``, ``bad_words``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
and ``return_token_ids`` (each choice
then carries its ``token_ids``, as vLLM does; handy for a model without a tokenizer); chat takes vLLM's
``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` (passed to the template).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import re
import sys
import time
from typing import Annotated, Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinypaged.entrypoints.cli_args import build_llm, check_kv_events, core_args, multiprocessing_enabled
from tinypaged.entrypoints.core_client import CoreClient
from tinypaged.entrypoints.engine_client import Rejection
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
    continuous_usage_stats: Any = None  # vLLM's: with include_usage, every chunk carries the running usage


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
    # vLLM's extensions that tinypaged does not implement
    "guided_json": lambda v, n: v is None,
    "guided_regex": lambda v, n: v is None,
    "guided_choice": lambda v, n: v is None,
    "guided_grammar": lambda v, n: v is None,
    "structured_outputs": lambda v, n: v is None,
    "use_beam_search": lambda v, n: v is None or v is False,
    "length_penalty": lambda v, n: v is None or v == 1,
    "spaces_between_special_tokens": lambda v, n: v is None or v is True,
    "logits_processors": lambda v, n: v is None or v == [],
    "prompt_embeds": lambda v, n: v is None,
    "kv_transfer_params": lambda v, n: v is None,
    "truncate_prompt_tokens": lambda v, n: v is None,
}
# the chat route's own (vLLM's chat extensions); add_generation_prompt, continue_final_message and
# chat_template_kwargs are implemented (``Server.chat_prompt``)
CHAT_UNIMPLEMENTED = {
    "chat_template": lambda v, n: v is None,
    "documents": lambda v, n: v is None or v == [],
}


class _Sampling(BaseModel):
    # unknown fields are ignored, as OpenAI clients send extras (user, ...)
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Int | None = Field(default=16)
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: Int = -1
    min_p: Float = 0.0
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None  # tokenized by the server (``Server.with_bad_words``), as vLLM's front end
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
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    logits_processors: Any = None
    prompt_embeds: Any = None
    kv_transfer_params: Any = None
    truncate_prompt_tokens: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    priority: Any = None

    _unimplemented: ClassVar[dict] = UNIMPLEMENTED

    def refuse_unimplemented(self) -> None:
        for name, off in self._unimplemented.items():
            value = getattr(self, name)
            if not off(value, self.n):
                raise APIError(400, f"{name}={json.dumps(value, default=str)[:80]} is not supported by tinypaged's "
                                    f"server; leave {name} out (or null)", name)
        opts = self.stream_options
        if opts is not None and opts.continuous_usage_stats is not None:
            value = opts.continuous_usage_stats
            if not isinstance(value, bool):
                raise APIError(400, f"stream_options.continuous_usage_stats must be true or false, got "
                                    f"{json.dumps(value, default=str)[:80]}", "stream_options.continuous_usage_stats")
            if value and not opts.include_usage:  # vLLM ignores it then; tinypaged says so instead
                raise APIError(400, "stream_options.continuous_usage_stats=true needs stream_options.include_usage="
                                    "true (the running usage rides on the usage stream)",
                               "stream_options.continuous_usage_stats")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
                              stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              min_p=self.min_p, allowed_token_ids=self.allowed_token_ids,
                              include_stop_str_in_output=bool_or(self.include_stop_str_in_output, False),
                              skip_special_tokens=bool_or(self.skip_special_tokens, True))


def bool_or(value, default):
    """A JSON null (or an absent field) is vLLM's default; anything else SamplingParams checks by name."""
    return default if value is None else value


class CompletionRequest(_Sampling):
    prompt: str | list[Int] | list[str] | list[list[Int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    # vLLM's chat extensions, passed to the chat template as vLLM passes them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # not implemented: refused by name when set
    chat_template: Any = None
    documents: Any = None

    _unimplemented: ClassVar[dict] = {**UNIMPLEMENTED, **CHAT_UNIMPLEMENTED}


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


MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 256, 1000  # bad_words are tokenized on the event loop: a small bound


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
            self.vocab_size = engine.vocab_size
        else:
            self.llm, self.engine = engine, engine.llm_engine
            self.loop = EngineLoop(self.engine, self.engine.detokenizer.stream_text, max_queued, self.metrics)
            self.loop.refuse_long_max_tokens = True  # a 400 naming both numbers, as vLLM's server
            self.max_model_len, max_num_seqs = self.engine.config.max_model_len, self.engine.config.max_num_seqs
            self.vocab_size = self.engine.input_processor.vocab_size
        self.metrics.watch(self.loop)
        self.created = int(time.time())
        # the size bounds (module docstring), fixed before the loop starts: checks cost O(1) on the event loop
        tok = self.tokenizer
        longest = 0 if isinstance(tok, _NoTokenizer) else max(map(len, tok.get_vocab()), default=0)
        self.max_prompt_chars = 2 * longest * self.max_model_len if longest else None  # None: ids only
        per_prompt = max(12 * (self.max_prompt_chars or 0), 16 * self.max_model_len)  # ids: "1234567, "
        self.max_body_bytes = 2**20 + per_prompt * (max_num_seqs + max_queued)
        # a call can never hold more prompts than the server takes at once (past that it would be a 503 midway)
        self.max_prompts = max_num_seqs + max_queued
        # every message costs at least one token of the chat template (its role marker), so a chat of more
        # messages than max_model_len cannot fit: refused before the template is rendered
        self.max_messages = self.max_model_len
        self.body_timeout = BODY_TIMEOUT_S

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

    def check_prompt_count(self, count: int) -> None:
        if count > self.max_prompts:
            raise APIError(400, f"prompt holds {count} prompts, more than this server takes in one call: "
                                f"max_num_seqs + max_queued ({self.max_prompts}, --max-num-seqs + "
                                f"--max-queued-requests); send them in several calls", "prompt")

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
        self.check_prompt_count(len(prompts))
        top = self.vocab_size - 1
        for i, one in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(one, str):
                self.check_text_size(len(one), where, "prompt")
                continue
            ids = one["prompt_token_ids"]
            if len(ids) > self.max_model_len:
                raise APIError(400, f"{where} has {len(ids)} token ids, more than max_model_len "
                                    f"({self.max_model_len})", "prompt")
            if self.vocab_size and not all(0 <= t <= top for t in ids):  # before any booking or encoding
                bad = [t for t in ids if not 0 <= t <= top]
                raise APIError(400, f"{where} has token ids {bad[:5]} outside the vocabulary (0..{top})", "prompt")
        return prompts

    def check_text_size(self, chars: int, where: str, param: str) -> None:
        """Refuse text that cannot fit in max_model_len tokens by its length alone, before tokenizing it."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise APIError(400, f"{where} is {chars} characters long: it cannot fit in max_model_len "
                                f"({self.max_model_len}) tokens, and text over {self.max_prompt_chars} characters "
                                f"is refused before it is tokenized", param)

    def with_bad_words(self, req: _Sampling, params: SamplingParams) -> SamplingParams:
        """``params`` with the request's ``bad_words`` as token ids, as vLLM's ``update_from_tokenizer``: each word
        (its leading spaces stripped) tokenized as it is and after a space, the second kept only when it is another
        word token (a different first id, as many ids)."""
        if not req.bad_words:
            return params
        tok = self.tokenizer
        if isinstance(tok, _NoTokenizer):
            raise APIError(400, f"bad_words needs a tokenizer; model {self.model_name!r} has none", "bad_words")
        if len(req.bad_words) > MAX_BAD_WORDS:  # tokenized here, on the event loop: bounded
            raise APIError(400, f"bad_words holds {len(req.bad_words)} words, more than {MAX_BAD_WORDS}", "bad_words")
        ids = []
        for word in req.bad_words:
            if not word.strip():
                raise APIError(400, f"bad_words must hold words, got {json.dumps(word)}", "bad_words")
            if len(word) > MAX_BAD_WORD_CHARS:
                raise APIError(400, f"bad_words entries must be at most {MAX_BAD_WORD_CHARS} characters, got "
                                    f"{len(word)}", "bad_words")
            plain = tok.encode(word.lstrip(), add_special_tokens=False)
            spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
            ids.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                ids.append(spaced)
        return dataclasses.replace(params, bad_words_token_ids=ids)

    def check_allowed_ids(self, params: SamplingParams) -> None:
        """``allowed_token_ids`` inside the vocabulary (vLLM's 400), before any work."""
        ids = params.allowed_token_ids
        if ids is not None and self.vocab_size and any(t >= self.vocab_size for t in ids):
            bad = [t for t in ids if t >= self.vocab_size]
            raise APIError(400, f"allowed_token_ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})",
                           "allowed_token_ids")

    def check_chat(self, req: ChatRequest) -> None:
        """The chat's O(1)-ish checks, on the event loop, before its template is rendered (off it)."""
        if isinstance(self.tokenizer, _NoTokenizer):
            raise APIError(400, f"model {self.model_name!r} has no tokenizer, so no chat template: use "
                                "/v1/completions with token ids", "messages")
        if len(req.messages) > self.max_messages:
            raise APIError(400, f"messages holds {len(req.messages)} messages: a chat of more messages than "
                                f"max_model_len ({self.max_model_len}) cannot fit (each costs at least one token "
                                f"of the chat template)", "messages")
        self.check_text_size(sum(len(m.content) for m in req.messages), "the messages' content", "messages")
        if req.add_generation_prompt and req.continue_final_message:  # vLLM's rule
            raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true",
                           "continue_final_message")
        if req.continue_final_message and req.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message needs the last message to be the assistant's (the "
                                "reply to continue)", "continue_final_message")
        reserved = {"messages", "conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                    "chat_template", "tools", "documents", "return_dict", "return_tensors"}
        clash = sorted(reserved & set(req.chat_template_kwargs or {}))
        if clash:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(clash)} (request fields or the "
                                f"server's own arguments)", "chat_template_kwargs")

    def chat_prompt(self, req: ChatRequest) -> dict:
        """The chat rendered by the model's template and tokenized: slow for a long chat, so the route runs it
        off the event loop (``asyncio.to_thread``), after ``check_chat``."""
        tok = self.tokenizer
        msgs = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message, tokenize=False,
                                           **(req.chat_template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - the template refused the chat (jinja's raise_exception)
            raise APIError(400, f"the model's chat template refused these messages: {type(exc).__name__}: "
                                f"{' '.join(str(exc).split())[:300]}", "messages") from None
        return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}


class _NoTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
                   "stop", "n", "ignore_eos", "allowed_token_ids")


def _param_of(message: str, default: str | None) -> str | None:
    """The request field an engine message is about: the field its (first) problem starts with, or one that
    it names (``n=300 forked samples ...``, ``stop_token_ids [..] are outside ...``)."""
    first = re.sub(r"^(Invalid SamplingParams|Request [^:]*): ", "", message)
    word = re.match(r"\w+", first)
    if word and (word.group() in SAMPLING_FIELDS or word.group() == "priority"):
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


BODY_TIMEOUT_S = 30.0  # the whole body must arrive within this (a trickling client is a 408, its slot freed)


async def _read_body(request: Request, server: Server) -> bytes:
    """The body's bytes: too long (413) or too slow to arrive (408, ``BODY_TIMEOUT_S``) are refused in OpenAI's
    error shape, before anything else is done with it."""
    limit = server.max_body_bytes
    too_long = (f"the request body is over {limit} bytes, more than any request this server can take "
                f"(max_model_len {server.max_model_len}); send a shorter prompt")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(413, too_long, None)
    body = bytearray()

    async def read():
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise APIError(413, too_long, None)

    try:
        await asyncio.wait_for(read(), timeout=server.body_timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {server.body_timeout:g} s "
                            f"({len(body)} bytes came); send it at once", None, "timeout") from None
    return bytes(body)


async def _read_json(request: Request, server: Server) -> dict:
    """The body as a JSON object: too long (413), too slow (408), not UTF-8, not JSON, nested too deeply or not
    an object (400) are refused in OpenAI's error shape, before anything else is done with it."""
    return _json_object(await _read_body(request, server))


def _json_object(body: bytes) -> dict:
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


PARSE_ON_LOOP_BYTES = 64 * 1024  # a larger body is parsed and validated on a worker thread, not the event loop


async def _parse(request: Request, server: Server, model: type[_Sampling]) -> _Sampling:
    body = await _read_body(request, server)

    def parse():
        obj = _json_object(body)
        many = obj.get("prompt")  # counted before validation: a half-million-prompt list is refused at once
        if isinstance(many, list) and many and isinstance(many[0], (list, str)):  # (a list of ints is one prompt)
            server.check_prompt_count(len(many))
        try:
            return model.model_validate(obj)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply", None) from None

    req = parse() if len(body) <= PARSE_ON_LOOP_BYTES else await asyncio.to_thread(parse)
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
        params = server.with_bad_words(req, _params(req, req.max_tokens))
        server.check_allowed_ids(params)
        prompts = server.completion_prompts(req)
        return await _serve(server, request, req, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _parse(request, server, ChatRequest)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = server.with_bad_words(req, _params(req, max_tokens, chat=True))
        server.check_allowed_ids(params)
        server.check_chat(req)
        prompt = await asyncio.to_thread(server.chat_prompt, req)  # a long chat's template: not on the event loop
        return await _serve(server, request, req, [prompt], params, chat=True)

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


class _Heard:
    """A call's events as they come (``events``: (prompt index, ``Event``) pairs, put on the event loop), and the
    first event of each of its requests.

    The call answers (a 200, a stream's first byte) only once each of its requests has sent its first event: a
    token, its end, or a ``Rejection``. ``CoreClient``'s adds are fire-and-forget (vLLM v1's), so the engine core's
    own checks (a prompt that can never fit in the KV cache, a priority under a non-priority policy, a plug-in's
    rule) answer after ``submit`` returned; waiting for that first event keeps a refused request a 400 with the
    engine's message, streaming or not, never a 200 and then an error event. ``EngineLoop`` checks inside ``submit``
    and never rejects later; its requests are waited for the same way, which costs nothing a client sees (a stream's
    first chunk is its first token either way). A call of more prompts than can run at once opens its stream when
    the last of them has its first token."""

    def __init__(self):
        self.events: asyncio.Queue = asyncio.Queue()
        self.first: dict[int, Event] = {}
        self.news = asyncio.Event()

    def put(self, i: int, ev: Event) -> None:
        self.events.put_nowait((i, ev))
        if i not in self.first:
            self.first[i] = ev
            self.news.set()

    def check(self) -> None:
        """Raise what the engine's checks raised for a request of the call that it refused (ValueError, ...)."""
        for ev in self.first.values():
            if isinstance(ev, Rejection):
                raise ev.exception()

    async def accepted(self, count: int, request) -> None:
        """Until each of the call's ``count`` requests has been heard from (``check``: a rejection raises); a client
        that leaves meanwhile is an APIError 499 (looked at every ``DISCONNECT_CHECK_S``)."""
        next_look = time.monotonic() + DISCONNECT_CHECK_S
        while True:
            self.check()
            if len(self.first) >= count:
                return
            self.news.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.news.wait(), timeout=DISCONNECT_CHECK_S)
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + DISCONNECT_CHECK_S
                if await request.is_disconnected():
                    raise APIError(499, "client disconnected")


async def _serve(server: Server, request, req: _Sampling, prompts: list, params: SamplingParams, chat: bool):
    aio = asyncio.get_running_loop()
    heard = _Heard()
    events = heard.events
    kind = "chatcmpl" if chat else "cmpl"
    call_id = server.loop.next_id(kind)
    subs = []
    ok = False
    try:
        next_look = time.monotonic() + DISCONNECT_CHECK_S
        for i, prompt in enumerate(prompts):
            rid = f"{call_id}-{i}"
            deliver = (lambda ev, i=i: aio.call_soon_threadsafe(heard.put, i, ev))
            submitting = asyncio.ensure_future(asyncio.to_thread(
                lambda rid=rid, prompt=prompt, deliver=deliver:
                    server.loop.submit(rid, server.engine_prompt(rid, prompt), params, deliver,
                                       priority=0 if req.priority is None else req.priority)))
            try:
                sub = await asyncio.shield(submitting)
            except asyncio.CancelledError:  # the call was cancelled while its thread submits: abort what it books
                submitting.add_done_callback(
                    lambda t: t.cancelled() or t.exception() is not None or server.loop.abort(t.result().request_id))
                raise
            subs.append(sub)
            heard.check()  # a prompt the engine has refused already: the rest are not submitted
            if len(prompts) > 1 and time.monotonic() >= next_look:  # a client that left stops the rest at once
                next_look = time.monotonic() + DISCONNECT_CHECK_S
                if await request.is_disconnected():
                    raise APIError(499, "client disconnected")
        await heard.accepted(len(subs), request)  # a refusal is a 400 before any answer (_Heard)
        ok = True
    except (ValueError, TypeError, NotImplementedError, OverflowError) as exc:
        raise APIError(400, str(exc), _param_of(str(exc), "messages" if chat else "prompt")) from None
    except Overloaded as exc:
        raise APIError(503, f"server overloaded: {exc}; retry later", None, "server_overloaded") from None
    except ShuttingDown as exc:
        raise APIError(503, str(exc), None, "server_shutting_down") from None
    except EngineDead as exc:
        raise APIError(503, str(exc), None, "engine_dead") from None
    finally:
        if not ok:  # whatever went wrong (a cancelled call too): no request of this call is left running
            _abort(server, subs)
    call = _Call(server, call_id, chat, len(prompts) * params.n, params.n, req.return_token_ids, subs)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        running = bool(usage and req.stream_options.continuous_usage_stats)
        return StreamingResponse(call.stream(events, usage, running), media_type="text/event-stream")
    result = await call.collect(events, request)
    if isinstance(result, APIError):
        return JSONResponse(error_body(result), status_code=result.status)
    return result


DISCONNECT_CHECK_S = 0.25  # how often a call looks for its client having gone (submitting, collecting)


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
        """Wait for every choice; a client that goes away aborts the call's requests (looked at every
        ``DISCONNECT_CHECK_S``, however busy the events are)."""
        next_look = time.monotonic() + DISCONNECT_CHECK_S
        try:
            while len(self.done) < self.num_choices:
                try:
                    i, ev = await asyncio.wait_for(events.get(), timeout=DISCONNECT_CHECK_S)
                    self._take(i, ev)
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + DISCONNECT_CHECK_S
                    if await request.is_disconnected():
                        _abort(self.server, self.subs)
                        return APIError(499, "client disconnected")
        except BaseException:  # cancelled (the server stopping): abort what is left
            _abort(self.server, self.subs)
            raise
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

    def stream(self, events: asyncio.Queue, include_usage: bool, running_usage: bool = False):
        """SSE chunks as tokens settle; closing the stream early (a disconnect) aborts the call. The server's
        stream function (``create_app(stream=...)``; default ``streaming.sse_stream``, stage 8's assignment).
        ``running_usage`` (``stream_options.continuous_usage_stats``): every chunk with choices also carries the
        call's usage so far, added here around the stream function, which stays as stage 8 wrote it."""
        lines = self.server.sse_stream(self, events, include_usage)
        return self._with_running_usage(lines) if running_usage else lines

    async def _with_running_usage(self, lines):
        try:
            async for line in lines:
                yield self._stamp_usage(line)
        finally:  # a disconnect closes this generator: close the inner one so its own ``finally`` aborts
            close = getattr(lines, "aclose", None)
            if close is not None:
                await close()

    def _stamp_usage(self, line: str) -> str:
        """``line`` with ``usage`` set to the call's counts so far (booked by ``_take`` before the chunk was
        made), when it is a chunk with choices and no usage; other lines (errors, ``[DONE]``) as they are."""
        if not line.startswith("data: {"):
            return line
        body = json.loads(line[len("data: "):])
        if not isinstance(body, dict) or not body.get("choices") or body.get("usage") is not None:
            return line
        body["usage"] = self.usage()
        return f"data: {json.dumps(body)}\n\n"


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


# -- slow clients ------------------------------------------------------------------------------------
HEADER_TIMEOUT_S = 10.0  # a request's head (request line and headers) must arrive within this, or the connection
TIMEOUT_KEEP_ALIVE_S = 5  # is closed; an idle kept-alive connection closes after this (uvicorn's and vLLM's 5 s)


def _timed_protocol(header_timeout: float):
    """uvicorn's h11 protocol with a deadline for each request's head: uvicorn closes idle kept-alive connections
    (``timeout_keep_alive``) but waits for ever on a client that trickles its request line and headers a byte at a
    time (each byte resets nothing it watches), so one client can hold any number of connections. The body has its
    own deadline in the app (``BODY_TIMEOUT_S``, a 408)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_head_deadline()  # the next request on this connection, if one starts, has the same deadline

        def _arm_head_deadline(self):
            old = getattr(self, "_head_deadline", None)
            if old is not None:
                old.cancel()
            self._cycle_at_arm = self.cycle
            self._head_deadline = self.loop.call_later(header_timeout, self._head_too_slow)

        def _head_too_slow(self):
            self._head_deadline = None
            waiting = self.cycle is self._cycle_at_arm and (self.cycle is None or self.cycle.response_complete)
            if waiting and not self.transport.is_closing():  # no new request's head came in time
                self.transport.close()

        def connection_lost(self, exc):
            if getattr(self, "_head_deadline", None) is not None:
                self._head_deadline.cancel()
            super().connection_lost(exc)

    return TimedH11Protocol


def uvicorn_config(app, header_timeout: float = HEADER_TIMEOUT_S, timeout_keep_alive: int = TIMEOUT_KEEP_ALIVE_S,
                   **kwargs):
    """uvicorn's config for the app, with the slow-client deadlines (the head's, keep-alive's)."""
    import uvicorn

    return uvicorn.Config(app, http=_timed_protocol(header_timeout), timeout_keep_alive=timeout_keep_alive, **kwargs)


# -- command line -------------------------------------------------------------------------------------
class ServerThread:
    """The app on uvicorn in a background thread, on 127.0.0.1 and a free port (tests, benchmarks,
    notebooks); ``close()`` shuts it down the way Ctrl-C does."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0,
                 header_timeout: float = HEADER_TIMEOUT_S):
        import socket
        import threading

        import uvicorn

        if port == 0:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.app, self.port, self.url = app, port, f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn_config(app, header_timeout, host=host, port=port, log_level="error"))
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


def _terminated(signum, frame):
    raise KeyboardInterrupt("SIGTERM")


DEATH_GRACE_S = 2.0  # after the engine core dies: 503s and error events for this long, then the server exits


def serve(args) -> int:
    import signal
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
    # SIGTERM (a supervisor's stop, ``kill``) is a graceful shutdown exactly as Ctrl-C: uvicorn catches both while
    # it serves and raises the signal again once it has stopped; this handler turns that (and a SIGTERM while the
    # model loads) into the KeyboardInterrupt that Ctrl-C gives, so the exit status is 0, not 143
    previous_term = None
    if threading.current_thread() is threading.main_thread():
        previous_term = signal.signal(signal.SIGTERM, _terminated)
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
        server = uvicorn.Server(uvicorn_config(app, timeout_keep_alive=getattr(args, "timeout_keep_alive",
                                                                                TIMEOUT_KEEP_ALIVE_S),
                                              host=args.host, port=args.port, log_level="warning",
                                              timeout_graceful_shutdown=30))
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the Ctrl-C again once it has shut down
            server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before serving began (while the model loaded)
        logger.info("stopped before serving")
        return 0
    finally:
        sock.close()
        if client is not None:
            client.stop()  # idempotent: no engine core outlives the server
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
    if client is not None and client.dead is not None:
        logger.error("exiting: the engine core process died (%s)", client.dead)
        return 1
    return 0 if server.started else 3  # 3: uvicorn's "startup failed" (the app's lifespan raised, say)
