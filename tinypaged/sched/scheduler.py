"""Stage 4: the queues, and the bookkeeping of every request's progress.

The ``Scheduler`` owns the queues (``waiting``, ``running``, and ``swapped`` for vLLM v0's swap
preemption) and each sequence's progress: it admits, preempts, advances ``num_computed_tokens``
after a forward, appends tokens, finishes and frees. One step, straight down (``schedule``):

1. ``form_step``: the step function (``step.plan``: the lesson's ``schedule_step``, or ``scheduler_cls``'s) over the
   running requests and the waiting ones, both in the order ``scheduling_policy`` names (``order``: fcfs, priority,
   lpm; ``tinypaged.interfaces.WaitingOrder``), with the plan adapter (``tinypaged.sched.step_adapter.StepKV``) as
   its ``kv``, which acts on the real KV manager and applies the plan. A scheduler of another kind replaces only
   this method (static batching: ``tinypaged.sched.static.StaticScheduler``; vLLM's ``scheduler_cls`` takes a
   scheduler class the same way).
2. the KV manager's block moves of the step (``take_block_moves``: swaps and copy-on-write copies) go into the
   step's ``tinypaged.sched.output.SchedulerOutput``, for the worker to make;
3. ``check_schedule`` checks it; ``make_batch`` gives it the runner's data.

The scheduler is the only writer of a ``Sequence``'s progress, queue status and finish.
"""

from __future__ import annotations

import logging
from collections import deque

from tinypaged.interfaces import InvariantError
from tinypaged.sched.batch import check_no_overwrite, make_batch
from tinypaged.sched.output import SchedulerOutput
from tinypaged.sched.policies import FcfsOrder, PlanPolicy
from tinypaged.sched.preemption import preempt, recompute_stuck_swapped
from tinypaged.sampling.sampler import check_stop, sample_generator
from tinypaged.sched.step_adapter import StepKV
from tinypaged.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger("tinypaged")


# -- the scheduler: queues, actions and progress ----------------------------------------------------
class Scheduler:
    """Queues and progress of every sequence. ``step``: the step function's plan policy (``PlanPolicy``, default
    ``schedule_step``); ``order``: the waiting order (``FcfsOrder`` by default). A subclass that forms its steps
    another way overrides ``form_step`` and acts through the actions (``allocate``, ``admit``, ``preempt``).

    Invariants: a sequence is in at most one queue, and its status says which (RUNNING: ``running``,
    in admission order; WAITING: ``waiting``; SWAPPED: ``swapped``, whole groups of siblings); only
    running sequences hold GPU blocks; ``num_computed_tokens`` changes only in ``tinypaged.sched`` (here and
    ``preemption``).
    """

    def __init__(self, config, kv_manager, step=None, order=None, check_invariants: bool = False,
                 runner_batch: bool = True):
        self.config = config
        self.check_invariants = check_invariants  # check_no_overwrite each step (on for plug-ins)
        self.runner_batch = runner_batch  # make the runner's data (off in the lab's simulator: no model)
        self.kv = kv_manager
        self.step = PlanPolicy() if step is None else step
        self.order = FcfsOrder() if order is None else order
        self.now = float("inf")  # the step's time, given to schedule() (data: the scheduler calls nobody for it)
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
        return seq.times.arrival <= self.now

    def schedule(self, now: float = float("inf")) -> SchedulerOutput:
        """The next step at time ``now`` (the engine's clock; requests that arrive later wait; the default: all
        have arrived): formed (``form_step``), given the step's block moves, checked, then given the runner's data
        (``out.batch``)."""
        self.now = now
        recompute_stuck_swapped(self)
        head_arrived = bool(self.waiting) and self.arrived(self.waiting[0])
        out = self.form_step()
        take_moves = getattr(self.kv, "take_block_moves", None)  # a paged manager's copies and swaps, for the worker
        if take_moves is not None:
            out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy = take_moves()
        check_schedule(out, self)
        if not (out.scheduled or out.preempted or self.running) and (self.swapped or head_arrived):
            head = self.swapped[0][0] if self.swapped else self.waiting[0]
            raise InvariantError(f"the scheduler made no progress: nothing runs, yet request {head.request_id} "
                                 f"({head.num_uncomputed_tokens} tokens to compute) could not be scheduled; the "
                                 f"engine would wait forever")
        if self.runner_batch:
            out.batch = make_batch(out.scheduled, self.kv)
            if self.check_invariants:
                check_no_overwrite(out, self.kv)
        return out

    def form_step(self) -> SchedulerOutput:
        """Continuous batching: the step function decides over the requests in the order's ranking; the adapter is
        its ``kv`` and applies its plan. Nobody calls back: scheduler -> adapter -> step -> adapter -> KV manager."""
        return StepKV(self, self.order.waiting_order(self)).run(self.step.plan, self.order.rank_running)

    # -- actions (the adapter's, and a subclass's form_step) ---------------------------------------------------
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
        self.start_running(seq)

    def start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.times.first_scheduled is None:
            seq.times.first_scheduled = self.now
        self.running.append(seq)

    def preempt(self, seq: Sequence) -> list[Sequence]:
        """Preempt ``seq`` now (``tinypaged.sched.preemption.preempt``)."""
        return preempt(self, seq)

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

    def expand_forks(self, sampling) -> tuple[list[int], list[Sequence]]:
        """parallel_sampling="fork" (paper, v0): a sequence with forks to come makes them at its first
        sample; the children share its blocks and sample from its logits row. Returns each sampling
        sequence's row and the sequences (children after their parent); child ``k`` is seeded seed + k
        (``sample_generator``), as a fanned-out sample ``k`` is."""
        rows, seqs = [], []
        for i, seq in enumerate(sampling):
            rows.append(i)
            seqs.append(seq)
            for k in range(1, seq.pending_forks + 1):
                rows.append(i)
                seqs.append(self.fork(seq, k, sample_generator(seq.params.seed, k)))
            seq.pending_forks = 0  # no forks to come: they stop counting against max_num_seqs
        return rows, seqs

    def append_tokens(self, seqs, tokens, logprobs, now: float | None = None) -> None:
        """Each sequence gets its next token (sampled, or chosen by beam search) and its log-probability."""
        now = self.now if now is None else now
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            seq.append_token(tok, lp, now)

    def update_from_output(self, seqs, tokens, logprobs, now: float, eos_token_ids=()) -> list[Sequence]:
        """Append each sampled token; finish (and free) the sequences a token rule ends: ``sampler.check_stop``
        with the model's ``eos_token_ids`` and ``max_model_len`` (EOS and stop token ids, then length). Stop strings
        are text: the output processor searches them after the step and ends a sequence through
        ``finish_by_stop_string``."""
        self.append_tokens(seqs, tokens, logprobs, now)
        done = []
        for seq in seqs:
            verdict = check_stop(seq, eos_token_ids, self.config.max_model_len)
            if verdict is not None:
                self.finish(seq, *verdict, now=now)
                done.append(seq)
        return done

    def finish_by_stop_string(self, seq: Sequence, stop: str, now: float | None = None) -> None:
        """The output processor found stop string ``stop`` in ``seq``'s text after this step's token (vLLM v1: the
        front end aborts that request in the engine core): ``seq`` finishes STOP with the string, its blocks freed.
        A stop string beats a length finish: a sequence the token rules finished by length in the same step keeps
        its time and freed blocks and only changes its reason."""
        if seq.is_finished:
            if seq.finish_reason is FinishReason.LENGTH:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
            return
        self.finish(seq, FinishReason.STOP, stop, now)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason=None, now: float | None = None) -> None:
        if not isinstance(reason, FinishReason):
            raise TypeError(f"a finish reason is a FinishReason (one enum everywhere), got {reason!r}")
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.status = SequenceStatus.FINISHED
        seq.times.finished = self.now if now is None else now
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
