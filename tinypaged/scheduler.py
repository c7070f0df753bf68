"""Stage 4: who runs in the next step.

Two policies over the same queues and KV managers:

* ``static`` (stages 1-3): form a batch, run it until every member finishes, then form the next.
  A request joins only when the memory it could ever need is guaranteed, so nothing is preempted.
* ``continuous`` (vLLM's iteration-level scheduling): every step is a new batch. Running sequences
  go first (a decode costs one token of the ``max_num_batched_tokens`` budget, a prefill chunk its
  length); waiting requests are admitted, in arrival order, with what is left. When the KV cache
  runs out, the most recently admitted running sequence is preempted (recompute: its blocks are
  freed and it re-queues at the front keeping its generated tokens; or swap: its blocks move to
  CPU memory). A step that preempted admits nothing new.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from tinypaged.block_manager import blocks_needed
from tinypaged.sequence import Sequence, SequenceStatus

logger = logging.getLogger("tinypaged")


def pick_victim(running: list):
    """vLLM v1's preemption victim: the most recently admitted running request (``running`` is kept
    in admission order). It has done the least work, so recomputing it wastes the least."""
    return running[-1]


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int
    kind: str  # "prefill" or "decode"


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config, kv_manager, clock=lambda: float("inf"), swapper=None):
        self.config = config
        self.kv = kv_manager
        self.clock = clock
        self.swapper = swapper  # KVCacheTensors, for preemption_mode="swap"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.static_batch_size = 0  # size of the current static batch (for idle-slot accounting)

    # -- queues ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)

    def _arrived(self, seq: Sequence) -> bool:
        return seq.times.arrival <= self.clock()

    def schedule(self) -> SchedulerOutput:
        if self.config.scheduler == "static":
            return self._schedule_static()
        return self._schedule_continuous()

    # -- continuous batching ---------------------------------------------------------------
    def _schedule_continuous(self) -> SchedulerOutput:
        """vLLM v1's step: running sequences in admission order (preempting from the tail when blocks
        run out), then, if nothing was preempted, waiting ones in queue order with the leftover budget."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                i += 1
                continue
            while not self.kv.allocate_slots(seq, num_new):
                victim = pick_victim(self.running)
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new, "decode" if seq.is_decoding else "prefill"))
                budget -= num_new
                i += 1
        if out.preempted:
            return out  # vLLM: a step that preempted admits nothing new
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._arrived(seq):
                break
            if seq.status is SequenceStatus.SWAPPED:
                if not self.kv.can_swap_in(seq):
                    break
                self.kv.swap_in(seq, self.swapper.copy_to_gpu)
                seq.status = SequenceStatus.WAITING
            computed = self._prefix_hit(seq)
            num_new = seq.num_uncomputed_tokens - self._hit_tokens(computed)
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            kind = "decode" if seq.is_decoding else "prefill"  # a swapped-in sequence resumes decoding
            if not self._allocate(seq, num_new, computed):
                break
            self.waiting.popleft()
            self._start_running(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new, kind))
            budget -= num_new
        return out

    # -- shared helpers ----------------------------------------------------------------------
    def _prefix_hit(self, seq) -> list:
        """Cached blocks holding the start of ``seq`` (paged KV with prefix caching; else none)."""
        return self.kv.get_computed_blocks(seq) if self.kv.kind == "paged" else []

    def _hit_tokens(self, computed) -> int:
        return len(computed) * self.kv.block_size if computed else 0

    def _allocate(self, seq, num_new: int, computed) -> bool:
        """Room for ``num_new`` more tokens after the cached blocks ``computed``. A sequence starting
        from scratch (new, or preempted by recompute) also records its prefix-cache lookup."""
        if self.kv.kind != "paged":
            return self.kv.allocate_slots(seq, num_new)
        fresh = seq.num_computed_tokens == 0
        if not self.kv.allocate_slots(seq, num_new, computed):
            return False
        if fresh:
            seq.num_cached_tokens = self._hit_tokens(computed)
            self.kv.record_prefix_lookup(seq, seq.num_cached_tokens)
        return True

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.times.first_scheduled is None:
            seq.times.first_scheduled = self.clock()
        self.running.append(seq)  # so running is in admission order: the tail is the next victim

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(seq):
            self.kv.swap_out(seq, self.swapper.copy_to_cpu)
            seq.status = SequenceStatus.SWAPPED
            how = "swapped its blocks to CPU memory"
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            how = f"freed its blocks; {len(seq)} tokens will be recomputed"
        self.waiting.appendleft(seq)
        logger.warning("Preempted sequence %d (request %s): %s. Total preemptions: %d",
                       seq.seq_id, seq.request_id, how, self.num_preemptions)

    # -- static batching -------------------------------------------------------------------
    def _form_static_batch(self) -> None:
        """Admit up to ``max_num_seqs`` arrived requests, each only if the memory it could ever need
        (prompt + max_tokens) is guaranteed next to the others': a static batch never preempts."""
        reserved_blocks = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._arrived(seq):
                break
            if self.kv.kind == "paged":
                need = self.kv.blocks_for(seq.max_total_tokens(self.config.max_model_len))
                if reserved_blocks + need > self.kv.num_free_blocks:
                    break
                reserved_blocks += need
            elif not self.kv.allocate_slots(seq, 0):  # contiguous: reserving the region is the test
                break
            self.waiting.popleft()
            self._start_running(seq)
        self.static_batch_size = len(self.running)

    def _schedule_static(self) -> SchedulerOutput:
        """The batch is formed when nothing runs; its members prefill (as the budget allows), then
        decode in lockstep; finished members leave idle slots until the last one is done."""
        out = SchedulerOutput()
        if not self.running:
            self._form_static_batch()
        budget = self.config.max_num_batched_tokens
        prefilling = [s for s in self.running if not s.is_decoding]
        for seq in prefilling or self.running:
            computed = self._prefix_hit(seq)
            num_new = seq.num_uncomputed_tokens - self._hit_tokens(computed)
            if out.scheduled and num_new > budget:
                break  # this prompt prefills next step (the first one always fits: budget >= max_model_len)
            kind = "decode" if seq.is_decoding else "prefill"
            if not self._allocate(seq, num_new, computed):
                raise RuntimeError("static batching reserved memory for this batch, yet allocation failed")
            out.scheduled.append(ScheduledSeq(seq, num_new, kind))
            budget -= num_new
        return out


# -- the policy in miniature (the stage-4 exercise) ----------------------------------------------------
@dataclass
class PlanRequest:
    """A request as the policy sees it: an id and how many tokens it still has to compute
    (the rest of its prompt while prefilling, 1 while decoding)."""

    request_id: str
    num_new_tokens: int


@dataclass
class StepPlan:
    scheduled: list[tuple[str, int]] = field(default_factory=list)  # (request_id, tokens this step)
    preempted: list[str] = field(default_factory=list)


def schedule_step(running: list, waiting: list, budget: int, max_num_seqs: int, kv) -> StepPlan:
    """One continuous-batching step, the rules of ``Scheduler._schedule_continuous`` without prefix
    caching, swapping or arrival times (chunked prefill on).

    ``running`` is in admission order, ``waiting`` in queue order; neither list is modified.
    ``kv.allocate(req, n)`` reserves room for ``n`` more tokens of ``req`` and says whether it
    could; ``kv.free(req)`` releases everything ``req`` holds.

    1. Running requests first, in order: each takes ``min(num_new_tokens, budget)`` tokens. When
       the KV cache cannot hold them, preempt ``pick_victim`` of the running requests (free its
       blocks) and retry; if the victim is the request itself, move on.
    2. Only if nothing was preempted: admit waiting requests in queue order while there is budget
       and fewer than ``max_num_seqs`` are running; stop at the first that does not fit.
    """
    plan = StepPlan()
    running = list(running)
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        n = min(req.num_new_tokens, budget)
        while not kv.allocate(req, n):
            victim = pick_victim(running)
            running.remove(victim)
            kv.free(victim)
            plan.preempted.append(victim.request_id)
            if victim is req:
                break
        else:
            plan.scheduled.append((req.request_id, n))
            budget -= n
            i += 1
    if plan.preempted:
        return plan
    for req in waiting:
        if budget <= 0 or len(running) >= max_num_seqs:
            break
        n = min(req.num_new_tokens, budget)
        if not kv.allocate(req, n):
            break
        running.append(req)
        plan.scheduled.append((req.request_id, n))
        budget -= n
    return plan


class BlockCounter:
    """A KV cache reduced to block counting, for ``schedule_step``: ``num_blocks`` blocks of
    ``block_size`` tokens; ``held`` maps request id -> tokens it holds."""

    def __init__(self, num_blocks: int, block_size: int, held: dict[str, int] | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.held = dict(held or {})
        if self.used > num_blocks:
            raise ValueError("the requests hold more blocks than the cache has")

    def _blocks(self, tokens: int) -> int:
        return blocks_needed(tokens, self.block_size)

    @property
    def used(self) -> int:
        return sum(self._blocks(t) for t in self.held.values())

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.used

    def allocate(self, req, n: int) -> bool:
        have = self.held.get(req.request_id, 0)
        if self._blocks(have + n) - self._blocks(have) > self.num_free:
            return False
        self.held[req.request_id] = have + n
        return True

    def free(self, req) -> None:
        self.held.pop(req.request_id, None)
