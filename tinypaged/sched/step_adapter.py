"""Stage 4's plan adapter: the one place a ``schedule_step``-shaped plan meets the real queues and KV cache.

``Scheduler.form_step`` runs the step function through ``StepKV`` (``StepKV(scheduler,
waiting).run(step.plan, order.rank_running)``): the step sees the scheduler's own requests (``QueuedRequest``:
running sequences, then swapped groups and arrived waiting sequences, read lazily, both in the order
``scheduling_policy`` names) and this adapter as its ``kv``, whose ``allocate`` / ``free`` act on the KV manager and the
queues at once; ``output(plan)`` applies the plan it returns (admissions) and makes the step's
``SchedulerOutput``. The policy never calls the scheduler, and the scheduler never calls the policy
back: scheduler -> adapter -> step function -> adapter -> KV manager.
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass, field

from tinypaged.interfaces import InvariantError
from tinypaged.sched.output import ScheduledSeq, SchedulerOutput
from tinypaged.sched.policies import PlanRequest
from tinypaged.sched.preemption import release, requeue_group, resume, settle, swap_in
from tinypaged.sequence import Sequence, SequenceStatus


# -- what a schedule_step sees of the scheduler ----------------------------------------------------
@dataclass(eq=False)
class QueuedRequest(PlanRequest):
    """A ``PlanRequest`` backed by the scheduler's own sequences: one running or waiting sequence,
    or (on the waiting side) a swapped group of siblings that resume together. ``request_id`` is
    the request's real id (the n samples of one request share it). ``computed`` holds the
    prefix-cache blocks found for a waiting sequence, already subtracted from ``num_new_tokens``."""

    seqs: tuple = ()
    computed: list = field(default_factory=list)
    waiting: bool = False

    @classmethod
    def of(cls, seqs, num_new_tokens: int, computed=(), waiting: bool = False) -> "QueuedRequest":
        return cls(seqs[0].request_id, num_new_tokens, sum(1 + s.pending_forks for s in seqs), tuple(seqs),
                   list(computed), waiting)


class _LazyList(collections.abc.Sequence):
    """A read-only list made only as far as it is read, so a step that reads k waiting requests
    costs k prefix-cache lookups, not one per queued request."""

    def __init__(self, items):
        self._source, self._items = iter(items), []

    def _fill(self, upto: int | None) -> None:
        while upto is None or len(self._items) <= upto:
            nxt = next(self._source, None)
            if nxt is None:
                return
            self._items.append(nxt)

    def __getitem__(self, i):
        self._fill(i if isinstance(i, int) and i >= 0 else None)
        return self._items[i]

    def __len__(self) -> int:
        self._fill(None)
        return len(self._items)


class StepKV:
    """The ``kv`` a ``schedule_step`` drives: the scheduler's KV manager, for one step; the queues change once, after
    the step has decided (``settle``), so the step reads queues that stay as they were.

    * ``allocate(req, n)`` reserves room for ``n`` more tokens of ``req`` now and says whether it
      could: a waiting sequence with its prefix-cache hit; a swapped group is swapped back in (all
      or nothing, every sibling with all its tokens). It refuses a waiting request what the
      configuration forbids (``admissible``): more sequences than ``max_num_seqs`` (its samples to
      fork count from the start), or, without chunked prefill, part of its prompt.
    * ``free(req)`` releases a running ``req``'s memory now (recompute; or swap, taking its running siblings
      along: a sibling swapped out that way is left out of this step even if the step allocates it).
    * ``run(step_fn, rank_running)`` calls the step, then ``settle``s the queues (preempted groups leave
      ``running`` and go to the front of their queues, swapped-in groups run again), then ``output(plan)`` admits
      the scheduled waiting sequences and returns the step's ``SchedulerOutput``.

    Rules it enforces (``InvariantError``): a plan lists the request objects it was given, each with
    exactly the tokens ``allocate`` granted it; no waiting request keeps an allocation it was not
    scheduled for; only running requests are freed.
    """

    def __init__(self, sched, waiting=None):
        self.sched = sched
        self.waiting = sched.waiting if waiting is None else waiting  # in the order's ranking
        self.allocated: dict[QueuedRequest, int] = {}
        self.released: list[tuple[list[Sequence], bool]] = []  # (group, swapped) per preemption, in order
        self.gone: set[int] = set()  # ids of the sequences released this step
        self.swept: set[int] = set()  # of those, the siblings swapped out along with the one freed
        self.resumed: list[list[Sequence]] = []  # swapped groups swapped back in this step
        self.seats = sched.num_running_seqs()  # sequences running or admitted this step (forks to come included)

    def run(self, step_fn, rank_running=list) -> SchedulerOutput:
        """One step: the running sequences (ranked by ``rank_running``), the waiting side (read lazily), the budget,
        and this as ``kv``."""
        cfg, sched = self.sched.config, self.sched
        running = rank_running([QueuedRequest.of((s,), s.num_uncomputed_tokens) for s in sched.running])
        try:
            plan = step_fn(running, _LazyList(self._queued()), cfg.max_num_batched_tokens, cfg.max_num_seqs, self)
        finally:
            self.settle()  # also when the step raised: the memory it moved and the queues agree
        return self.output(plan)

    def _queued(self):
        """The waiting side: swapped groups first (vLLM v0 resumed them before new requests), then
        arrived waiting sequences in queue order, each with its prefix-cache hit."""
        sched = self.sched
        for group in list(sched.swapped):  # a few groups at most (swap space is small)
            yield QueuedRequest.of(group, sum(s.num_uncomputed_tokens for s in group), waiting=True)
        for seq in self.waiting:  # unchanged during a step: the queues settle after it
            if not sched.arrived(seq):
                return
            computed = sched.prefix_hit(seq)
            yield QueuedRequest.of((seq,), seq.num_uncomputed_tokens - sched.hit_tokens(computed), computed, True)

    @staticmethod
    def _check(req, what: str) -> None:
        if not isinstance(req, QueuedRequest):
            raise InvariantError(f"kv.{what} takes one of the requests the step was given (in running or waiting), "
                                 f"got {type(req).__name__} {req!r}")

    def _swept(self, req: QueuedRequest) -> bool:
        return any(s.seq_id in self.swept for s in req.seqs)

    def allocate(self, req: QueuedRequest, n: int) -> bool:
        self._check(req, "allocate")
        if n < 1:
            raise InvariantError(f"kv.allocate was asked for {n} tokens of request {req.request_id}; "
                                 f"a scheduled request gets at least 1")
        admitting = req.waiting and req not in self.allocated
        if admitting and not self.admissible(req, n):
            return False
        if self._swept(req):
            ok = True  # nothing to allocate: it is on the CPU now, and output() leaves it out
        elif req.waiting and req.seqs[0].status is SequenceStatus.SWAPPED:
            ok = self._swap_in(req, n)
        else:  # prefix-cache blocks count once, at the first allocation
            ok = self.sched.allocate(req.seqs[0], n, () if req in self.allocated else req.computed)
        if ok:
            self.allocated[req] = self.allocated.get(req, 0) + n
            if admitting:
                self.seats += req.num_seqs
        return ok

    def admissible(self, req: QueuedRequest, n: int) -> bool:
        """Whether the configuration lets waiting ``req`` start with ``n`` tokens: its sequences (and
        forks to come) fit ``max_num_seqs`` beside those running or admitted this step, and without
        chunked prefill ``n`` is its whole prompt (vLLM v1 then leaves a prompt that does not fit the
        budget waiting)."""
        cfg = self.sched.config
        if not cfg.enable_chunked_prefill and n < req.num_new_tokens:
            return False
        return self.seats + req.num_seqs <= cfg.max_num_seqs

    def _swap_in(self, req: QueuedRequest, n: int) -> bool:
        group = list(req.seqs)
        lone = len(group) == 1  # a lone sequence may resume mid-prompt with a chunk
        if not lone and n != req.num_new_tokens:
            return False
        if not swap_in(self.sched, group, n if lone else max(s.num_uncomputed_tokens for s in group)):
            return False
        self.resumed.append(group)
        for s in group:
            if not self.sched.allocate(s, n if lone else s.num_uncomputed_tokens):
                raise InvariantError("a swapped-in sequence found no room for its next tokens")
        return True

    def free(self, req: QueuedRequest) -> None:
        self._check(req, "free")
        if req.waiting:
            raise InvariantError(f"kv.free was called on waiting request {req.request_id}: only running "
                                 f"requests can be preempted")
        seq = req.seqs[0]
        if seq.seq_id in self.gone:
            return  # released earlier in this step (with a sibling): nothing left to free
        group, swapped = release(self.sched, seq, self.gone)
        self.seats -= sum(1 + s.pending_forks for s in group)
        self.released.append((group, swapped))
        self.gone.update(s.seq_id for s in group)
        self.swept.update(s.seq_id for s in group if s is not seq)

    def settle(self) -> None:
        """The queues catch up with the step, once: preempted groups leave ``running`` and go back to the front of
        their queues (the latest preempted first in line), swapped-in groups run again."""
        sched = self.sched
        for group, swapped in self.released:
            settle(sched, group, swapped)
        for group, _ in self.released:
            requeue_group(sched, group)
        for group in self.resumed:
            resume(sched, group)

    def output(self, plan) -> SchedulerOutput:
        out = SchedulerOutput(preempted=[s for group, _ in self.released for s in group])
        scheduled = set()
        for req, n in plan.scheduled:
            if not isinstance(req, QueuedRequest):
                raise InvariantError(f"schedule_step scheduled {req!r}: a plan lists the request objects it was "
                                     f"given, as (request, num_tokens), not their ids")
            if self.allocated.get(req, 0) != n:
                raise InvariantError(f"schedule_step scheduled {n} tokens of request {req.request_id!r} but "
                                     f"kv.allocate succeeded for {self.allocated.get(req, 0)}: allocate exactly "
                                     f"what you schedule")
            scheduled.add(req)
            if self._swept(req):
                continue
            for seq in req.seqs:
                if req.waiting and seq.status is SequenceStatus.WAITING:
                    self.sched.admit(seq)
                out.scheduled.append(ScheduledSeq(seq, n if len(req.seqs) == 1 else seq.num_uncomputed_tokens))
        leaked = [r.request_id for r in self.allocated if r.waiting and r not in scheduled]
        if leaked:
            raise InvariantError(f"schedule_step allocated KV for waiting request(s) {leaked} but did not "
                                 f"schedule them")
        return out
