"""The engine core: schedule -> execute -> update, token ids in and token ids out (vLLM v1's ``EngineCore``).

    add_requests(reqs) -> [waiting] -> step(): schedule() -> execute(out) -> update(out, logits) -> CoreStep
                                                  (plan)       (block moves,    (advance, sample,
                                                               forward)          token rules)

One core, two ways to reach it: in the same process, ``LLMEngine`` (the offline ``LLM``, the in-process server's
``EngineLoop``, the lab) holds one and calls ``step()``; in its own process, ``EngineCoreProc``
(``entrypoints/engine_core.py``) holds one between two sockets and sends each ``CoreStep``'s ids as messages; the
lab's simulator holds one without a model (``model=False``) and calls its ``schedule`` and ``update`` itself. The
core does no text work: its requests come tokenized, its outputs are token ids and the token rules' finishes (EOS,
stop token ids, length). Text and stop strings are the front end's (``output_processor.py``), which ends a sample
its stop string hits through ``stop_sample``, as vLLM's front end aborts the request in its core.

Owners (see ``tinypaged.interfaces``): the KV manager owns placement, the scheduler owns progress, the runner owns
the device, the sampler owns token choice, ``EngineMetrics`` owns the counters. The core wires them and hands each
the data it needs; none of them calls back into the core (``tests/test_no_upcalls.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tinypaged.attention.selector import make_backend
from tinypaged.config import EngineConfig
from tinypaged.engine.input_processor import Request
from tinypaged.engine.metrics import EngineMetrics
from tinypaged.interfaces import KVCacheSpec
from tinypaged.kv.managers import build_kv_manager
from tinypaged.kv.sizing import size_kv_cache
from tinypaged.model.fused import fuse_projections
from tinypaged.model.loader import eos_token_ids, load_model
from tinypaged.sampling.sampler import sample
from tinypaged.sched.registry import make_scheduler
from tinypaged.sequence import FinishReason
from tinypaged.worker.model_runner import ModelRunner, memory_snapshot

__all__ = ["CoreStep", "EngineCore"]

logger = logging.getLogger("tinypaged")


@dataclass
class CoreStep:
    """What one ``EngineCore.step()`` did, as data (vLLM's ``EngineCoreOutputs``, plus the batch for the lessons).

    ``finished`` lists the requests this step ended, no longer in ``EngineCore.requests``: those the token rules
    ended, in the order of their samples in ``sampled``, then those that failed alone (``failed`` says why).
    ``kv_events`` are the prefix cache's changes in this step (``enable_kv_cache_events``), ``timings`` the seconds
    each phase took ("schedule", "execute", "sample", "update"), ``stats`` the queues and the cache after the step
    (``scheduler_stats``, vLLM's ``SchedulerStats``: the process core sends them with its outputs)."""

    step: int
    scheduled: list  # the scheduler's ScheduledSeq items
    preempted: list
    sampled: list = field(default_factory=list)  # sequences that got a token, in order
    new_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> the token it got
    finished: list[Request] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed
    kv_events: list = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


class EngineCore:
    """Invariants: every request in ``requests`` has its sequences in the scheduler (or finished); ``step`` is
    ``schedule`` -> ``execute`` -> ``update``, each taking the one before's data.

    ``model=False`` builds the same scheduler and KV manager without a model (the lab's simulator,
    ``tinypaged.lab.simulator.ModelFreeEngine``): the cache is sized from the config in tokens (``kv_cache_tokens`` or
    ``num_gpu_blocks_override``), ``execute`` moves no data and runs no forward, and every sampling row's only logit
    is token 0, so each sampled sequence gets token 0 (the trace replays force output lengths with ``ignore_eos``)."""

    def __init__(self, config: EngineConfig, model: bool = True):
        self.config = config
        self._t0 = time.perf_counter()
        self.generator = torch.Generator().manual_seed(config.seed)
        if model:
            spec, backend = self._load(config)
        else:
            config.finalize(config.max_model_len or 2048)
            self.model = self.runner = None
            self.vocab_size, self.eos_token_ids = 1, set()
            s = size_kv_cache(config)  # the engine's sizing; without a model it must be given in tokens
            spec, backend = KVCacheSpec(s.num_blocks, s.block_size, config.max_model_len,
                                        config.enable_prefix_caching, config.reservation_policy), None
        self.kv = build_kv_manager(config, spec, backend)
        if model:
            self.runner.attach(self.kv_tensors, self.kv.block_size)
            if not config.enforce_eager and self.device.type == "cuda":
                self.runner.capture_graphs(config.max_num_seqs, config.max_model_len)  # vLLM's capture at start
        checking = config.has_plugins if config.check_invariants is None else config.check_invariants
        self.scheduler = make_scheduler(config, self.kv, check_invariants=checking, runner_batch=model)
        self.requests: dict[str, Request] = {}
        self.kv_event_sink = None  # set_kv_event_sink: who takes each step's KV events (the publisher)
        self.metrics = EngineMetrics(config.history_size, self.clock)

    def _load(self, config: EngineConfig):
        """The model, its runner and the KV tensors: ``(KVCacheSpec, attention backend)`` for the KV manager."""
        self.device, self.dtype = config.torch_device, config.torch_dtype
        mem_at_start = memory_snapshot(self.device)  # before the weights: sizing counts what we add
        self.model = load_model(config.model, self.dtype, self.device, config.seed)
        fuse_projections(self.model)  # after load_model's .to(): fused weights and views stay one tensor
        config.finalize(self.model.config.max_position_embeddings)
        self.vocab_size = self.model.config.vocab_size
        backend = make_backend(config.attention_backend, config.block_size)
        self.runner = ModelRunner(self.model, self.device, backend)
        self.bytes_per_token = self.runner.bytes_per_token
        # the runner sizes and allocates the cache; the KV manager (built-in or a plug-in) manages it
        self.kv_tensors, spec = self.runner.allocate_kv_cache(config, mem_at_start)
        self.eos_token_ids = set(eos_token_ids(config.model))  # the token rules' (check_stop), and the sampler's
        return spec, backend

    def clock(self) -> float:
        """Seconds since the core started: arrival times and every timestamp of a request are on this clock."""
        return time.perf_counter() - self._t0

    # -- requests --------------------------------------------------------------------------
    def add_requests(self, reqs: list[Request]) -> None:
        """Queue validated requests: all of them, or (an id already in use, or used twice) none. A fanned-out
        request (``parallel_sampling="fanout"``, n > 1) is queued as its children, one sample each."""
        reqs = [r for req in reqs for r in (req.children or [req])]
        seen = set()
        for req in reqs:
            if req.request_id in self.requests or req.request_id in seen:
                raise ValueError(f"Request id {req.request_id!r} is already in use")
            seen.add(req.request_id)
        for req in reqs:
            self.requests[req.request_id] = req
            for seq in req.seqs:
                self.scheduler.add(seq)

    def abort_requests(self, request_ids, reason: FinishReason = FinishReason.ABORT) -> list[Request]:
        """End requests wherever they are, their blocks freed; unknown or finished ids are ignored. Returns the
        requests ended."""
        ended = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.abort(req.seqs, reason)
                ended.append(req)
                if reason is FinishReason.ABORT:
                    self.metrics.record_aborted()
        return ended

    def stop_sample(self, seq, stop: str) -> Request | None:
        """The front end found stop string ``stop`` in ``seq``'s text: ``seq`` finishes (its blocks freed). Returns
        its request when that was its last running sample (the request has ended, and left ``requests``)."""
        self.scheduler.finish_by_stop_string(seq, stop, self.clock())
        req = self.requests.get(seq.request_id)
        if req is None or not req.finished:
            return None
        self.metrics.record_finished()
        return self.requests.pop(seq.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def set_kv_event_sink(self, sink) -> None:
        """``sink(records)`` takes the KV manager's events (``tinypaged.kv.events``) after every step that made some,
        as vLLM v1's scheduler hands its KV cache manager's events to its publisher (``engine/kv_events.py``); None:
        they stay in each ``CoreStep.kv_events`` only."""
        if sink is not None and not callable(getattr(self.kv, "take_events", None)):
            raise ValueError(f"KV events need a KV manager that records them (take_events); "
                             f"{type(self.kv).__name__} has none")
        self.kv_event_sink = sink

    # -- one step ----------------------------------------------------------------------------
    def step(self, select_tokens=None) -> CoreStep:
        """One step: ``schedule`` -> ``execute`` -> ``update``. ``select_tokens(seqs, logits)`` replaces sampling for
        a caller that chooses tokens itself (beam search, from the front end's layer); it then owns their
        progress."""
        t0 = time.perf_counter()
        out = self.schedule()
        t1 = time.perf_counter()
        logits = self.execute(out)
        t2 = time.perf_counter()
        result = self.update(out, logits, select_tokens)
        sampled = result.timings.get("sample", 0.0)
        result.timings = {"schedule": t1 - t0, "execute": t2 - t1, "sample": sampled,
                          "update": time.perf_counter() - t2 - sampled}
        return result

    def schedule(self, now: float | None = None):
        """The scheduler's ``SchedulerOutput`` for the step at ``now`` (default: this core's clock)."""
        return self.scheduler.schedule(self.clock() if now is None else now)

    def execute(self, out) -> torch.Tensor | None:
        """The KV manager's swaps and copy-on-write copies of the step (before any forward, even with nothing to
        run), then the forward: the logits of the chunks that sample, in batch order (None when nothing ran)."""
        if self.runner is None:  # no model: each sampling row's one logit is token 0's
            return torch.zeros(len(sampling_seqs(out)), 1) if out.scheduled else None
        self.runner.move_blocks(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
        if not out.scheduled:
            return None
        logits, _ = self.runner.execute(out.batch)
        return logits

    def update(self, out, logits, select_tokens=None, now: float | None = None) -> CoreStep:
        """After the forward, at ``now`` (default: this core's clock): the scheduled tokens are computed; the
        sequences that reached their end sample (or ``select_tokens`` chooses) and the token rules finish some; the
        step's KV events and stats. Returns the step as a ``CoreStep``."""
        sched = self.scheduler
        result = CoreStep(self.metrics.counters["num_steps"], out.scheduled, out.preempted)
        if out.scheduled:
            sampling = sampling_seqs(out)  # read before advance
            sched.advance(out)
            if sampling and select_tokens is not None:
                select_tokens(sampling, logits)
            elif sampling:
                self._sample_and_update(sampling, logits, result, self.clock() if now is None else now)
            self.metrics.record_step(out, len(result.sampled), sched, self.kv)
        take_events = getattr(self.kv, "take_events", None)
        result.kv_events = take_events() if take_events is not None else []
        if result.kv_events and self.kv_event_sink is not None:
            self.kv_event_sink(result.kv_events)
        result.stats = self.scheduler_stats()
        return result

    def _sample_and_update(self, sampling, logits, result: CoreStep, now: float) -> None:
        sched, t = self.scheduler, time.perf_counter()
        rows, seqs = sched.expand_forks(sampling)
        if len(seqs) > len(sampling):  # children just forked: their requests list them
            parents = {s.seq_id for s in sampling}
            for child in seqs:
                if child.seq_id not in parents:
                    self.requests[child.request_id].seqs.append(child)
        if rows != list(range(logits.shape[0])):  # forks share their parent's row; else each row once, in order
            logits = logits[rows]
        tokens, logprobs, failures = sample(logits, seqs, self.generator, self.eos_token_ids)
        result.timings["sample"] = time.perf_counter() - t
        failed = {seqs[i].request_id: why for i, why in failures.items()}
        if failed:  # those requests fail alone; the rest of the batch carries on
            kept = [i for i, seq in enumerate(seqs) if seq.request_id not in failed]
            seqs, tokens, logprobs = [seqs[i] for i in kept], [tokens[i] for i in kept], [logprobs[i] for i in kept]
        sched.update_from_output(seqs, tokens, logprobs, now, self.eos_token_ids)  # the token rules
        result.sampled, result.new_tokens = seqs, {seq.seq_id: tok for seq, tok in zip(seqs, tokens)}
        for seq in seqs:
            req = self.requests.get(seq.request_id)  # gone if a sibling sample just finished it
            if seq.is_finished and req is not None and req.finished:
                result.finished.append(self.requests.pop(req.request_id))
                self.metrics.record_finished()
        for request_id, why in failed.items():  # the engine cannot go on with these: finish_reason "error"
            req = self.requests[request_id]
            req.error = f"request {request_id} failed: {why}"
            logger.error("%s; the other requests carry on", req.error)
            result.finished += self.abort_requests([request_id], FinishReason.ERROR)
            result.failed[request_id] = req.error
            self.metrics.record_finished()

    def scheduler_stats(self) -> dict:
        """What each step's outputs carry (vLLM's ``SchedulerStats``): queue sizes, cache usage, preemptions and the
        prefix cache's queries and hits so far; O(1), unlike ``get_metrics``'s full snapshot."""
        sched, kv = self.scheduler, self.kv
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "num_swapped": sum(len(g) for g in sched.swapped), "kv_cache_usage": kv.usage,
                "num_preemptions": sched.num_preemptions, "prefix_cache_queries": getattr(kv, "prefix_queries", 0),
                "prefix_cache_hits": getattr(kv, "prefix_hits", 0)}

    def get_metrics(self) -> dict:
        """Counters, queue sizes and the KV manager's statistics (computed on demand)."""
        return self.metrics.snapshot(self.scheduler, self.kv)


def sampling_seqs(out) -> list:
    """The scheduled sequences whose chunk reaches their end (so its last row's logits are sampled), in batch order;
    read before ``Scheduler.advance``."""
    return [item.seq for item in out.scheduled if item.seq.num_computed_tokens + item.num_tokens == len(item.seq)]
