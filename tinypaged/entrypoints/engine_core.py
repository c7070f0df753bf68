"""The engine core in its own process (vLLM v1's ``EngineCoreProc``), and the messages it speaks.

``python -m tinypaged serve`` runs two processes, as ``vllm serve`` does (vLLM v1 today):

* the API server (``server.py`` + ``core_client.py``): HTTP, validation, tokenization, detokenization, stop
  strings, server-sent events;
* the engine core (this module): the ``EngineCore`` (``engine/core.py``, the one the offline ``LLMEngine`` steps
  in-process) in a busy loop that never waits on the server's event loop: take what arrived on the input socket
  (add, abort, stop a sample, metrics, shutdown), run one step (schedule, execute, sample, the token rules: EOS,
  stop token ids, length), send what it produced: new token ids and the token rules' finishes, never text. The
  core gets no stop strings (``Params`` has no ``stop``) and does no text work at all: it has no detokenizer and
  builds no ``LLM``. When a stop string fires in the server, ``StopSample`` frees that sample's blocks here at
  once (vLLM's front end aborts the request in the core; a fan-out child is aborted: ``Abort(stopped=True)``).

Between them two ZeroMQ sockets (the server binds both, the core connects): requests flow in on one,
outputs flow out on the other, each message one ``msgspec.Struct`` encoded as MessagePack. Messages on one
socket keep their order, so an ``Abort`` sent before a ``GetMetrics`` is done before the metrics are read, and a
request's ``Rejected`` comes before any output the core made after it.

Adds are fire-and-forget (vLLM v1's): nothing answers an ``Add`` the core accepts; one its ``InputProcessor``
refuses (a prompt that can never fit in the KV cache, a priority under a non-priority policy, a plug-in's rule)
is answered ``Rejected`` on the output socket, and nothing of it is queued. Every ``Outputs`` carries the
scheduler's stats after it (``EngineCore.scheduler_stats``: queues, KV-cache usage, preemptions, prefix-cache
queries and hits; vLLM's ``SchedulerStats`` with each output batch), and the core sends an ``Outputs`` whenever
they change (an empty one when nothing else is to be said), so the server's gauges are current without asking.

The core watches its parent: when the server process is gone (its parent pid changes) it exits, so a
crashed server leaves no engine behind; it ignores SIGINT (a terminal's Ctrl-C reaches the whole process
group) and SIGTERM, since the server drains first and then sends ``Shutdown``.

Run as ``python -m tinypaged.entrypoints.engine_core CONFIG_JSON`` by ``CoreClient``; not by hand.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Any, Union

import msgspec

from tinypaged.engine.input_processor import InputProcessor, check_max_tokens
from tinypaged.engine.output_processor import OutputProcessor

logger = logging.getLogger("tinypaged")


# -- messages: server -> core ----------------------------------------------------------------------------
class Params(msgspec.Struct):
    """``SamplingParams``' constructor fields (the server has validated them already), less ``stop``: stop
    strings are the server's (``core_client.py``), so the core never searches text."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    max_tokens: int | None
    min_tokens: int
    stop_token_ids: list[int] | None
    ignore_eos: bool
    min_p: float = 0.0
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None


class Add(msgspec.Struct, tag=True):
    request_id: str
    prompt: str | None  # the text, when there is one (the server has tokenized it)
    prompt_token_ids: list[int]
    params: Params
    max_tokens_checked: bool = True  # refuse max_tokens beyond the context (the server's rule, not the LLM's)
    priority: int = 0  # vLLM's request priority (scheduling_policy="priority"), checked by the client first


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]
    stopped: bool = False  # the server's stop strings finished them (fan-out children): their latencies count


class StopSample(msgspec.Struct, tag=True):
    """The server's stop string ended sample ``index`` of a request: free its blocks now (the other samples
    run on). The last unfinished sample ends the request (``Finished``)."""

    request_id: str
    index: int


class GetMetrics(msgspec.Struct, tag=True):
    ticket: int


class Shutdown(msgspec.Struct, tag=True):
    pass


# -- messages: core -> server ----------------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    pid: int
    max_model_len: int
    max_num_seqs: int
    vocab_size: int = 0  # the server checks prompt token ids against it (0: unknown, the engine checks alone)
    parallel_sampling: str = "fork"  # n > 1: "fork" (one request, StopSample) or "fanout" (the server's children)


class StartupFailed(msgspec.Struct, tag=True):
    kind: str  # the exception's class name (ValueError: a bad knob or model)
    message: str


class Rejected(msgspec.Struct, tag=True):
    """The engine's own validation refused an ``Add`` (the only answer an ``Add`` gets); nothing was queued."""

    request_id: str
    kind: str  # ValueError, TypeError or NotImplementedError
    message: str


class Token(msgspec.Struct, array_like=True):
    """One sample's new token id, and the token rule that ended the sample with it, if one did (vLLM's
    ``EngineCoreOutput``: ids and finish reasons, no text)."""

    request_id: str
    index: int
    token_id: int
    finish_reason: str | None = None  # stop (EOS, a stop token id) or length
    stop_reason: int | str | None = None  # the stop token id


class Choice(msgspec.Struct, array_like=True):
    index: int
    finish_reason: str | None
    stop_reason: int | str | None


class Finished(msgspec.Struct, array_like=True):
    request_id: str
    choices: list[Choice]
    error: str | None = None  # a request the engine failed (its step raised, or it failed alone)
    time_to_first_token: float | None = None
    e2e_latency: float | None = None


class Outputs(msgspec.Struct, tag=True):
    """One step's results (or the requests an ``Abort`` / ``StopSample`` ended, or nothing), and the scheduler's
    stats after them (``EngineCore.scheduler_stats``; None only from a sender that has none)."""

    tokens: list[Token]
    finished: list[Finished]
    stats: dict | None = None


class MetricsReply(msgspec.Struct, tag=True):
    ticket: int
    values: dict[str, Any]


ToCore = Union[Add, Abort, StopSample, GetMetrics, Shutdown]
FromCore = Union[Ready, StartupFailed, Rejected, Outputs, MetricsReply]


def params_message(params) -> Params:
    """``params`` as the core takes them: without the stop strings (the server searches them)."""
    return Params(params.n, params.temperature, params.top_p, params.top_k, params.seed, params.max_tokens,
                  params.min_tokens, list(params.stop_token_ids) or None, params.ignore_eos, params.min_p,
                  params.allowed_token_ids, params.bad_words_token_ids)


# -- the core process ------------------------------------------------------------------------------------
class EngineCoreProc:
    """An ``EngineCore`` between two sockets: poll input -> add/abort -> step -> send outputs (token ids). Text is
    the server's, so nothing is decoded here; the requests arrive tokenized and are checked by the engine's own
    ``InputProcessor`` (without a tokenizer) before they are queued."""

    def __init__(self, core, inbox, outbox, parent_pid: int):
        self.engine, self.inbox, self.outbox, self.parent_pid = core, inbox, outbox, parent_pid
        self.input_processor = InputProcessor(core.config, core.vocab_size, core.kv, None, core.clock,
                                              core.eos_token_ids)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ToCore)
        self.live: set[str] = set()  # the server's requests not yet ended
        self.stop_later: set[tuple[str, int]] = set()  # samples to stop once their group is out of swap
        self.sent_stats: dict | None = None  # the scheduler stats the server has last been sent
        self.running = True

    def send(self, msg) -> None:
        """Never blocks for good: a PUSH socket whose peer (the server) has gone would wait forever."""
        import zmq

        data = self.encoder.encode(msg)
        while True:
            try:
                self.outbox.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                self.check_parent()
                self.outbox.poll(100, zmq.POLLOUT)

    def send_outputs(self, tokens: list, finished: list, stats: dict | None = None) -> None:
        """An ``Outputs`` with the scheduler's stats (``stats``, or read now): every one carries them."""
        self.sent_stats = self.engine.scheduler_stats() if stats is None else stats
        self.send(Outputs(tokens, finished, self.sent_stats))

    def check_parent(self) -> None:
        if os.getppid() != self.parent_pid:  # the server is gone: leave no orphan
            logger.error("engine core: the server process is gone; exiting")
            raise SystemExit(0)

    def run_busy_loop(self) -> None:
        import zmq

        engine = self.engine
        while self.running:
            busy = engine.has_unfinished_requests()
            # block (briefly: the parent is checked between polls) only when there is nothing to step
            if self.inbox.poll(0 if busy else 100, zmq.POLLIN):
                while self.running:
                    try:
                        raw = self.inbox.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.handle(self.decoder.decode(raw.buffer))
                stats = engine.scheduler_stats()
                if self.running and stats != self.sent_stats:  # adds, aborts, stops: the server's gauges move now
                    self.send_outputs([], [], stats)
            self.check_parent()
            if self.running and engine.has_unfinished_requests():
                self.step()

    def handle(self, msg) -> None:
        if isinstance(msg, Add):
            self.add(msg)
        elif isinstance(msg, Abort):
            ended = [self.abort(rid, msg.stopped) for rid in msg.request_ids if rid in self.live]
            if ended:
                self.send_outputs([], ended)
        elif isinstance(msg, StopSample):
            ended = self.stop_sample(msg.request_id, msg.index)
            if ended is not None:
                self.send_outputs([], [ended])
        elif isinstance(msg, GetMetrics):
            self.send(MetricsReply(msg.ticket, _plain(self.engine.get_metrics())))
        elif isinstance(msg, Shutdown):
            self.running = False

    def add(self, msg: Add) -> None:
        """Queue the request, or answer ``Rejected`` (the engine's checks); nothing answers an accepted one."""
        from tinypaged.sampling_params import SamplingParams

        try:
            params = SamplingParams(**msgspec.structs.asdict(msg.params))
            prompt = {"prompt_token_ids": msg.prompt_token_ids}
            if msg.prompt is not None:
                prompt["prompt"] = msg.prompt
            req = self.input_processor.make_request(msg.request_id, prompt, params, priority=msg.priority)
            if msg.max_tokens_checked:
                check_max_tokens(params.max_tokens, len(req.prompt_token_ids), self.engine.config.max_model_len)
            self.engine.add_requests([req])
        except (ValueError, TypeError, NotImplementedError) as exc:
            self.send(Rejected(msg.request_id, type(exc).__name__, str(exc)))
            return
        self.live.add(msg.request_id)

    def end(self, request_id: str, choices: list, error=None, metrics=None) -> Finished:
        self.live.discard(request_id)
        self.stop_later = {k for k in self.stop_later if k[0] != request_id}
        return Finished(request_id, choices, error,
                        getattr(metrics, "time_to_first_token", None), getattr(metrics, "e2e_latency", None))

    def abort(self, request_id: str, finished: bool = False) -> Finished:
        """End a live request now (its blocks freed): one ``abort`` choice per sample still running.
        ``finished``: the server's stop string ended its last sample (``StopSample``, ``Abort(stopped=True)``), so its
        latencies are observed."""
        req = self.engine.requests.get(request_id)
        self.engine.abort_requests([request_id])
        if req is None:
            return self.end(request_id, [Choice(0, "abort", None)])
        out = OutputProcessor.request_output(req)
        return self.end(request_id, [Choice(c.index, c.finish_reason, c.stop_reason) for c in out.outputs],
                        metrics=out.metrics if finished else None)

    def stop_sample(self, request_id: str, index: int) -> Finished | None:
        """The server's stop string ended sample ``index``: free its blocks (the scheduler's ``abort``); the
        request ends here when no other sample is left. The server reports the sample's finish itself."""
        req = self.engine.requests.get(request_id)
        if req is None or request_id not in self.live:
            return None
        mine = [s for s in req.seqs if s.index == index and not s.is_finished]
        if not mine:
            return None
        if all(s.is_finished for s in req.seqs if s.index != index) and not req.seqs[0].pending_forks:
            return self.abort(request_id, finished=True)
        sched = self.engine.scheduler
        if any(s in group for group in sched.swapped for s in mine):  # its group is swapped out as one:
            self.stop_later.add((request_id, index))  # stop it once it runs again (see step)
            return None
        sched.abort(mine)
        return None

    def step(self) -> None:
        engine = self.engine
        try:
            result = engine.step()
        except Exception as exc:  # a plug-in broke a rule, say: fail what ran, keep serving the rest
            logger.exception("engine step failed")
            why = f"{type(exc).__name__}: {exc}"
            ids = sorted(self.live)
            engine.abort_requests(ids)
            self.send_outputs([], [self.end(rid, [Choice(0, None, None)], why) for rid in ids])
            return
        tokens = []
        for seq in result.sampled:
            if seq.request_id not in self.live:
                continue
            reason = None if seq.finish_reason is None else str(seq.finish_reason)
            tokens.append(Token(seq.request_id, seq.index, result.new_tokens[seq.seq_id], reason,
                                seq.stop_reason if reason is not None else None))
        finished = []
        for req in result.finished:
            if req.request_id not in self.live:
                continue
            out = OutputProcessor.request_output(req)  # ids, finishes and metrics; its texts stay empty
            choices = [Choice(c.index, c.finish_reason, c.stop_reason) for c in out.outputs]
            finished.append(self.end(out.request_id, choices, out.error, out.metrics))
        stats = result.stats
        for rid, index in sorted(self.stop_later):  # samples whose group was swapped out when they were stopped
            self.stop_later.discard((rid, index))
            ended = self.stop_sample(rid, index)
            if ended is not None:
                finished.append(ended)
            stats = engine.scheduler_stats()
        if tokens or finished or stats != self.sent_stats:
            self.send_outputs(tokens, finished, stats)


def _plain(value):
    """The metrics snapshot as MessagePack can carry it (tuples -> lists, other objects -> str)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel sends SIGKILL when the server dies, even while the model loads (elsewhere the busy loop's
    parent check does it, once the engine is up)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:  # it died before the line above
        raise SystemExit(0)


def main(config_json: str) -> int:
    import zmq

    # the server drains on Ctrl-C or SIGTERM (a terminal's or a supervisor's, sent to the whole process group),
    # then sends Shutdown; the core ends with it (or with its parent: _die_with_parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cfg = json.loads(config_json)
    _die_with_parent(cfg["parent_pid"])
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(cfg["input"])
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(cfg["output"])
    encoder = msgspec.msgpack.Encoder()
    try:
        from types import SimpleNamespace

        from tinypaged.engine.core import EngineCore
        from tinypaged.engine.llm_engine import configure_logging
        from tinypaged.entrypoints.cli_args import attach_kv_events, engine_config

        config, events = engine_config(SimpleNamespace(**cfg["args"]))  # plug-ins are loaded here, by their spec
        if config.torch_device.type == "cpu":  # vLLM's CPU worker binds its threads at start-up (as LLM() does)
            from tinypaged.model.cpu_threads import ensure_cpu_threads

            logger.info("engine core threads: %s", ensure_cpu_threads()[0].describe())
        configure_logging()
        engine = EngineCore(config)  # no text here: the server detokenizes and searches stop strings
        attach_kv_events(engine, events)
    except BaseException as exc:  # noqa: BLE001 - a bad knob, model or plug-in: say it, then exit
        outbox.send(encoder.encode(StartupFailed(type(exc).__name__, str(exc))))
        inbox.close(linger=0)
        outbox.close()  # lingers (2 s at most) until the message is out
        ctx.term()
        return 1
    from tinypaged.model.loader import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(engine.config.model)  # its EOS ids join the token rules (nothing is decoded here)
    if tokenizer is not None:
        engine.eos_token_ids |= eos_token_ids(engine.config.model, tokenizer)
    from tinypaged.model.fused import warm_up

    warm_up(engine.model, engine.config.max_num_seqs)  # as vLLM's server warms its model: weights packed first
    core = EngineCoreProc(engine, inbox, outbox, cfg["parent_pid"])
    core.send(Ready(os.getpid(), engine.config.max_model_len, engine.config.max_num_seqs, engine.vocab_size,
                    engine.config.parallel_sampling))
    try:
        core.run_busy_loop()
    finally:
        inbox.close(linger=0)
        outbox.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
