"""The engine: requests in, one scheduled step at a time, outputs out.

    add_request() -> [waiting] -> step(): schedule -> run the model -> sample -> update progress -> outputs

``step()`` is public so notebooks and tools can watch the engine work one iteration at a time.
The engine only wires the parts together; each piece of state has one owner (see
``tinypaged.interfaces`` and docs/ARCHITECTURE.md): the input processor validates and builds
requests, the KV manager owns placement, the scheduler owns progress, the runner owns the device,
the sampler owns token choice and the token stop rules, the detokenizer owns text and stop
strings, the output processor builds outputs, and ``EngineMetrics`` owns the counters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from functools import partial

import torch

from tinypaged.attention.selector import make_backend
from tinypaged.config import EngineConfig
from tinypaged.engine.detokenizer import Detokenizer
from tinypaged.model.fused import fuse_projections
from tinypaged.engine.input_processor import InputProcessor, Request, sample_generator
from tinypaged.interfaces import POLICY_REQUIRED, require
from tinypaged.kv.managers import build_kv_manager
from tinypaged.engine.metrics import EngineMetrics
from tinypaged.model.loader import eos_token_ids, load_model, load_tokenizer
from tinypaged.worker.model_runner import ModelRunner, memory_snapshot
from tinypaged.engine.output_processor import OutputProcessor
from tinypaged.outputs import StepResult
from tinypaged.sampling.sampler import check_stop, sample
from tinypaged.sampling_params import SamplingParams
from tinypaged.sched.scheduler import Scheduler, make_policy
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


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True):
        """``detokenize=False``: the front end owns text and stop strings (the engine core process, whose server
        detokenizes), so the output processor has no detokenizer and every ``text`` stays empty."""
        configure_logging()
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        mem_at_start = memory_snapshot(self.device)  # before the weights: sizing counts what we add
        self.model = load_model(config.model, self.dtype, self.device, config.seed)
        fuse_projections(self.model)  # after load_model's .to(): fused weights and views stay one tensor
        hf = self.model.config
        config.finalize(hf.max_position_embeddings)
        self.vocab_size = hf.vocab_size
        self._tokenizer = None
        self.generator = torch.Generator().manual_seed(config.seed)
        checking = config.has_plugins if config.check_invariants is None else config.check_invariants
        backend = make_backend(config.attention_backend, config.block_size)
        self.runner = ModelRunner(self.model, self.device, backend)
        self.bytes_per_token = self.runner.bytes_per_token
        # the runner sizes and allocates the cache; the KV manager (built-in or a plug-in) manages it
        self.kv_tensors, spec = self.runner.allocate_kv_cache(config, mem_at_start)
        self.kv = build_kv_manager(config, spec, backend)
        self.runner.attach(self.kv_tensors, self.kv.block_size)
        if not config.enforce_eager and self.device.type == "cuda":
            self.runner.capture_graphs(config.max_num_seqs, config.max_model_len)  # vLLM's capture at start
        policy = make_policy(config)
        if not hasattr(policy, "plan"):  # a plan policy decides; any other acts through schedule(scheduler)
            require(policy, POLICY_REQUIRED, "scheduler_cls")
        self.scheduler = Scheduler(config, self.kv, policy, clock=self.clock,
                                   check_invariants=checking)
        self.input_processor = InputProcessor(config, self.vocab_size, self.kv,
                                              lambda text: self.tokenizer.encode(text), self.clock,
                                              lambda: self.eos_token_ids)
        self._eos_token_ids = set(eos_token_ids(config.model))  # the token rules' (check_stop), and the sampler's
        self.output_processor = OutputProcessor(Detokenizer(self.detokenize) if detokenize else None)  # text, stops
        self.requests: dict[str, Request] = {}
        self.kv_event_sink = None  # set_kv_event_sink: where each step's KV events go
        self._t0 = time.perf_counter()
        self.metrics = EngineMetrics(config.history_size, self.clock)

    # -- tokenizer -------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.model)
            if self._tokenizer is None:
                raise ValueError(f"Model {self.config.model!r} ships no tokenizer: pass prompts as "
                                 f"{{'prompt_token_ids': [...]}} and read token_ids from the outputs")
            self.eos_token_ids |= eos_token_ids(self.config.model, self._tokenizer)
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
        """The model's end-of-sequence ids (the tokenizer's join when it loads); the token rules read them."""
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self._eos_token_ids = set(ids)

    @property
    def detokenizer(self) -> Detokenizer | None:
        return self.output_processor.detokenizer

    def clock(self) -> float:
        return time.perf_counter() - self._t0

    # -- requests --------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                     arrival_time: float | None = None, priority: int = 0) -> Request:
        """Tokenize and validate one request without queueing it (generate() checks all first)."""
        return self.input_processor.make_request(request_id, prompt, params, arrival_time, priority)

    def enqueue(self, reqs: Request | list[Request]) -> None:
        """Queue built requests: all of them, or (an id already in use, or used twice) none."""
        reqs = [reqs] if isinstance(reqs, Request) else list(reqs)
        seen = set()
        for req in reqs:
            if req.request_id in self.requests or req.request_id in seen:
                raise ValueError(f"Request id {req.request_id!r} is already in use")
            seen.add(req.request_id)
        for req in reqs:
            self.requests[req.request_id] = req
            for seq in req.seqs:
                self.scheduler.add(seq)

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
            if req is not None:
                self._end_request(req, FinishReason.ABORT)
                self.metrics.record_aborted()

    def _end_request(self, req: Request, reason: FinishReason) -> None:
        """Finish every unfinished sequence of ``req`` with ``reason``, its text final, its blocks freed."""
        for seq in req.seqs:
            if not seq.is_finished:
                self.output_processor.finish(seq)
        self.scheduler.abort(req.seqs, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one iteration -----------------------------------------------------------------------
    def set_kv_event_sink(self, sink) -> None:
        """``sink(records)`` receives the KV manager's events (``tinypaged.kv.events``) after every step that
        made some, as vLLM v1's scheduler hands its KV cache manager's events to the publisher; None stops it."""
        if sink is not None and not callable(getattr(self.kv, "take_events", None)):
            raise ValueError(f"KV events need a KV manager that records them (take_events); "
                             f"{type(self.kv).__name__} has none")
        self.kv_event_sink = sink

    def step(self, select_tokens=None) -> StepResult:
        """Schedule, run the model, sample, update progress. ``select_tokens(seqs, logits)`` replaces
        sampling for callers that choose tokens themselves (beam search); it then owns their progress.
        Then the step's KV events, if anyone takes them."""
        try:
            return self._step(select_tokens)
        finally:
            if self.kv_event_sink is not None:
                events = self.kv.take_events()
                if events:
                    self.kv_event_sink(events)

    def _step(self, select_tokens) -> StepResult:
        sched = self.scheduler
        out = sched.schedule()
        # the KV manager's swaps and copy-on-write copies of this step, before any forward (even with nothing to run)
        self.runner.move_blocks(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        result = StepResult(self.metrics.counters["num_steps"], out.scheduled, {}, out.preempted, [])
        if not out.scheduled:
            return result
        logits, _ = self.runner.execute(out.batch)  # rows of the chunks that sample, in batch order
        sampling = [item.seq for item, chunk in zip(out.scheduled, out.batch) if chunk.samples]
        sched.advance(out)
        if sampling and select_tokens is not None:
            select_tokens(sampling, logits)
        elif sampling:
            rows, seqs = sched.expand_forks(sampling, self._fork_generator)
            if len(seqs) > len(sampling):  # children just forked: their requests list them
                parents = {s.seq_id for s in sampling}
                for child in seqs:
                    if child.seq_id not in parents:
                        self.requests[child.request_id].seqs.append(child)
            if rows != list(range(logits.shape[0])):  # forks share their parent's row; else each row once, in order
                logits = logits[rows]
            tokens, logprobs, failures = sample(logits, seqs, self.generator, self.eos_token_ids)
            failed = {seqs[i].request_id: why for i, why in failures.items()}
            if failed:  # those requests fail alone; the rest of the batch carries on
                kept = [i for i, seq in enumerate(seqs) if seq.request_id not in failed]
                seqs, tokens, logprobs = [seqs[i] for i in kept], [tokens[i] for i in kept], [logprobs[i] for i in kept]
            now = self.clock()
            token_rules = partial(check_stop, eos_token_ids=self.eos_token_ids, max_model_len=self.config.max_model_len)
            sched.update_from_output(seqs, tokens, logprobs, now, token_rules)  # EOS, stop token ids, length
            for seq, stop in self.output_processor.process(seqs):  # text and stop strings, after the step
                sched.finish_by_stop_string(seq, stop, now)  # a stop string ends its sequence (vLLM: an abort)
            done = [seq for seq in seqs if seq.is_finished]
            result.new_tokens = {seq.seq_id: tok for seq, tok in zip(seqs, tokens)}
            result.sampled = seqs
            for seq in done:
                req = self.requests.get(seq.request_id)  # gone if a sibling sample just finished it
                if req is not None and req.finished:
                    result.finished.append(self.output_processor.request_output(self.requests.pop(req.request_id)))
                    self.metrics.record_finished()
            for request_id, why in failed.items():
                result.finished.append(self._fail_request(request_id, why))
        self.metrics.record_step(out, len(result.sampled), sched, self.kv)
        return result

    def _fail_request(self, request_id: str, why: str):
        """End one request the engine cannot go on with (``finish_reason="error"``, the reason in its
        output's ``error``); the other requests of the step are untouched."""
        req = self.requests.pop(request_id)
        req.error = f"request {request_id} failed: {why}"
        logger.error("%s; the other requests carry on", req.error)
        self._end_request(req, FinishReason.ERROR)
        self.metrics.record_finished()
        return self.output_processor.request_output(req)

    def _fork_generator(self, parent, k: int):
        """parallel_sampling="fork": child ``k``'s generator, seeded from its request's seed."""
        return sample_generator(self.requests[parent.request_id].params.seed, k)

    # -- the one loop to completion ------------------------------------------------------------
    def run_until_done(self, request_ids=(), until=None, select_tokens=None,
                       wait_until=None) -> Iterator[StepResult]:
        """The one loop that drives the engine to completion (``LLM.generate`` and its stream, beam
        search, the lab's replays): step until every request of ``request_ids`` has finished (or until
        ``until()`` is true), yielding each ``StepResult``. A step that scheduled nothing waits for the
        next arrival before it is yielded (``wait_until(clock, t)``; default: sleeps of at most 50 ms).
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
                    _wait_for_arrival(self, sorted(pending), wait_until)
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
        return self.metrics.snapshot(self.scheduler, self.kv)


def _wait_for_arrival(engine: LLMEngine, pending: list, wait_until) -> None:
    """A step ran nothing: wait for the next arrival (``wait_until(clock, t)``, or sleeps of at most 50 ms);
    with nothing left in any queue, the pending requests were dropped and the engine would wait forever."""
    if not engine.has_unfinished_requests():
        raise RuntimeError(f"requests {pending} left every queue unfinished (a plug-in dropped them?); "
                           f"the engine would wait forever")
    waiting = engine.scheduler.waiting
    if not waiting:
        return
    arrival = waiting[0].times.arrival
    if wait_until is not None:
        wait_until(engine.clock, arrival)
    elif arrival > engine.clock():
        time.sleep(min(arrival - engine.clock(), 0.05))
