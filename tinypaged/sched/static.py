"""Static batching (``scheduler_cls="static"``; course-only, the pre-Orca baseline of stage 1 and stage 4).

A scheduler of its own, next to the continuous one: when nothing runs, a batch is formed; its members prefill (as
the token budget allows), then decode in lockstep; a member that finishes leaves an idle slot until the last one is
done. A request joins only when the memory it could ever need is guaranteed beside the others', so nothing is ever
preempted. It keeps the queues, the progress and the checks of ``Scheduler`` and replaces only ``form_step``.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

from tinypaged.interfaces import InvariantError
from tinypaged.kv.block_pool import blocks_needed
from tinypaged.sched.output import ScheduledSeq, SchedulerOutput
from tinypaged.sched.policies import PlanRequest, schedule_step
from tinypaged.sched.scheduler import Scheduler


class StaticScheduler(Scheduler):
    """Static batching. ``batch_size`` is the batch's size when it was formed (its idle slots are counted against
    it); the waiting order is arrival (``scheduling_policy="fcfs"``, the only one it takes)."""

    batch_size = 0

    def form_batch(self) -> None:
        """Admit arrived requests with ``schedule_step``'s own admission loop (first come, first served; stop at the
        first that does not fit), nothing running, no token budget, and a ``kv`` that grants a request only when its
        sequences (forks to come included) fit ``max_num_seqs`` and the memory it could ever need is guaranteed
        beside the others' (``_Reservations``)."""
        arrived = (_Member(s.request_id, s.num_uncomputed_tokens, 1 + s.pending_forks, s)
                   for s in itertools.takewhile(self.arrived, self.waiting))
        plan = schedule_step([], arrived, sys.maxsize, self.config.max_num_seqs, _Reservations(self))
        for member, _ in plan.scheduled:
            self.admit(member.seq)
        self.batch_size = len(self.running)

    def form_step(self) -> SchedulerOutput:
        """Prefill the batch's prompts (whole, as many as the budget takes; the first always fits: the budget is at
        least ``max_model_len``), then decode every member."""
        out = SchedulerOutput()
        if not self.running:
            self.form_batch()
        budget = self.config.max_num_batched_tokens
        prefilling = [s for s in self.running if not s.is_decoding]
        for seq in prefilling or list(self.running):
            computed = self.prefix_hit(seq)
            num_new = seq.num_uncomputed_tokens - self.hit_tokens(computed)
            if out.scheduled and num_new > budget:
                break  # this prompt prefills next step
            if not self.allocate(seq, num_new, computed):
                raise InvariantError("static batching reserved memory for this batch, yet allocation failed")
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        out.num_idle_slots = max(self.batch_size - len(out.scheduled), 0)
        return out


@dataclass(eq=False)
class _Member(PlanRequest):
    """A waiting sequence as static batching's admission sees it."""

    seq: object = None


class _Reservations:
    """The ``kv`` with which static batching runs ``schedule_step``'s admission: ``allocate`` grants a request only if
    its sequences fit ``max_num_seqs`` beside those admitted and its lifetime need (its ``max_tokens_needed``, in
    whole blocks, for each sequence) fits the free memory beside theirs; a contiguous manager reserves it then
    (``allocate_slots(seq, 0)``)."""

    def __init__(self, sched):
        kv = sched.kv
        self.kv, self.max_num_seqs = kv, sched.config.max_num_seqs
        self.free_tokens = round((1.0 - kv.usage) * kv.capacity_tokens)
        self.seats = sched.num_running_seqs()

    def allocate(self, req: _Member, n: int) -> bool:
        kv = self.kv
        if self.seats + req.num_seqs > self.max_num_seqs:
            return False
        need = blocks_needed(kv.max_tokens_needed(req.seq), kv.block_size) * kv.block_size * req.num_seqs
        if need > self.free_tokens or not kv.allocate_slots(req.seq, 0):  # a contiguous manager reserves here
            return False
        self.free_tokens -= need
        self.seats += req.num_seqs
        return True

    def free(self, req) -> None:
        raise InvariantError("static batching never preempts: nothing runs while a batch is formed")
