"""One engine, many callers: an ``LLMEngine`` stepped by a single background thread.

A server accepts requests on an asyncio event loop while the engine must run one step at a time.
``EngineLoop`` is the hand-off between the two (vLLM's ``AsyncLLM`` plays this part, with the engine
core in its own process):

* callers ``submit`` requests and ``abort`` them from any thread; the loop thread alone touches the
  engine (queues, KV cache, model), so nothing in the engine needs a lock;
* every submitted request gets exactly one final event: finished, aborted, or failed;
* ``submit`` validates the request (the engine's own checks) before anything is queued, so a bad
  request is refused with the engine's message and nothing else is disturbed;
* past ``max_queued`` requests waiting beyond the ``max_num_seqs`` that can run, ``submit`` raises
  ``Overloaded`` instead of letting the queue grow without bound;
* a step that raises fails the requests it was running (they are aborted, their blocks freed) and
  the loop carries on with the rest.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from tinypaged.engine.detokenizer import TextStream
from tinypaged.sequence import FinishReason

logger = logging.getLogger("tinypaged")


class Overloaded(RuntimeError):
    """More requests are waiting than the configured bound (``max_queued``)."""


class ShuttingDown(RuntimeError):
    """The loop is draining or stopped and takes no new requests."""


class EngineDead(RuntimeError):
    """The engine core process has died (``CoreClient``); the server answers 503 and exits."""


@dataclass
class Event:
    """What one step produced for one sample of a request (the text is the settled delta)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # set on a failed request (the step that ran it raised)


@dataclass
class Submission:
    """The caller's side of one request: events arrive through ``deliver`` (called on the loop thread)."""

    request_id: str
    deliver: Callable[[Event], None]
    num_prompt_tokens: int = 0
    num_samples: int = 1
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    children: list[str] = field(default_factory=list)  # parallel_sampling="fanout": its child requests' ids


class EngineLoop:
    def __init__(self, engine, text_of, max_queued: int = 256, observer=None):
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 0:
            # a negative bound would refuse every request with a 503 (serve's --max-queued-requests)
            raise ValueError(f"max_queued (--max-queued-requests) must be an integer >= 0, got {max_queued!r}")
        self.engine = engine
        self.max_queued = max_queued
        # observer.on_step(result), .on_token_gap(seconds), .on_finish(submission, output): metrics,
        # called on the loop thread
        self.observer = observer
        self.text = TextStream(text_of)  # text_of(seq) -> (text, sendable chars): Detokenizer.stream_text
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Submission] = {}  # request id -> submission, touched on the loop thread only
        self._parent: dict[str, str] = {}  # a fanned-out request's child ids (its samples' request_id) -> its id
        self._count = 0  # submitted and not yet ended (read by submit for the queue bound)
        self._count_lock = threading.Lock()
        self._ids = itertools.count()
        self._accepting = True
        # the server's rule (vLLM's): max_tokens beyond the context after the prompt is refused, not capped
        self.refuse_long_max_tokens = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tinypaged-engine", daemon=True)

    # -- the callers' side (any thread) ----------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def num_in_flight(self) -> int:
        return self._count

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(self, request_id: str, prompt, params, deliver: Callable[[Event], None],
               priority: int = 0) -> Submission:
        """Validate and queue one request; raises ValueError/TypeError (bad request), Overloaded or
        ShuttingDown before anything is queued."""
        if not self._accepting:
            raise ShuttingDown("the server is shutting down")
        with self._count_lock:
            if self._count >= self.engine.config.max_num_seqs + self.max_queued:
                raise Overloaded(f"{self._count} requests are in flight; the queue bound is max_num_seqs "
                                 f"({self.engine.config.max_num_seqs}) + max_queued ({self.max_queued})")
            self._count += 1
        try:
            req = self._call(lambda: self.engine.make_request(request_id, prompt, params, priority=priority))
            if self.refuse_long_max_tokens:
                from tinypaged.engine.input_processor import check_max_tokens

                check_max_tokens(params.max_tokens, len(req.prompt_token_ids), self.engine.config.max_model_len)
        except BaseException:
            self._end_count()
            raise
        sub = Submission(request_id, deliver, len(req.prompt_token_ids), params.n)
        self._inbox.put(("add", (req, sub)))
        return sub

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (a client went away); a no-op once it has ended."""
        self._inbox.put(("abort", request_id))

    def call(self, fn):
        """Run ``fn(engine)`` on the loop thread between steps and return its result (metrics snapshots)."""
        return self._call(lambda: fn(self.engine))

    def engine_metrics(self) -> dict:
        """The engine's ``get_metrics()``, read between two steps (``/metrics``)."""
        return self.call(lambda engine: engine.get_metrics())

    def drain(self, timeout: float = 30.0) -> bool:
        """Stop taking requests and wait until those in flight have ended."""
        self._accepting = False
        end = time.monotonic() + timeout
        while self._count and time.monotonic() < end:
            time.sleep(0.02)
        return self._count == 0

    def stop(self) -> None:
        self._accepting = False
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=10)

    # -- the loop thread ------------------------------------------------------------------------------
    def _call(self, fn):
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return fn()
        fut: Future = Future()
        self._inbox.put(("call", (fn, fut)))
        return fut.result()

    def _end_count(self) -> None:
        with self._count_lock:
            self._count -= 1

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._handle_inbox(block=not engine.has_unfinished_requests())
            if self._stop.is_set():
                break
            if not engine.has_unfinished_requests():
                continue
            try:
                result = engine.step()
            except Exception as exc:  # a plug-in broke a rule, say: fail what ran, keep serving the rest
                logger.exception("engine step failed")
                self._fail_all(f"{type(exc).__name__}: {exc}")
                continue
            if self.observer is not None:
                self.observer.on_step(result)
            self._dispatch(result)
        for rid in list(self._live):
            self._end(rid, Event(rid, 0, "", [], True, FinishReason.ABORT), abort=True)

    def _handle_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                req, sub = payload
                try:
                    self.engine.enqueue(req)
                    self._live[req.request_id] = sub
                    sub.children = [child.request_id for child in req.children]
                    self._parent.update((child, req.request_id) for child in sub.children)
                except Exception as exc:  # e.g. an id already in use
                    self._end_count()
                    sub.deliver(Event(req.request_id, 0, "", [], True, None, error=str(exc)))
            elif kind == "abort":
                if payload in self._live:
                    self._end(payload, Event(payload, 0, "", [], True, FinishReason.ABORT), abort=True)
            elif kind == "call":
                fn, fut = payload
                try:
                    fut.set_result(fn())
                except BaseException as exc:
                    fut.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, result) -> None:
        now = time.perf_counter()
        for seq in result.sampled:
            rid = self._parent.get(seq.request_id, seq.request_id)  # a child's sample k is its parent's sample k
            sub = self._live.get(rid)
            if sub is None:
                continue
            text = self.text.piece(seq)
            if sub.last_token is not None and self.observer is not None:
                self.observer.on_token_gap(now - sub.last_token)
            sub.first_token = sub.first_token or now
            sub.last_token = now
            sub.deliver(Event(rid, seq.index, text, [result.new_tokens[seq.seq_id]]))
        for out in result.finished:
            sub = self._live.get(out.request_id)
            if sub is None:
                continue
            if self.observer is not None:
                self.observer.on_finish(sub, out)
            last = None
            for c in out.outputs:
                # a request the engine failed alone (out.error) ends its own stream with an error only
                last = Event(out.request_id, c.index, "", [], True, c.finish_reason, c.stop_reason, out.error)
                if c is not out.outputs[-1]:
                    sub.deliver(last)
            self._end(out.request_id, last, abort=False)

    def _end(self, request_id: str, final: Event, abort: bool) -> None:
        sub = self._live.pop(request_id)
        for child in sub.children:
            self._parent.pop(child, None)
        if abort:
            self.engine.abort_request([request_id])
            if self.observer is not None and hasattr(self.observer, "on_abort"):
                self.observer.on_abort(sub)  # /metrics: finished_reason="abort"
        self._end_count()
        sub.deliver(final)

    def _fail_all(self, message: str) -> None:
        self._parent.clear()
        for rid in list(self._live):
            sub = self._live.pop(rid)
            self.engine.abort_request([rid])
            self._end_count()
            sub.deliver(Event(rid, 0, "", [], True, None, error=message))
