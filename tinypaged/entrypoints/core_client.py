"""The server's side of the engine core process (vLLM v1's ``AsyncMPClient``).

``CoreClient`` has the interface the server uses from ``EngineLoop`` (``submit``, ``abort``, ``drain``,
``stop``, ``num_in_flight``, ``engine_metrics``), so the routes do not know which one they talk to. It
starts ``engine_core.py`` as a child process, binds the two ZeroMQ sockets (``ipc://`` in a private temporary
folder; ``tcp://127.0.0.1`` where there is no ipc), and runs one reader thread that decodes the core's
messages and hands each event to its request's ``deliver`` (as ``EngineLoop``'s thread does).

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
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import msgspec

from tinypaged.engine.detokenizer import Detokenizer
from tinypaged.engine.input_processor import check_priority
from tinypaged.entrypoints import engine_core as msg
from tinypaged.entrypoints.engine_loop import EngineDead, Event, Overloaded, ShuttingDown, Submission
from tinypaged.sequence import FinishReason

logger = logging.getLogger("tinypaged")


SOCKET_DIR_PREFIX = "tinypaged-core-"  # + the server's pid + "-" + random: the ipc sockets' private folder


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_socket_dirs(root: str | None = None) -> list[str]:
    """Remove the socket folders (``tinypaged-core-<pid>-*`` in the temporary folder) of servers that were killed
    outright (SIGKILL leaves them): only this user's, and only those whose owner pid is dead. Returns them."""
    import re
    import shutil

    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = re.fullmatch(re.escape(SOCKET_DIR_PREFIX) + r"(\d+)-[\w]+", name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        import stat

        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or _pid_alive(int(m.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class SampleText:
    """One sample's text on the server's side: what ``Detokenizer`` reads and writes of a ``Sequence``."""

    def __init__(self, params):
        self.params = params  # its stop_strings and min_tokens
        self.output_token_ids: list[int] = []
        self.text = ""
        self.stop_search_from = 0
        self.is_finished = False
        self.sent = 0  # characters already delivered
        self.final: tuple | None = None  # (finish_reason, stop_reason) once it has finished here

    def add_token(self, token_id: int) -> None:
        """The server's copy of the sample's tokens (the core's ``Sequence`` is the scheduler's alone)."""
        self.output_token_ids.append(token_id)


class CoreClient:
    def __init__(self, args: dict, max_queued: int = 256, observer=None, on_death=None,
                 startup_timeout: float = 900.0):
        """``args``: serve's arguments as JSON values (``cli_args.core_args``; plug-ins as their MODULE:NAME spec)."""
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 0:
            raise ValueError(f"max_queued (--max-queued-requests) must be an integer >= 0, got {max_queued!r}")
        self.args, self.model, self.max_queued = args, args["model"], max_queued
        self.observer, self.on_death, self.startup_timeout = observer, on_death, startup_timeout
        self.proc: subprocess.Popen | None = None
        self.max_model_len = self.max_num_seqs = self.vocab_size = 0
        self.dead: str | None = None  # why the core process ended, once it has
        self._live: dict[str, Submission] = {}
        self._lock = threading.Lock()  # guards _live, _count, _pending and the input socket
        self._count = 0
        self._pending: dict[object, Future] = {}  # request id / metrics ticket -> its reply
        self._ids = itertools.count()
        self._tickets = itertools.count()
        self._accepting = True
        self._stopping = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(msg.FromCore)
        self._reader: threading.Thread | None = None
        self._texts: dict[str, tuple] = {}  # request id -> (its params, {sample index: SampleText}); reader thread
        self._tokenizer = None
        self.detokenizer = Detokenizer(self._decode)

    # -- start-up ------------------------------------------------------------------------------------
    def start(self) -> "CoreClient":
        """Start the core process and wait until its engine is loaded; a bad knob or model is a ValueError
        with the engine's message (the process has exited)."""
        import zmq

        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)  # to the core
        self._out = self._ctx.socket(zmq.PULL)  # from the core
        self._in.setsockopt(zmq.LINGER, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._dir = None
        if sys.platform == "win32":
            in_addr = f"tcp://127.0.0.1:{self._in.bind_to_random_port('tcp://127.0.0.1')}"
            out_addr = f"tcp://127.0.0.1:{self._out.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            remove_stale_socket_dirs()
            # mode 0700: ours alone; the name holds this process's id, so a later server can tell a dead one's
            self._dir = tempfile.TemporaryDirectory(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
            in_addr, out_addr = f"ipc://{self._dir.name}/in", f"ipc://{self._dir.name}/out"
            self._in.bind(in_addr)
            self._out.bind(out_addr)
        config = {"args": self.args, "input": in_addr, "output": out_addr,
                  "parent_pid": os.getpid()}
        self.proc = subprocess.Popen([sys.executable, "-m", "tinypaged.entrypoints.engine_core", json.dumps(config)])
        deadline = time.monotonic() + self.startup_timeout
        try:
            while True:
                if self._out.poll(100):
                    first = self._decoder.decode(self._out.recv())
                    break
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the engine core process exited with {self.proc.returncode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine core did not start within {self.startup_timeout:.0f} s")
        except BaseException:  # Ctrl-C while the model loads, too: no engine core is left behind
            self._kill()
            self._close_sockets()
            raise
        if isinstance(first, msg.StartupFailed):
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._kill()
            self._close_sockets()
            if first.kind in ("ValueError", "TypeError", "NotImplementedError", "FileNotFoundError"):
                raise ValueError(first.message)  # the knob's own message (serve prints it, exits 2)
            raise RuntimeError(f"the engine core failed to start: {first.kind}: {first.message}")
        self.max_model_len, self.max_num_seqs = first.max_model_len, first.max_num_seqs
        self.vocab_size = first.vocab_size
        self.tokenizer  # noqa: B018 - detokenization is this process's: loaded before the first request
        self._reader = threading.Thread(target=self._read, name="tinypaged-core-client", daemon=True)
        self._reader.start()
        return self

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

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    # -- the callers' side (any thread) --------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return self._count

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(self, request_id: str, prompt, params, deliver, priority: int = 0) -> Submission:
        """Send one (tokenized) request and wait for the core's verdict; raises ValueError/TypeError/
        NotImplementedError (the engine's checks), Overloaded, ShuttingDown or EngineDead before anything is
        queued. ``prompt`` is {"prompt_token_ids": [...]} with, optionally, its "prompt" text."""
        self._check_open()
        sub = Submission(request_id, deliver, 0, params.n)
        fut: Future = Future()
        # encoded before anything is booked: a value the message cannot carry (an integer beyond 64 bits) is a
        # ValueError here, and no slot is taken
        priority = check_priority(priority, None, f"Request {request_id}: priority")  # the core checks the policy
        try:
            data = self._encoder.encode(msg.Add(request_id, prompt.get("prompt"), list(prompt["prompt_token_ids"]),
                                                msg.params_message(params), priority=priority))
        except OverflowError as exc:
            raise ValueError(f"Request {request_id}: a number in the request does not fit in 64 bits ({exc})") \
                from None
        with self._lock:
            if self._count >= self.max_num_seqs + self.max_queued:
                raise Overloaded(f"{self._count} requests are in flight; the queue bound is max_num_seqs "
                                 f"({self.max_num_seqs}) + max_queued ({self.max_queued})")
            if request_id in self._live or request_id in self._pending:
                raise ValueError(f"Request id {request_id!r} is already in use")
            self._count += 1
            self._live[request_id] = sub
            self._texts[request_id] = (params, {})
            self._pending[request_id] = fut
            try:
                self._in.send(data, copy=False)
            except BaseException:  # nothing was sent: unbook, so no failure can leak a slot
                self._count -= 1
                self._live.pop(request_id, None)
                self._texts.pop(request_id, None)
                self._pending.pop(request_id, None)
                raise
        verdict = fut.result()
        if isinstance(verdict, msg.Rejected):
            raise {"TypeError": TypeError, "NotImplementedError": NotImplementedError}.get(
                verdict.kind, ValueError)(verdict.message)
        if isinstance(verdict, BaseException):
            raise verdict
        sub.num_prompt_tokens = verdict.num_prompt_tokens
        return sub

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; the core frees its blocks and ends it (a no-op once it has ended)."""
        with self._lock:
            if self.dead is None and request_id in self._live:
                self._send(msg.Abort([request_id]))

    def engine_metrics(self) -> dict:
        """The engine's ``get_metrics()``, read in the core between two steps."""
        if self.dead is not None:
            raise EngineDead(f"the engine core process has died: {self.dead}")
        fut: Future = Future()
        with self._lock:
            ticket = ("metrics", next(self._tickets))
            self._pending[ticket] = fut
            self._send(msg.GetMetrics(ticket[1]))
        reply = fut.result(timeout=60)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def drain(self, timeout: float = 30.0) -> bool:
        """Stop taking requests and wait until those in flight have ended."""
        self._accepting = False
        end = time.monotonic() + timeout
        while self._count and self.dead is None and time.monotonic() < end:
            time.sleep(0.02)
        return self._count == 0

    def stop(self) -> None:
        """Shut the core down (it ends what is left) and make sure its process is gone."""
        self._accepting = False
        self._stopping = True
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with self._lock:
                try:
                    self._send(msg.Shutdown())
                except Exception:  # noqa: BLE001 - the socket is closing: kill below
                    pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._fail_all("the server is shutting down", FinishReason.ABORT)
        self._close_sockets()

    # -- internals -------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.dead is not None:
            raise EngineDead(f"the engine core process has died ({self.dead}); the server is exiting")
        if not self._accepting:
            raise ShuttingDown("the server is shutting down")

    def _send(self, message) -> None:  # under self._lock: a ZeroMQ socket is not thread-safe
        self._in.send(self._encoder.encode(message), copy=False)

    def _read(self) -> None:
        """The reader thread: decode the core's messages, deliver events; notice the core dying."""
        while True:
            if self._out.poll(100):
                self._handle(self._decoder.decode(self._out.recv()))
                continue
            code = self.proc.poll()
            if code is not None:
                if not self._stopping:
                    self._died(f"exit status {code}" if code >= 0 else f"killed by signal {-code}")
                return

    def _text_of(self, t) -> str | None:
        """Book token ``t`` into its sample's text (the engine's ``OutputProcessor.stop_check`` order: a stop
        token beats a stop string, a stop string beats length); the newly settled text to send, or None for a
        token of a sample that has already finished here (the core made it before ``StopSample`` arrived)."""
        params, samples = self._texts.get(t.request_id, (None, None))
        if samples is None:  # ended meanwhile (the core died, the server stopped)
            return None
        s = samples.get(t.index)
        if s is None:
            s = samples[t.index] = SampleText(params)
        if s.is_finished:
            return None
        s.add_token(t.token_id)
        stop = None
        if t.finish_reason is None or t.finish_reason == str(FinishReason.LENGTH):
            stop = self.detokenizer.find_stop_string(s)  # cuts s.text at the stop string
        if stop is not None:
            s.is_finished, s.final = True, (str(FinishReason.STOP), stop)
            if t.finish_reason is None:  # still running in the core: free its blocks now
                with self._lock:
                    if self.dead is None:
                        self._send(msg.StopSample(t.request_id, t.index))
        elif t.finish_reason is not None:
            self.detokenizer.finish(s)
            s.is_finished, s.final = True, (t.finish_reason, t.stop_reason)
        text, settled = self.detokenizer.stream_text(s)
        start = s.sent
        s.sent = max(start, settled)
        return text[start:s.sent]

    def _handle(self, m) -> None:
        if isinstance(m, msg.Outputs):
            now = time.perf_counter()
            obs = self.observer
            kept = []
            for t in m.tokens:
                sub = self._live.get(t.request_id)
                if sub is None:
                    continue
                try:
                    text = self._text_of(t)
                except Exception as exc:  # noqa: BLE001 - a decode that raised fails its request, not the reader
                    logger.exception("detokenizing request %s failed", t.request_id)
                    self._fail_request(t.request_id, f"detokenization failed: {type(exc).__name__}: {exc}")
                    continue
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
                with self._lock:
                    sub = self._live.pop(f.request_id, None)
                    if sub is not None:
                        self._count -= 1
                    _, samples = self._texts.pop(f.request_id, (None, {}))
                if sub is None:
                    continue
                choices = []
                for c in f.choices:  # a sample finished here by a stop string reports that, not the core's abort
                    s = samples.get(c.index)
                    reason, stop_reason = s.final if s is not None and s.final else (c.finish_reason, c.stop_reason)
                    choices.append(msg.Choice(c.index, reason, stop_reason))
                if obs is not None:
                    out = SimpleNamespace(outputs=choices, error=f.error, metrics=SimpleNamespace(
                        time_to_first_token=f.time_to_first_token, e2e_latency=f.e2e_latency))
                    obs.on_finish(sub, out)
                for c in choices:
                    sub.deliver(Event(f.request_id, c.index, "", [], True, c.finish_reason, c.stop_reason, f.error))
        elif isinstance(m, (msg.Added, msg.Rejected)):
            with self._lock:
                fut = self._pending.pop(m.request_id, None)
                if isinstance(m, msg.Rejected) and self._live.pop(m.request_id, None) is not None:
                    self._count -= 1
                    self._texts.pop(m.request_id, None)
            if fut is not None:
                fut.set_result(m)
        elif isinstance(m, msg.MetricsReply):
            with self._lock:
                fut = self._pending.pop(("metrics", m.ticket), None)
            if fut is not None:
                fut.set_result(m.values)

    def _fail_request(self, request_id: str, why: str) -> None:
        """End one request here with an error event and abort it in the core (its blocks freed)."""
        with self._lock:
            sub = self._live.pop(request_id, None)
            self._texts.pop(request_id, None)
            if sub is None:
                return
            self._count -= 1
            if self.dead is None:
                self._send(msg.Abort([request_id]))
        sub.deliver(Event(request_id, 0, "", [], True, None, None, why))

    def _died(self, why: str) -> None:
        self.dead = why
        self._accepting = False
        logger.error("the engine core process (pid %s) died: %s; failing %d open request(s)", self.pid, why,
                     self._count)
        self._fail_all(f"the engine core process died ({why})", None)
        if self.on_death is not None:
            self.on_death(why)

    def _fail_all(self, message: str, reason) -> None:
        with self._lock:
            live, self._live, self._count, self._texts = self._live, {}, 0, {}
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_result(EngineDead(message))
        for rid, sub in live.items():
            if rid in pending:  # its submit raises instead
                continue
            error = None if reason == FinishReason.ABORT else message
            sub.deliver(Event(rid, 0, "", [], True, reason, None, error))

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def _close_sockets(self) -> None:
        if self._ctx.closed:
            return
        for sock in (self._in, self._out):
            sock.close(linger=0)
        self._ctx.term()
        if self._dir is not None:
            self._dir.cleanup()
