"""The server's side of the engine core process (vLLM v1's ``AsyncMPClient``).

``CoreClient`` has the interface the server uses from ``EngineLoop`` (``EngineClient`` in ``engine_client.py``:
``submit``, ``abort``, ``drain``, ``stop``, ``num_in_flight``, ``engine_metrics``), so the routes do not know which
one they talk to. It starts ``engine_core.py`` as a child process, binds the two ZeroMQ sockets (``ipc://`` in a
private temporary folder; ``tcp://127.0.0.1`` where there is no ipc), and runs one reader thread that decodes the
core's messages and hands each event to its request's ``deliver`` (as ``EngineLoop``'s thread does). Its parts,
each in its own place (vLLM's multi-process client is cut the same way):

* ``CoreProcess`` and ``CoreChannel`` (``core_proc.py``): the child process's lifecycle (spawn, shut down, never
  an orphan) and the wire (the sockets, the msgspec encoding);
* ``RequestTable`` (``core_requests.py``): the requests in flight, the replies awaited, each request's one end;
* ``ServerOutputs`` (here, with ``SampleText``): the core's outputs to the requests' events; each sample's text
  and stop strings, in this process.

Which process owns what (vLLM v1 today): the engine core schedules, executes, samples and applies the token
rules (EOS, stop token ids, length); it sends token ids and those finishes, never text. This process tokenizes,
detokenizes and decides stop strings (vLLM's ``OutputProcessor`` / ``IncrementalDetokenizer`` in the API
server): each sample gets a ``SampleText`` run by the engine's own ``Detokenizer`` rules (``engine/
detokenizer.py``: stop strings searched in settled text only, the same cut, the same hold-back while streaming),
so text, ``finish_reason`` and ``stop_reason`` are those of the in-process engine. When a stop string fires, the
sample is finished here (``finish_reason="stop"``, ``stop_reason`` the string) and ``StopSample`` frees its
blocks in the core at once; tokens the core made for it meanwhile are dropped.

``n > 1`` runs as the engine's ``parallel_sampling`` says (the core tells it in ``Ready``): ``"fork"`` (the default,
the paper's copy-on-write samples) keeps the ``n`` samples in one request of the core, which ``StopSample`` stops one
at a time; ``"fanout"`` is vLLM v1's ``ParentRequest``: ``submit`` sends ``n`` child requests ``f"{k}_{request_id}"``
(``n=1``, seed ``seed + k``: the in-process engine's samples, token for token) and joins their outputs back into
sample ``k`` (``FanOut`` in ``core_requests.py``); a stop string aborts its child in the core, aborting the parent
aborts every child, the parent ends when all of them have, and a child that fails or is rejected fails it.

* adds are fire-and-forget (vLLM v1's): ``submit`` checks what this process can (the queue bound, ids, numbers the
  wire cannot carry), books the request and sends ``Add``; the core's own checks answer only a refusal,
  ``Rejected``, which ends the request with a ``Rejection`` as its one event (``engine_client.py``), nothing of it
  queued and nothing else disturbed. The usage's prompt tokens are the ones tokenized here;
* every ``Outputs`` carries the scheduler's stats after it; the latest are ``stats`` (the server's gauges), while
  ``engine_metrics`` asks the core for its full snapshot, ordered after everything sent before it;
* the core process dying is noticed within 0.1 s: every open request ends with an error event, new ones are
  refused (``EngineDead``, a 503), and ``on_death`` is called (``serve`` then exits non-zero);
* ``stop`` sends ``Shutdown``, waits for the process, and kills it if it does not go.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from types import SimpleNamespace

from tinypaged.engine.detokenizer import Detokenizer, TextStream
from tinypaged.engine.input_processor import check_priority
from tinypaged.engine.output_processor import settle
from tinypaged.entrypoints import engine_core as msg
from tinypaged.entrypoints.core_proc import CoreChannel, CoreProcess
from tinypaged.entrypoints.core_proc import SOCKET_DIR_PREFIX, remove_stale_socket_dirs  # noqa: F401 - their old home
from tinypaged.entrypoints.core_requests import RequestTable, child_id
from tinypaged.entrypoints.engine_loop import EngineDead, Event, ShuttingDown, Submission
from tinypaged.sequence import FinishReason

logger = logging.getLogger("tinypaged")


class SampleText:
    """One sample's text on the server's side: what ``Detokenizer`` reads and writes of a ``Sequence``."""

    def __init__(self, params):
        self.params = params  # its stop_strings and min_tokens
        self.output_token_ids: list[int] = []
        self.text = ""
        self.stop_search_from = 0
        self.is_finished = False
        self.final: tuple | None = None  # (finish_reason, stop_reason) once it has finished here

    def add_token(self, token_id: int) -> None:
        """The server's copy of the sample's tokens (the core's ``Sequence`` is the scheduler's alone)."""
        self.output_token_ids.append(token_id)


class ServerOutputs:
    """The core's outputs turned into the requests' events, in the server process (vLLM's ``OutputProcessor`` with
    its ``IncrementalDetokenizer`` in the front end).

    Owns the model's tokenizer (loaded once, before the first request) and the engine's ``Detokenizer`` rules run
    on each ``SampleText``; the requests and their samples are the request table's (``RequestTable``: ``live``,
    ``texts``), whose methods end them. Runs on the reader thread only. A sample's text, once it has finished here,
    never changes; a token for a request or sample that has ended is dropped."""

    def __init__(self, model: str, requests: RequestTable):
        self.model, self.requests = model, requests
        self._tokenizer = None
        self.detokenizer = Detokenizer(self._decode)
        self.stream = TextStream(self.detokenizer.stream_text)  # the pieces of text, cut as the engine's loops cut them

    @property
    def tokenizer(self):
        """The model's tokenizer in this process (None for a model without one: token ids only)."""
        if self._tokenizer is None:
            from tinypaged.model.loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.model) or False
        return self._tokenizer or None

    def _decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        """The engine's ``detokenize``: "" without a tokenizer (stop strings never fire)."""
        tok = self.tokenizer
        return "" if tok is None else tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def text_of(self, t) -> tuple[str | None, bool]:
        """Book token ``t`` into its sample's text and decide its stop strings (``output_processor.settle``, as the
        engine does: a stop token beats a stop string, a stop string beats length). Returns the newly settled text
        to send (``TextStream``, as the engine's loops cut it), or None for a token of a sample that has already
        finished here (the core made it before ``StopSample`` arrived), and whether a stop string finished a sample
        the core still runs (send ``StopSample``: free its blocks)."""
        params, samples = self.requests.texts.get(t.request_id, (None, None))
        if samples is None:  # ended meanwhile (the core died, the server stopped)
            return None, False
        s = samples.get(t.index)
        if s is None:
            s = samples[t.index] = SampleText(params)
        if s.is_finished:
            return None, False
        s.add_token(t.token_id)
        stop = settle(self.detokenizer, s, t.finish_reason)  # s.text final if it has finished
        if stop is not None:
            s.is_finished, s.final = True, (str(FinishReason.STOP), stop)
        elif t.finish_reason is not None:
            s.is_finished, s.final = True, (t.finish_reason, t.stop_reason)
        return self.stream.piece(s), stop is not None and t.finish_reason is None

    @staticmethod
    def final_choices(f, samples: dict) -> list:
        """A finished request's choices: a sample finished here by a stop string reports that, not the core's
        abort."""
        choices = []
        for c in f.choices:
            s = samples.get(c.index)
            reason, stop_reason = s.final if s is not None and s.final else (c.finish_reason, c.stop_reason)
            choices.append(msg.Choice(c.index, reason, stop_reason))
        return choices

    def process(self, m: msg.Outputs, obs) -> None:
        """One ``Outputs`` message: each new token's settled text to its request's ``deliver`` (``obs``, the
        server's metrics or None, sees the step, the token gaps and the finishes), then the finished requests'
        final events."""
        now = time.perf_counter()
        kept = []
        for t in m.tokens:
            sub = self.requests.live.get(t.request_id)
            if sub is None:
                continue
            try:
                text, stop_in_core = self.text_of(t)
            except Exception as exc:  # noqa: BLE001 - a decode that raised fails its request, not the reader
                logger.exception("detokenizing request %s failed", t.request_id)
                self.requests.fail(t.request_id, f"detokenization failed: {type(exc).__name__}: {exc}")
                continue
            if stop_in_core:  # a stop string finished a sample the core still runs: free its blocks now
                self.requests.stop_sample(t.request_id, t.index)
            if text is None:
                continue
            kept.append(t)
            if sub.last_token is not None and obs is not None:
                obs.on_token_gap(now - sub.last_token)
            sub.first_token = sub.first_token or now
            sub.last_token = now
            sub.deliver(Event(t.request_id, t.index, text, [t.token_id]))
        if obs is not None and kept:
            obs.on_step(SimpleNamespace(sampled=kept))
        for f in m.finished:
            sub, samples, fan = self.requests.finish(f.request_id, failed=f.error is not None)
            if sub is None:
                continue
            choices = self.final_choices(f, samples)
            if fan is not None:
                self.child_finished(fan, sub, f, choices[0], obs)
                continue
            if obs is not None:
                out = SimpleNamespace(outputs=choices, error=f.error, metrics=SimpleNamespace(
                    time_to_first_token=f.time_to_first_token, e2e_latency=f.e2e_latency))
                obs.on_finish(sub, out)
            for c in choices:
                sub.deliver(Event(f.request_id, c.index, "", [], True, c.finish_reason, c.stop_reason, f.error))


    @staticmethod
    def child_finished(fan, sub, f: msg.Finished, choice: msg.Choice, obs) -> None:
        """Fan-out child ``sub`` has ended (``finish``): its sample's final event, or, if it failed, its parent's error
        (``finish`` has aborted the other children); the observer's ``on_finish`` once the parent has ended."""
        index = fan.child_ids.index(f.request_id)
        if f.error is None:
            fan.record(index, choice, f)
            sub.deliver(Event(f.request_id, 0, "", [], True, choice.finish_reason, choice.stop_reason))
        else:
            fan.sub.deliver(Event(fan.request_id, 0, "", [], True, None, None, f.error))
        if fan.open and f.error is None or obs is None:
            return
        choices = [fan.choices.get(k, msg.Choice(k, None, None)) for k in range(len(fan.child_ids))]
        obs.on_finish(fan.sub, SimpleNamespace(outputs=choices, error=f.error, metrics=SimpleNamespace(
            time_to_first_token=fan.time_to_first_token, e2e_latency=fan.e2e_latency)))


class CoreClient:
    """The engine core in its own process, behind ``EngineClient``'s interface (see the module docstring).

    Owns its parts and is their only user: ``process`` (``CoreProcess``, spawned by ``start``, gone after ``stop``
    or a failed ``start``), ``channel`` (``CoreChannel``: sent on under ``requests.lock``, read by ``start`` and
    then by the reader thread alone), ``requests`` (``RequestTable``) and ``outputs`` (``ServerOutputs``, on the
    reader thread). ``dead`` is set once, by the reader thread, when the process ends unasked; from then on nothing
    is sent and every call that needs the core raises ``EngineDead``. Every request ``submit`` returned ends exactly
    once; after ``stop`` no request is open and no process or socket is left."""

    def __init__(self, args: dict, max_queued: int = 256, observer=None, on_death=None,
                 startup_timeout: float = 900.0):
        """``args``: serve's arguments as JSON values (``cli_args.core_args``; plug-ins as their MODULE:NAME spec)."""
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 0:
            raise ValueError(f"max_queued (--max-queued-requests) must be an integer >= 0, got {max_queued!r}")
        self.args, self.model, self.max_queued = args, args["model"], max_queued
        self.observer, self.on_death, self.startup_timeout = observer, on_death, startup_timeout
        self.max_model_len = self.max_num_seqs = self.vocab_size = 0
        self.parallel_sampling = "fork"  # the engine's (Ready): "fanout" makes n > 1 child requests here
        self.stats: dict | None = None  # the core's scheduler stats after its latest output (None before the first)
        self.dead: str | None = None  # why the core process ended, once it has
        self.process = CoreProcess(args, startup_timeout)
        self.channel = CoreChannel()
        self.requests = RequestTable(self.channel, lambda: self.dead is not None)
        self.outputs = ServerOutputs(self.model, self.requests)
        self._ids = itertools.count()
        self._accepting = True
        self._stopping = False
        self._reader: threading.Thread | None = None

    # -- start-up ------------------------------------------------------------------------------------
    def start(self) -> "CoreClient":
        """Start the core process and wait until its engine is loaded; a bad knob or model is a ValueError
        with the engine's message (the process has exited)."""
        addresses = self.channel.bind()
        try:
            ready = self.process.start(self.channel, *addresses)
        except BaseException:  # the process is gone (CoreProcess.start): close the sockets too
            self.channel.close()
            raise
        self.max_model_len, self.max_num_seqs = ready.max_model_len, ready.max_num_seqs
        self.vocab_size, self.parallel_sampling = ready.vocab_size, ready.parallel_sampling
        self.tokenizer  # noqa: B018 - detokenization is this process's: loaded before the first request
        self._reader = threading.Thread(target=self._read, name="tinypaged-core-client", daemon=True)
        self._reader.start()
        return self

    @property
    def tokenizer(self):
        """The model's tokenizer in this process (None for a model without one: token ids only)."""
        return self.outputs.tokenizer

    @property
    def pid(self) -> int | None:
        return self.process.pid

    # -- the callers' side (any thread) --------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return self.requests.count

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(self, request_id: str, prompt, params, deliver, priority: int = 0) -> Submission:
        """Book one (tokenized) request and send it (fire-and-forget: the core's checks come back as a
        ``Rejection`` event); raises ValueError (a number the wire cannot carry, an id in use), Overloaded,
        ShuttingDown or EngineDead, and then nothing is booked. ``prompt`` is {"prompt_token_ids": [...]} with,
        optionally, its "prompt" text. ``n > 1`` under ``parallel_sampling="fanout"``: ``n`` child requests."""
        self._check_open()
        ids = list(prompt["prompt_token_ids"])
        sub = Submission(request_id, deliver, len(ids), params.n)
        priority = check_priority(priority, None, f"Request {request_id}: priority")  # the core checks the policy
        if params.n > 1 and self.parallel_sampling == "fanout":  # vLLM v1's ParentRequest: child k has seed + k
            children = [(child_id(k, request_id), dataclasses.replace(
                params, n=1, seed=None if params.seed is None else (params.seed + k) % 2**64)) for k in range(params.n)]
        else:
            children = [(request_id, params)]
        # encoded before anything is booked: a value the message cannot carry (an integer beyond 64 bits) is a
        # ValueError here, and no slot is taken
        try:
            adds = [(rid, p, self.channel.encode(msg.Add(rid, prompt.get("prompt"), ids, msg.params_message(p),
                                                         priority=priority))) for rid, p in children]
        except OverflowError as exc:
            raise ValueError(f"Request {request_id}: a number in the request does not fit in 64 bits ({exc})") \
                from None
        self.requests.book(sub, adds, self.max_num_seqs, self.max_queued)
        return sub

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (a fan-out: all its children); the core frees its blocks and ends it (a
        no-op once it has ended)."""
        self.requests.abort(request_id)

    def engine_metrics(self) -> dict:
        """The engine's ``get_metrics()``, read in the core between two steps."""
        if self.dead is not None:
            raise EngineDead(f"the engine core process has died: {self.dead}")
        reply = self.requests.ask_metrics().result(timeout=60)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def drain(self, timeout: float = 30.0) -> bool:
        """Stop taking requests and wait until those in flight have ended."""
        self._accepting = False
        end = time.monotonic() + timeout
        while self.requests.count and self.dead is None and time.monotonic() < end:
            time.sleep(0.02)
        return self.requests.count == 0

    def stop(self) -> None:
        """Shut the core down (it ends what is left) and make sure its process is gone."""
        self._accepting = False
        self._stopping = True
        if self.process.proc is None:
            return
        self.process.shutdown(self._send_shutdown)
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.requests.fail_all("the server is shutting down", FinishReason.ABORT)
        self.channel.close()

    # -- internals -------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.dead is not None:
            raise EngineDead(f"the engine core process has died ({self.dead}); the server is exiting")
        if not self._accepting:
            raise ShuttingDown("the server is shutting down")

    def _send_shutdown(self) -> None:
        with self.requests.lock:  # a ZeroMQ socket is not thread-safe
            self.channel.send(msg.Shutdown())

    def _read(self) -> None:
        """The reader thread: decode the core's messages, deliver events; notice the core dying."""
        while True:
            m = self.channel.receive(100)
            if m is not None:
                self._handle(m)
                continue
            code = self.process.poll()
            if code is not None:
                if not self._stopping:
                    self._died(f"exit status {code}" if code >= 0 else f"killed by signal {-code}")
                return

    def _handle(self, m) -> None:
        if isinstance(m, msg.Outputs):
            if m.stats is not None:  # before the events: a response that has ended finds the gauges moved
                self.stats = m.stats
            self.outputs.process(m, self.observer)
        elif isinstance(m, msg.Rejected):
            self.requests.reject(m)
        elif isinstance(m, msg.MetricsReply):
            self.requests.answer_metrics(m)

    def _died(self, why: str) -> None:
        self.dead = why
        self._accepting = False
        logger.error("the engine core process (pid %s) died: %s; failing %d open request(s)", self.pid, why,
                     self.requests.count)
        self.requests.fail_all(f"the engine core process died ({why})", None)
        if self.on_death is not None:
            self.on_death(why)
