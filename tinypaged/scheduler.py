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

from tinypaged.sequence import Sequence, SequenceStatus

logger = logging.getLogger("tinypaged")


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
                victim = self.running.pop()
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
            computed = self.kv.get_computed_blocks(seq) if self.kv.kind == "paged" else []
            num_new = seq.num_uncomputed_tokens - len(computed) * getattr(self.kv, "block_size", 1)
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not self._allocate(seq, num_new, computed):
                break
            self._admit(seq, num_new, len(computed), out)
            budget -= num_new
        return out

    def _allocate(self, seq, num_new, computed) -> bool:
        if self.kv.kind == "paged":
            return self.kv.allocate_slots(seq, num_new, computed)
        return self.kv.allocate_slots(seq, num_new)

    def _admit(self, seq, num_new, num_hit_blocks, out) -> None:
        if self.kv.kind == "paged" and seq.num_computed_tokens - num_hit_blocks * self.kv.block_size == 0:
            hit = num_hit_blocks * self.kv.block_size
            seq.num_cached_tokens = hit
            self.kv.record_prefix_lookup(seq, hit)
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        if seq.times.first_scheduled is None:
            seq.times.first_scheduled = self.clock()
        self.running.append(seq)
        out.scheduled.append(ScheduledSeq(seq, num_new, "decode" if seq.is_decoding else "prefill"))

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
    def _worst_case_fits(self, seq, reserved_tokens: int) -> bool:
        """Static batching admits a request only if its longest possible length is guaranteed."""
        need = seq.max_total_tokens(self.config.max_model_len)
        if self.kv.kind == "paged":
            used_blocks = self.kv.num_blocks - self.kv.num_free_blocks
            return used_blocks + self.kv.blocks_for(reserved_tokens) + self.kv.blocks_for(need) <= self.kv.num_blocks
        return True  # contiguous: the arena itself reserves the region up front (or refuses)

    def _schedule_static(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.running:
            reserved = 0
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                if not self._arrived(seq) or not self._worst_case_fits(seq, reserved):
                    break
                if self.kv.kind == "contiguous" and not self.kv.allocate_slots(seq, 0):
                    break
                reserved += self.kv.blocks_for(seq.max_total_tokens(self.config.max_model_len)) \
                    * self.kv.block_size if self.kv.kind == "paged" else 0
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                seq.times.first_scheduled = self.clock()
                self.running.append(seq)
            self.static_batch_size = len(self.running)
        budget = self.config.max_num_batched_tokens
        prefilling = [s for s in self.running if not s.is_decoding]
        batch = prefilling or self.running  # the whole batch prefills first, then decodes together
        for seq in batch:
            num_new = seq.num_uncomputed_tokens
            if out.scheduled and num_new > budget:
                break
            computed = self.kv.get_computed_blocks(seq) if self.kv.kind == "paged" else []
            num_new -= len(computed) * getattr(self.kv, "block_size", 1)
            if not self._allocate(seq, num_new, computed):
                raise RuntimeError("static batching reserved memory for this batch, yet allocation failed")
            if self.kv.kind == "paged" and computed is not None and seq.is_decoding is False:
                if seq.num_computed_tokens - len(computed) * self.kv.block_size == 0:
                    seq.num_cached_tokens = len(computed) * self.kv.block_size
                    self.kv.record_prefix_lookup(seq, seq.num_cached_tokens)
            out.scheduled.append(ScheduledSeq(seq, num_new, "decode" if seq.is_decoding else "prefill"))
            budget -= num_new
        return out
