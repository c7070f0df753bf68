"""Stage 4: the queues, and the bookkeeping of every request's progress.

The ``Scheduler`` owns the queues (``waiting``, ``running``, and ``swapped`` for vLLM v0's swap
preemption) and each sequence's progress: it admits, preempts, advances ``num_computed_tokens``
after a forward, appends tokens, finishes and frees. *Which* sequences run is decided by a
scheduling policy (``tinypaged.sched.policies``; the contract is ``tinypaged.interfaces.SchedulingPolicy``).

Continuous batching is the exercise's ``schedule_step`` itself: ``run_step`` hands it the
scheduler's own requests (``QueuedRequest``: running sequences, then swapped groups and arrived
waiting sequences, read lazily) and a ``StepKV`` whose ``allocate`` / ``free`` act on the real
queues and KV manager at once. The step's output is a ``tinypaged.sched.output.SchedulerOutput``.
"""

from __future__ import annotations

import collections.abc
import logging
from collections import deque
from dataclasses import dataclass, field

from tinypaged.interfaces import InvariantError
from tinypaged.sched.output import ScheduledSeq, SchedulerOutput
from tinypaged.sched.policies import PlanPolicy, PlanRequest, StaticBatching, schedule_step
from tinypaged.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger("tinypaged")


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
    """The ``kv`` a ``schedule_step`` drives: the scheduler's KV manager and queues, for one step.

    * ``allocate(req, n)`` reserves room for ``n`` more tokens of ``req`` now and says whether it
      could: a waiting sequence with its prefix-cache hit; a swapped group is swapped back in (all
      or nothing, every sibling with all its tokens) and runs again. It refuses a waiting request
      what the configuration forbids (``admissible``): more sequences than ``max_num_seqs`` (its
      samples to fork count from the start), or, without chunked prefill, part of its prompt.
    * ``free(req)`` preempts a running ``req`` now (recompute; or swap, taking its running siblings
      along: a sibling swapped out that way is left out of this step even if the step allocates it).
    * ``run(step_fn)`` calls the step; ``output(plan)`` admits the scheduled waiting sequences and
      returns the step's ``SchedulerOutput``; ``requeue()`` then puts the preempted at the front of
      their queues (not before: the waiting queue does not change while a step reads it).

    Rules it enforces (``InvariantError``): a plan lists the request objects it was given, each with
    exactly the tokens ``allocate`` granted it; no waiting request keeps an allocation it was not
    scheduled for; only running requests are freed.
    """

    def __init__(self, sched: "Scheduler"):
        self.sched = sched
        self.allocated: dict[QueuedRequest, int] = {}
        self.preempted: list[Sequence] = []
        self.victims: list[list[Sequence]] = []  # preempted groups, to requeue when the step is over
        self.swept: set[int] = set()  # seq ids swapped out together with a preempted sibling
        self.seats: int | None = None  # sequences running or admitted this step (forks to come included)

    def run(self, step_fn) -> SchedulerOutput:
        """One step: the running sequences, the waiting side (read lazily), the budget, and this as ``kv``."""
        cfg, sched = self.sched.config, self.sched
        running = [QueuedRequest.of((s,), s.num_uncomputed_tokens) for s in sched.running]
        try:
            plan = step_fn(running, _LazyList(self._queued()), cfg.max_num_batched_tokens, cfg.max_num_seqs, self)
            return self.output(plan)
        finally:
            self.requeue()

    def _queued(self):
        """The waiting side: swapped groups first (vLLM v0 resumed them before new requests), then
        arrived waiting sequences in queue order, each with its prefix-cache hit."""
        sched = self.sched
        for group in list(sched.swapped):  # a few groups at most (swap space is small), changed by swap-ins
            yield QueuedRequest.of(group, sum(s.num_uncomputed_tokens for s in group), waiting=True)
        for seq in sched.waiting:  # unchanged during a step: admissions and requeues come after it
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
        if self.seats is None:
            self.seats = self.sched.num_running_seqs()
        return self.seats + req.num_seqs <= cfg.max_num_seqs

    def _swap_in(self, req: QueuedRequest, n: int) -> bool:
        group = list(req.seqs)
        lone = len(group) == 1  # a lone sequence may resume mid-prompt with a chunk
        if not lone and n != req.num_new_tokens:
            return False
        if not self.sched.swap_in(group, n if lone else max(s.num_uncomputed_tokens for s in group)):
            return False
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
        if seq.status is not SequenceStatus.RUNNING:
            return  # preempted earlier in this step (with a sibling): nothing left to free
        group = self.sched.preempt(seq, requeue=False)
        if self.seats is not None:
            self.seats -= sum(1 + s.pending_forks for s in group)
        self.victims.append(group)
        self.preempted += group
        self.swept.update(s.seq_id for s in group if s is not seq)

    def output(self, plan) -> SchedulerOutput:
        out = SchedulerOutput(preempted=list(self.preempted))
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

    def requeue(self) -> None:
        for group in self.victims:
            self.sched.requeue(group)
        self.victims = []


# -- the scheduler: queues, actions and progress ----------------------------------------------------
class Scheduler:
    """Queues and progress of every sequence; policies act through its actions (``allocate``,
    ``admit``, ``preempt``; a ``schedule_step`` through ``StepKV``).

    Invariants: a sequence is in at most one queue, and its status says which (RUNNING: ``running``,
    in admission order; WAITING: ``waiting``; SWAPPED: ``swapped``, whole groups of siblings); only
    running sequences hold GPU blocks; ``num_computed_tokens`` changes only here.
    """

    def __init__(self, config, kv_manager, policy, clock=lambda: float("inf"), swapper=None):
        self.config = config
        self.kv = kv_manager
        self.policy = policy
        self.clock = clock
        self.swapper = swapper  # KVCacheTensors, for preemption_mode="swap"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[list[Sequence]] = deque()  # groups of siblings swapped out together (v0)
        self.num_preemptions = 0

    # -- queues ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_running_seqs(self) -> int:
        """Running sequences plus the forks they will make (n > 1, ``parallel_sampling="fork"``)."""
        return len(self.running) + sum(s.pending_forks for s in self.running)

    def arrived(self, seq: Sequence) -> bool:
        return seq.times.arrival <= self.clock()

    def schedule(self) -> SchedulerOutput:
        self._recompute_stuck_swapped()
        # read before the policy runs: a request arriving while it runs was not there to be scheduled
        head_arrived = bool(self.waiting) and self.arrived(self.waiting[0])
        out = self.policy.schedule(self)
        check_schedule(out, self)
        if not (out.scheduled or out.preempted or self.running) and (self.swapped or head_arrived):
            head = self.swapped[0][0] if self.swapped else self.waiting[0]
            raise InvariantError(f"the scheduler made no progress: nothing runs, yet request {head.request_id} "
                                 f"({head.num_uncomputed_tokens} tokens to compute) could not be scheduled; the "
                                 f"engine would wait forever")
        return out

    def run_step(self, step_fn) -> SchedulerOutput:
        """Run a ``schedule_step``-shaped function on the real queues, acting as its ``kv`` (``StepKV``)."""
        return StepKV(self).run(step_fn)

    def _recompute_stuck_swapped(self) -> None:
        """A swapped group that does not fit back even with nothing running (siblings that outgrew
        the cache side by side) would wait forever: recompute its sequences one by one instead
        (course-only; vLLM v0 failed such a request)."""
        if self.running or not self.swapped:
            return
        group = self.swapped[0]
        if self.kv.can_swap_in(group, max(s.num_uncomputed_tokens for s in group)):
            return
        self.swapped.popleft()
        for s in group:
            self.kv.free(s)  # drops its CPU copy
            s.num_computed_tokens, s.status = 0, SequenceStatus.WAITING
        self.waiting.extendleft(reversed(group))
        logger.warning("Swapped-out request %s (%d sequences) cannot fit back together even in an empty cache: "
                       "recomputing its sequences one by one", group[0].request_id, len(group))

    # -- actions for policies -----------------------------------------------------------------
    def prefix_hit(self, seq) -> list:
        """Cached blocks holding the start of ``seq`` (empty unless prefix caching finds some)."""
        return self.kv.get_computed_blocks(seq)

    def hit_tokens(self, computed) -> int:
        return len(computed) * self.kv.block_size

    def allocate(self, seq, num_new: int, computed=()) -> bool:
        """Room for ``num_new`` tokens after the cached blocks ``computed``. The cached tokens count
        as computed; a sequence starting from scratch (new, or preempted by recompute) records its
        prefix-cache lookup."""
        fresh = seq.num_computed_tokens == 0
        if not self.kv.allocate_slots(seq, num_new, computed):
            return False
        if fresh:
            seq.num_computed_tokens = self.hit_tokens(computed)
            seq.num_cached_tokens = seq.num_computed_tokens
            record = getattr(self.kv, "record_prefix_lookup", None)
            if record is not None:
                record(seq, seq.num_cached_tokens)
        return True

    def admit(self, seq: Sequence) -> None:
        """Waiting -> running (appended, so ``running`` stays in admission order)."""
        if self.waiting and self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        self._start_running(seq)

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.times.first_scheduled is None:
            seq.times.first_scheduled = self.clock()
        self.running.append(seq)

    def preempt(self, seq: Sequence, requeue: bool = True) -> list[Sequence]:
        """Take ``seq`` off the running list. Recompute (vLLM v1): free its blocks, keep its tokens,
        re-queue it at the front. Swap (vLLM v0, ``preemption_mode="swap"``): move it and its running
        siblings to CPU memory together, so blocks they share stay shared. Returns who was preempted;
        with ``requeue=False`` the caller puts them back with ``requeue`` later."""
        siblings = [s for s in self.running if s.request_id == seq.request_id]
        swap = self.config.preemption_mode == "swap" and self.kv.can_swap_out(siblings)
        group = siblings if swap else [seq]
        for s in group:
            self.running.remove(s)
            self.num_preemptions += 1
            s.num_preemptions += 1
        if swap:
            self.kv.swap_out(group, self.swapper.copy_to_cpu)
            for s in group:
                s.status = SequenceStatus.SWAPPED
            how = f"swapped {len(group)} sequence(s) to CPU memory"
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            how = f"freed its blocks; {len(seq)} tokens will be recomputed"
        if requeue:
            self.requeue(group)
        logger.warning("Preempted sequence %d (request %s): %s. Total preemptions: %d",
                       seq.seq_id, seq.request_id, how, self.num_preemptions)
        return group

    def requeue(self, group: list[Sequence]) -> None:
        """A preempted group goes to the front of its queue: first to swap back in, or to recompute."""
        if group[0].status is SequenceStatus.SWAPPED:
            self.swapped.appendleft(group)
        else:
            self.waiting.extendleft(reversed(group))

    def swap_in(self, group: list[Sequence], num_new_tokens: int = 1) -> bool:
        """Bring a swapped group back (all or nothing), with room for each one's next tokens; it runs again."""
        if not self.kv.can_swap_in(group, num_new_tokens):
            return False
        self.kv.swap_in(group, self.swapper.copy_to_gpu)
        self.swapped.remove(group)
        for s in group:
            self._start_running(s)
        return True

    # -- progress (after the forward) ------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """The scheduled tokens' keys and values are in the cache now."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens

    def fork(self, parent: Sequence, index: int, generator=None) -> Sequence:
        """A running child sharing ``parent``'s blocks (the paper's and v0's n > 1, and beam search)."""
        child = parent.fork(index, generator)
        self.kv.fork(parent, child)
        self.running.append(child)
        return child

    def append_tokens(self, seqs, tokens, logprobs, now: float | None = None) -> None:
        """Each sequence gets its next token (sampled, or chosen by beam search) and its log-probability."""
        now = self.clock() if now is None else now
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            seq.append_token(tok, lp, now)

    def update_from_output(self, seqs, tokens, logprobs, now: float, stop_check) -> list[Sequence]:
        """Append each sampled token; finish (and free) the sequences ``stop_check`` says are done."""
        self.append_tokens(seqs, tokens, logprobs, now)
        done = []
        for seq in seqs:
            verdict = stop_check(seq)
            if verdict is not None:
                self.finish(seq, *verdict, now=now)
                done.append(seq)
        return done

    def finish(self, seq: Sequence, reason: str, stop_reason=None, now: float | None = None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.status = SequenceStatus.FINISHED
        seq.times.finished = self.clock() if now is None else now
        if seq in self.running:
            self.running.remove(seq)
        self.kv.free(seq)

    def abort(self, seqs, reason: FinishReason = FinishReason.ABORT) -> None:
        """Drop sequences wherever they are (an interrupted call, a failed request): queues left,
        blocks freed; the unfinished ones finish with ``reason``."""
        ids = {s.seq_id for s in seqs}
        self.waiting = deque(s for s in self.waiting if s.seq_id not in ids)
        self.running = [s for s in self.running if s.seq_id not in ids]
        self.swapped = deque(g for g in self.swapped if not any(s.seq_id in ids for s in g))
        for s in seqs:
            self.kv.free(s)
            if not s.is_finished:
                s.finish_reason, s.status = reason, SequenceStatus.FINISHED


def check_schedule(out: SchedulerOutput, sched: Scheduler) -> None:
    """The engine's side of the SchedulingPolicy contract: raise InvariantError naming the broken rule."""
    cfg = sched.config
    running = {s.seq_id for s in sched.running}
    seen = set()
    for item in out.scheduled:
        seq, n = item.seq, item.num_tokens
        if seq.seq_id in seen:
            raise InvariantError(f"sequence {seq.seq_id} (request {seq.request_id}) is scheduled twice in one step")
        seen.add(seq.seq_id)
        if seq.seq_id not in running:
            raise InvariantError(f"sequence {seq.seq_id} (request {seq.request_id}) is scheduled but not running: "
                                 f"admit it first")
        if not 1 <= n <= seq.num_uncomputed_tokens:
            raise InvariantError(f"sequence {seq.seq_id} (request {seq.request_id}) is scheduled for {n} tokens; "
                                 f"it must get between 1 and its {seq.num_uncomputed_tokens} uncomputed tokens")
    total = out.num_batched_tokens
    if total > cfg.max_num_batched_tokens:
        raise InvariantError(f"the step schedules {total} tokens, over the token budget "
                             f"max_num_batched_tokens={cfg.max_num_batched_tokens}")
    if sched.num_running_seqs() > cfg.max_num_seqs:
        raise InvariantError(f"{sched.num_running_seqs()} sequences are running (forks to come included), "
                             f"over max_num_seqs={cfg.max_num_seqs}")


def make_policy(config):
    """The policy that ``config.scheduling_policy`` names: "continuous" (``schedule_step``, vLLM v1's
    rules), "static", a schedule_step-like function, or a policy object (or a class, built with no
    arguments) with ``schedule(scheduler)``. ``EngineConfig.verify`` has checked which one it is."""
    p = config.scheduling_policy
    if isinstance(p, str) and p == "continuous":
        return PlanPolicy(schedule_step)
    if isinstance(p, str) and p == "static":
        return StaticBatching()
    if isinstance(p, type):
        p = p()
    if hasattr(p, "schedule"):
        return p
    return PlanPolicy(p)
