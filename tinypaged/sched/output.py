"""What the scheduler hands the model runner and the engine for one step (vLLM v1: ``sched/output.py``).

The scheduler produces one ``SchedulerOutput`` per step; the runner reads it to build the forward,
the engine to advance progress, count tokens and report the step. Nobody changes it after
``Scheduler.schedule`` has checked it (``check_schedule``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinypaged.sequence import Sequence


@dataclass
class ScheduledSeq:
    """One sequence in this step's batch: ``num_tokens`` of its tokens run through the model, from
    position ``seq.num_computed_tokens`` (read before ``Scheduler.advance``).

    Invariants (checked by ``check_schedule``): the sequence is running; ``1 <= num_tokens <=
    seq.num_uncomputed_tokens``. ``is_prefill`` is taken from the sequence when it is scheduled, so
    it stays right after ``advance``: False exactly for a decode (one new token whose predecessor is
    cached), True for a prompt chunk or a recompute.
    """

    seq: Sequence
    num_tokens: int
    is_prefill: bool = field(init=False)

    def __post_init__(self):
        self.is_prefill = not self.seq.is_decoding


@dataclass
class SchedulerOutput:
    """One step's batch.

    Invariants: a sequence appears in ``scheduled`` at most once; ``num_batched_tokens <=
    max_num_batched_tokens``; ``preempted`` lists the sequences preempted while this step was formed
    (recompute or swap), none of which is in ``scheduled``; ``num_idle_slots`` counts a static
    batch's members that have finished but still hold a batch slot (0 under continuous batching).
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_idle_slots: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if not s.is_prefill)
