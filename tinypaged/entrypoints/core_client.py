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
blocks in the core at once; tokens the core made for it meanwhile are dropped. For ``n > 1`` vLLM's front end
fans a request out into ``n`` child requests (seeds ``seed + index``) so one sample can stop alone; here the
engine keeps the ``n`` samples in one request (``parallel_sampling="fork"`` shares the prompt's blocks, the
samples' seeds are already ``seed + index``), so the core is told to stop one sample instead.

* ``submit`` sends ``Add`` and waits for ``Added`` or ``Rejected`` (the engine's own checks), so a bad request
  is refused before it is queued and nothing else is disturbed;
* the core process dying is noticed within 0.1 s: every open request ends with an error event, new ones are
  refused (``EngineDead``, a 503), and ``on_death`` is called (``serve`` then exits non-zero);
* ``stop`` sends ``Shutdown``, waits for the process, and kills it if it does not go.
"""

from __future__ import annotations

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
from tinypaged.entrypoints.core_requests import RequestTable
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
                self.requests.send_if_live(msg.StopSample(t.request_id, t.index))
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
            sub, samples = self.requests.finish(f.request_id)
            if sub is None:
                continue
            choices = self.final_choices(f, samples)
            if obs is not None:
                out = SimpleNamespace(outputs=choices, error=f.error, metrics=SimpleNamespace(
                    time_to_first_token=f.time_to_first_token, e2e_latency=f.e2e_latency))
                obs.on_finish(sub, out)
            for c in choices:
                sub.deliver(Event(f.request_id, c.index, "", [], True, c.finish_reason, c.stop_reason, f.error))


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
        self.vocab_size = ready.vocab_size
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
        """Send one (tokenized) request and wait for the core's verdict; raises ValueError/TypeError/
        NotImplementedError (the engine's checks), Overloaded, ShuttingDown or EngineDead before anything is
        queued. ``prompt`` is {"prompt_token_ids": [...]} with, optionally, its "prompt" text."""
        self._check_open()
        sub = Submission(request_id, deliver, 0, params.n)
        # encoded before anything is booked: a value the message cannot carry (an integer beyond 64 bits) is a
        # ValueError here, and no slot is taken
        priority = check_priority(priority, None, f"Request {request_id}: priority")  # the core checks the policy
        try:
            data = self.channel.encode(msg.Add(request_id, prompt.get("prompt"), list(prompt["prompt_token_ids"]),
                                               msg.params_message(params), priority=priority))
        except OverflowError as exc:
            raise ValueError(f"Request {request_id}: a number in the request does not fit in 64 bits ({exc})") \
                from None
        verdict = self.requests.book(request_id, sub, params, data, self.max_num_seqs, self.max_queued).result()
        if isinstance(verdict, msg.Rejected):
            raise {"TypeError": TypeError, "NotImplementedError": NotImplementedError}.get(
                verdict.kind, ValueError)(verdict.message)
        if isinstance(verdict, BaseException):
            raise verdict
        sub.num_prompt_tokens = verdict.num_prompt_tokens
        return sub

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; the core frees its blocks and ends it (a no-op once it has ended)."""
        self.requests.send_if_live(msg.Abort([request_id]), request_id)

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
            self.outputs.process(m, self.observer)
        elif isinstance(m, (msg.Added, msg.Rejected)):
            self.requests.settle(m)
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
