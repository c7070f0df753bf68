"""Server-sent events: the stream that turns one HTTP call's engine outputs into ``data: ...`` lines.

Stage 8's assignment (``solutions/08_serve_over_http.ipynb``) has the learner write :func:`sse_stream`; the server
(``tinypaged.entrypoints.server``, ``_Call.stream``) serves whatever function ``create_app(..., stream=...)`` was
given, this one by default, so a learner's version serves real HTTP traffic.

The wire format is OpenAI's (and vLLM's ``OpenAIServingCompletion.completion_stream_generator``): one
``data: {json}\\n\\n`` line per chunk, a chat stream opens with a chunk that gives every choice its ``role``, a
failure is one ``data: {"error": ...}`` line, ``stream_options.include_usage`` adds a last chunk with empty
``choices`` and the token counts, and ``data: [DONE]`` ends the stream. A client that hangs up closes the
generator (uvicorn cancels it, or ``aclose()``): its ``finally`` aborts the call's unfinished requests, once, so the
engine frees their KV blocks at once, as vLLM's server aborts a request whose client went away.

What ``sse_stream`` gets from the server:

* ``call``: the HTTP call (``server._Call``): ``call.chat``, ``call.num_choices`` (prompts x ``n``), ``call.done`` (the
  set of finished choices), ``call.error`` (set once an event carried an error), ``call._take(prompt_idx, ev)``
  (books one event into the call and returns its choice index), ``call.piece(choice, ev)`` (the choice's part of a
  chunk for that event), ``call.usage()``, ``call.subs`` (one submission per prompt: ``.request_id``) and
  ``call.server.loop.abort(request_id)``;
* ``events``: an ``asyncio.Queue`` of ``(prompt_idx, Event)`` pairs, as the engine settles tokens;
* ``include_usage``: whether to send the usage chunk.
"""

from __future__ import annotations

import json

DONE = "data: [DONE]\n\n"


def sse_line(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def chunk(call, choices: list, usage=None) -> dict:
    """A streamed chunk's body: OpenAI's ``text_completion`` or ``chat.completion.chunk`` object."""
    return {"id": call.id, "object": "chat.completion.chunk" if call.chat else "text_completion",
            "created": call.created, "model": call.server.model_name, "choices": choices, "usage": usage}


def role_piece(choice: int) -> dict:
    """A chat stream's first piece for one choice: its role, no content yet."""
    return {"index": choice, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def error_event(message: str) -> dict:
    """The stream's error event, in OpenAI's error shape (the stream has already answered 200)."""
    return {"error": {"message": f"the engine failed: {message}", "type": "internal_error", "param": None,
                      "code": 500}}


async def sse_stream(call, events, include_usage):
    """The call's server-sent events, in order; closing the stream early (a disconnect) aborts the call."""
    try:
        if call.chat:
            yield sse_line(chunk(call, [role_piece(c) for c in range(call.num_choices)]))
        while len(call.done) < call.num_choices:
            prompt_idx, ev = await events.get()
            was_done = set(call.done)
            c = call._take(prompt_idx, ev)
            if call.error is not None:
                yield sse_line(error_event(call.error))
                break
            # a chunk when something settled, or when a choice finishes (its finish_reason), once per choice
            if ev.text or ev.token_ids or (ev.finished and c not in was_done):
                yield sse_line(chunk(call, [call.piece(c, ev)]))
        if include_usage and call.error is None:
            yield sse_line(chunk(call, [], call.usage()))
        yield DONE
    finally:
        if len(call.done) < call.num_choices:
            for sub in call.subs:
                call.server.loop.abort(sub.request_id)
