"""The front end of one engine: requests in, one step at a time, outputs out (vLLM v1's ``LLMEngine``).

    add_request() -> input processor -> EngineCore.step(): schedule -> execute -> update -> output processor -> outputs

``LLMEngine`` owns text: the input processor validates and tokenizes a request, the ``EngineCore`` (``core.py``)
steps it in token ids, and the output processor brings each sample's text up to date, searches its stop strings
(a hit ends that sample in the core: ``EngineCore.stop_sample``) and builds the ``RequestOutput`` of each request
that ended. ``step()`` is public so notebooks and tools can watch the engine work one iteration at a time; the
core's parts (``model``, ``runner``, ``kv``, ``scheduler``, ``requests``, ``metrics``) are read through it, and
owned there (see ``tinypaged.interfaces`` and docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from tinypaged.config import EngineConfig
from tinypaged.engine.core import EngineCore
from tinypaged.engine.detokenizer import Detokenizer
from tinypaged.engine.input_processor import InputProcessor, Request
from tinypaged.engine.output_processor import OutputProcessor
from tinypaged.model.loader import eos_token_ids, load_tokenizer
from tinypaged.outputs import StepResult
from tinypaged.sampling_params import SamplingParams
from tinypaged.sequence import FinishReason

__all__ = ["LLMEngine", "Request", "StepResult", "configure_logging"]

logger = logging.getLogger("tinypaged")


def configure_logging() -> None:
    """Like vLLM: INFO lines on stderr (stdout stays for the user's own output). Done once, when the
    first engine is built, so importing tinypaged changes no logging set-up."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s tinypaged: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _core_part(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.core, name), doc=f"The core's {doc} (``EngineCore.{name}``).")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        configure_logging()
        self.config = config
        self.core = EngineCore(config)
        self._tokenizer = None
        self.input_processor = InputProcessor(config, self.core.vocab_size, self.core.kv,
                                              lambda text: self.tokenizer.encode(text), self.core.clock,
                                              self.core.eos_token_ids)
        self.output_processor = OutputProcessor(Detokenizer(self.detokenize))  # text and stop strings
        self.requests: dict[str, Request] = {}  # the callers' unfinished requests (a fanned-out one: the parent)
        self.parent_of: dict[str, Request] = {}  # a child's id in the core -> its parent (vLLM's ParentRequest)

    model = _core_part("model", "model")
    runner = _core_part("runner", "model runner (the device, the KV tensors)")
    kv = _core_part("kv", "KV cache manager")
    scheduler = _core_part("scheduler", "scheduler")
    metrics = _core_part("metrics", "counters and step history")
    device, dtype = _core_part("device", "torch device"), _core_part("dtype", "torch dtype")
    vocab_size = _core_part("vocab_size", "vocabulary size")
    kv_tensors = _core_part("kv_tensors", "KV cache tensors")
    bytes_per_token = _core_part("bytes_per_token", "KV bytes per token")
    generator = _core_part("generator", "sampling generator of unseeded requests")

    def clock(self) -> float:
        return self.core.clock()

    # -- tokenizer -------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.model)
            if self._tokenizer is None:
                raise ValueError(f"Model {self.config.model!r} ships no tokenizer: pass prompts as "
                                 f"{{'prompt_token_ids': [...]}} and read token_ids from the outputs")
            self.eos_token_ids = self.eos_token_ids | eos_token_ids(self.config.model, self._tokenizer)
        return self._tokenizer

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (empty for a model without a tokenizer)."""
        try:
            tok = self.tokenizer
        except ValueError:
            return ""
        return tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_ids(self) -> set[int]:
        """The model's end-of-sequence ids (the tokenizer's join when it loads); the core's token rules read them."""
        return self.core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.core.eos_token_ids = self.input_processor.eos_token_ids = set(ids)  # the token rules' and min_tokens'


    @property
    def detokenizer(self) -> Detokenizer:
        return self.output_processor.detokenizer

    # -- requests --------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                     arrival_time: float | None = None, priority: int = 0) -> Request:
        """Tokenize and validate one request without queueing it (generate() checks all first)."""
        return self.input_processor.make_request(request_id, prompt, params, arrival_time, priority)

    def enqueue(self, reqs: Request | list[Request]) -> None:
        """Queue built requests: all of them, or (an id already in use, or used twice) none."""
        reqs = [reqs] if isinstance(reqs, Request) else list(reqs)
        taken = [r.request_id for r in reqs if r.request_id in self.requests]
        if taken:
            raise ValueError(f"Request id {taken[0]!r} is already in use")
        self.core.add_requests(reqs)
        for req in reqs:
            self.requests[req.request_id] = req
            self.parent_of.update((child.request_id, req) for child in req.children)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue one request; a bad one raises and nothing already running is affected."""
        self.enqueue(self.make_request(request_id, prompt, params, arrival_time, priority))

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are (vLLM's ``LLMEngine.abort_request``): their blocks are freed
        and they leave every queue; unknown or finished ids are ignored. Their sequences finish with
        ``finish_reason="abort"`` and the text of the tokens they had (``LLM.generate`` returns them so)."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(isinstance(r, str) for r in ids):
            raise TypeError(f"abort_request takes a request id (a string) or a list of them, got {request_ids!r}; "
                            f"request ids are strings (RequestOutput.request_id)")
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.is_finished:
                    self.output_processor.finish(seq)  # its text is final
            for child in req.children:
                self.parent_of.pop(child.request_id, None)
            self.core.abort_requests([child.request_id for child in req.children] or [rid])

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def set_kv_event_sink(self, sink) -> None:
        """Where each step's KV events go (``EngineCore.set_kv_event_sink``)."""
        self.core.set_kv_event_sink(sink)

    # -- one iteration -----------------------------------------------------------------------
    def step(self, select_tokens=None) -> StepResult:
        """One core step (schedule, run the model, sample, the token rules), then text and stop strings.
        ``select_tokens(seqs, logits)`` replaces sampling for callers that choose tokens themselves (beam
        search); it then owns their progress."""
        core = self.core.step(select_tokens)
        first = {}  # each caller's request -> the place of its first sample in the step
        for i, seq in enumerate(core.sampled):
            first.setdefault(self.parent_of.get(seq.request_id, seq).request_id, i)
        ended = list(core.finished)
        for seq, stop in self.output_processor.process(core.sampled):  # text and stop strings, after the step
            req = self.core.stop_sample(seq, stop)  # a stop string ends its sample (vLLM: an abort in the core)
            if req is not None:
                ended.append(req)
        done = {}  # the callers' requests that ended, by id
        for req in ended:
            parent = self.parent_of.pop(req.request_id, req)
            if req.error is not None:  # it failed: so does its parent, and the samples still running with it
                parent.error = req.error
                self.core.abort_requests([c.request_id for c in parent.children if c.request_id in self.core.requests],
                                         FinishReason.ERROR)
                for seq in parent.seqs:  # the samples a failure ended keep the text of the tokens they had
                    if seq.finish_reason is FinishReason.ERROR:
                        self.output_processor.finish(seq)
            if parent.finished and self.requests.pop(parent.request_id, None) is not None:
                done[parent.request_id] = parent
                for child in parent.children:
                    self.parent_of.pop(child.request_id, None)
        order = sorted(done.values(), key=lambda r: (r.error is not None, first.get(r.request_id, len(first))))
        return StepResult(core.step, core.scheduled, core.new_tokens, core.preempted,
                          [self.output_processor.request_output(req) for req in order], core.sampled, core.timings,
                          core.stats)

    # -- the one loop to completion ------------------------------------------------------------
    def run_until_done(self, request_ids=(), until=None, select_tokens=None,
                       spin_wait: float = 0.0) -> Iterator[StepResult]:
        """The one loop that drives the engine to completion (``LLM.generate`` and its stream, beam
        search, the lab's replays): step until every request of ``request_ids`` has finished (or until
        ``until()`` is true), yielding each ``StepResult``. A step that scheduled nothing waits for the
        next arrival before it is yielded (sleeps of at most 50 ms; with ``spin_wait`` the whole wait, its last
        ``spin_wait`` seconds spun: a sleep can overshoot by a millisecond, which the lab's timed replays avoid).
        A request aborted by hand since the previous step (from the caller, between steps) is reported
        in the next step's ``finished``, with ``finish_reason="abort"`` and the tokens it had. If the
        caller stops early (an exception, KeyboardInterrupt, a generator closed), the requests still
        pending are aborted: their blocks are freed and the next call computes only its own tokens."""
        pending = {rid: self.requests[rid] for rid in request_ids}
        done = until if until is not None else (lambda: not pending)
        try:
            while not done():
                step = self.step(select_tokens)
                for out in step.finished:
                    pending.pop(out.request_id, None)
                aborted = [rid for rid in pending if rid not in self.requests]  # by hand, since the last step
                step.finished += [self.output_processor.request_output(pending.pop(rid)) for rid in aborted]
                if not step.scheduled and not done():
                    _wait_for_arrival(self, sorted(pending), spin_wait)
                yield step
        finally:
            if pending:
                self.abort_request(list(pending))

    # -- metrics: EngineMetrics owns the counters --------------------------------------------
    @property
    def counters(self) -> dict:
        return self.metrics.counters

    @property
    def history(self):
        return self.metrics.history

    def get_metrics(self) -> dict:
        """Counters, queue sizes and the KV manager's statistics (computed on demand)."""
        return self.core.get_metrics()


def _wait_for_arrival(engine: LLMEngine, pending: list, spin: float) -> None:
    """A step ran nothing: wait for the next arrival (sleeps of at most 50 ms; with ``spin``, until it arrives,
    waking ``spin`` seconds early and spinning); with nothing left in any queue, the pending requests were dropped
    and the engine would wait forever."""
    if not engine.has_unfinished_requests():
        raise RuntimeError(f"requests {pending} left every queue unfinished (a plug-in dropped them?); "
                           f"the engine would wait forever")
    waiting = engine.scheduler.waiting
    if not waiting:
        return
    arrival = waiting[0].times.arrival
    if spin:
        if arrival - engine.clock() > spin:
            time.sleep(arrival - engine.clock() - spin)
        while engine.clock() < arrival:
            pass
    elif arrival > engine.clock():
        time.sleep(min(arrival - engine.clock(), 0.05))
