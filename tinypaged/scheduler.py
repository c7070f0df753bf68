"""Stage 4: who runs in the next step, and the bookkeeping of every request's progress.

The ``Scheduler`` owns the queues (``waiting``, ``running``, and ``swapped`` for vLLM v0's swap
preemption) and each sequence's progress: it admits, preempts, advances ``num_computed_tokens``
after a forward, appends sampled tokens, finishes and frees. *Which* sequences run is decided by a
scheduling policy (``tinypaged.interfaces.SchedulingPolicy``), two of which ship here:

* ``StaticBatching`` (the pre-Orca baseline): form a batch, run it until every member finishes,
  then form the next. A request joins only when the memory it could ever need is guaranteed, so
  nothing is preempted.
* continuous batching (vLLM v1's iteration-level scheduling): ``schedule_step`` below, run on the
  engine's real queues through ``PlanPolicy``. Every step is a new batch. Running sequences go first
  (a decode costs one token of the ``max_num_batched_tokens`` budget, a prefill chunk its length);
  waiting requests are admitted in arrival order with what is left. When the KV cache runs out, the
  most recently admitted running sequence is preempted (recompute: its blocks are freed and it
  re-queues at the front keeping its generated tokens). A step that preempted admits nothing new.

A learner's own ``schedule_step`` plugs in the same way: ``LLM(..., scheduling_policy=my_step)``.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from tinypaged.block_manager import blocks_needed
from tinypaged.interfaces import InvariantError
from tinypaged.sequence import Sequence, SequenceStatus

logger = logging.getLogger("tinypaged")


def pick_victim(running: list):
    """vLLM v1's preemption victim: the most recently admitted running request (``running`` is kept
    in admission order). Under first-come-first-served, the latest arrival yields first, so earlier
    requests keep their place (the paper's fairness rule, section 4.5)."""
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
    num_idle_slots: int = 0  # static batching: batch slots whose sequence has already finished

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


# -- the continuous policy: one step, on plain objects ---------------------------------------------
@dataclass
class PlanRequest:
    """A request as the policy sees it: an id, how many tokens it still has to compute (the rest of
    its prompt while prefilling, 1 while decoding), and how many sequences it will run as (n > 1
    samples forked after the prompt count n against ``max_num_seqs`` from the start)."""

    request_id: object
    num_new_tokens: int
    num_seqs: int = 1


@dataclass
class StepPlan:
    scheduled: list[tuple[object, int]] = field(default_factory=list)  # (request_id, tokens this step)
    preempted: list[object] = field(default_factory=list)


def schedule_step(running, waiting, budget: int, max_num_seqs: int, kv, chunked_prefill: bool = True) -> StepPlan:
    """One continuous-batching step (vLLM v1's rules). The engine runs exactly this function.

    ``running`` is in admission order, ``waiting`` in queue order; neither is modified.
    ``kv.allocate(req, n)`` reserves room for ``n`` more tokens of ``req`` and says whether it
    could; ``kv.free(req)`` preempts ``req`` (releases everything it holds).

    1. Running requests first, in order: each takes ``min(num_new_tokens, budget)`` tokens (without
       chunked prefill, a request whose tokens do not all fit waits for a later step). When the KV
       cache cannot hold them, preempt ``pick_victim`` of the running requests and retry; if the
       victim is the request itself, move on.
    2. Only if nothing was preempted: admit waiting requests in queue order while there is budget
       and room under ``max_num_seqs``; stop at the first that does not fit.
    """
    plan = StepPlan()
    running = list(running)
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        n = min(req.num_new_tokens, budget)
        if n < req.num_new_tokens and not chunked_prefill:
            i += 1
            continue
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
    num_seqs = sum(getattr(r, "num_seqs", 1) for r in running)
    for req in waiting:
        seqs = getattr(req, "num_seqs", 1)
        if budget <= 0 or num_seqs + seqs > max_num_seqs:
            break
        n = min(req.num_new_tokens, budget)
        if n < req.num_new_tokens and not chunked_prefill:
            break
        if not kv.allocate(req, n):
            break
        running.append(req)
        num_seqs += seqs
        plan.scheduled.append((req.request_id, n))
        budget -= n
    return plan


class BlockCounter:
    """A KV cache reduced to block counting, for ``schedule_step``: ``num_blocks`` blocks of
    ``block_size`` tokens; ``held`` maps request id -> tokens it holds."""

    def __init__(self, num_blocks: int, block_size: int, held: dict | None = None):
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


# -- the scheduler: queues, actions and progress ----------------------------------------------------
class Scheduler:
    """Queues and progress of every sequence; policies act through ``allocate``/``admit``/``preempt``."""

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
        # read before the policy runs: a request arriving while it runs was not there to be scheduled
        head_arrived = bool(self.waiting) and self.arrived(self.waiting[0])
        out = self.policy.schedule(self)
        check_schedule(out, self)
        if not out.scheduled and not self.running and (self.swapped or head_arrived):
            head = self.swapped[0][0] if self.swapped else self.waiting[0]
            raise InvariantError(f"the scheduler made no progress: nothing runs, yet request {head.request_id} "
                                 f"({head.num_uncomputed_tokens} tokens to compute) could not be scheduled; the "
                                 f"engine would wait forever")
        return out

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

    def preempt(self, seq: Sequence) -> list[Sequence]:
        """Take ``seq`` off the running list. Recompute (vLLM v1): free its blocks, keep its tokens,
        re-queue it at the front. Swap (vLLM v0, ``preemption_mode="swap"``): move it and its running
        siblings to CPU memory together, so blocks they share stay shared. Returns who was preempted."""
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
            self.swapped.appendleft(group)
            how = f"swapped {len(group)} sequence(s) to CPU memory"
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
            how = f"freed its blocks; {len(seq)} tokens will be recomputed"
        logger.warning("Preempted sequence %d (request %s): %s. Total preemptions: %d",
                       seq.seq_id, seq.request_id, how, self.num_preemptions)
        return group

    def swap_in(self, group: list[Sequence], num_new_tokens: int = 1) -> bool:
        """Bring a swapped group back (all or nothing), with room for each one's next tokens."""
        if not self.kv.can_swap_in(group, num_new_tokens):
            return False
        self.kv.swap_in(group, self.swapper.copy_to_gpu)
        self.swapped.remove(group)
        for s in group:
            s.status = SequenceStatus.WAITING
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

    def update_from_output(self, seqs, tokens, logprobs, now: float, stop_check) -> list[Sequence]:
        """Append each sampled token; finish (and free) the sequences ``stop_check`` says are done."""
        done = []
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            seq.append_token(tok, lp, now)
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

    def abort(self, seqs) -> None:
        """Drop sequences wherever they are (an interrupted call): queues left, blocks freed."""
        ids = {s.seq_id for s in seqs}
        self.waiting = deque(s for s in self.waiting if s.seq_id not in ids)
        self.running = [s for s in self.running if s.seq_id not in ids]
        self.swapped = deque(g for g in self.swapped if not any(s.seq_id in ids for s in g))
        for s in seqs:
            self.kv.free(s)
            if not s.is_finished:
                s.finish_reason, s.status = "abort", SequenceStatus.FINISHED


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


# -- policies -----------------------------------------------------------------------------------------
class _Item:
    """A sequence (or a swapped group of siblings) as ``schedule_step`` sees it."""

    def __init__(self, seqs, num_new_tokens: int, computed=(), waiting: bool = False):
        self.seqs, self.num_new_tokens, self.computed, self.waiting = seqs, num_new_tokens, computed, waiting
        self.request_id = seqs[0].seq_id  # unique per sequence (n samples share a request id)
        self.num_seqs = sum(1 + s.pending_forks for s in seqs)


class _LazyWaiting:
    """The waiting side of a step, built only as far as the policy reads it: swapped groups first
    (vLLM v0 resumed them before new requests), then arrived requests in queue order, each with its
    prefix-cache hit already subtracted from ``num_new_tokens``."""

    def __init__(self, sched: Scheduler):
        self.sched, self.items = sched, []
        self._source = self._generate()

    def _generate(self):
        s = self.sched
        for group in list(s.swapped):
            yield _Item(group, sum(x.num_uncomputed_tokens for x in group), waiting=True)
        for seq in list(s.waiting):
            if not s.arrived(seq):
                return
            computed = s.prefix_hit(seq)
            yield _Item([seq], seq.num_uncomputed_tokens - s.hit_tokens(computed), computed, waiting=True)

    def _fill(self, upto: int | None) -> None:
        while upto is None or len(self.items) <= upto:
            nxt = next(self._source, None)
            if nxt is None:
                return
            self.items.append(nxt)

    def __iter__(self):
        i = 0
        while True:
            self._fill(i)
            if i >= len(self.items):
                return
            yield self.items[i]
            i += 1

    def __len__(self):
        self._fill(None)
        return len(self.items)

    def __getitem__(self, i):
        self._fill(None if i < 0 else i)
        return self.items[i]


class _KVView:
    """``kv.allocate`` / ``kv.free`` for ``schedule_step``, acting on the scheduler's real state."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.allocated: dict[object, int] = {}
        self.preempted: list[Sequence] = []
        self.gone: set = set()  # running items swapped out together with a sibling during this step

    def allocate(self, item: _Item, n: int) -> bool:
        s = self.sched
        if n < 1:
            raise InvariantError(f"kv.allocate was asked for {n} tokens of request {item.request_id}; "
                                 f"a scheduled request gets at least 1")
        if not item.waiting and item.seqs[0].status is not SequenceStatus.RUNNING:
            # swapped out with a preempted sibling earlier in this step: nothing to run, nothing to free
            self.gone.add(item.request_id)
            return True
        if len(item.seqs) > 1 or item.seqs[0].status is SequenceStatus.SWAPPED:  # a swapped group
            # siblings resume together (each decodes one token); a lone sequence may resume mid-prompt
            whole = len(item.seqs) > 1
            ok = (n == item.num_new_tokens or not whole) and s.swap_in(item.seqs, 1 if whole else n)
            if ok and not all(s.allocate(x, x.num_uncomputed_tokens if whole else n) for x in item.seqs):
                raise InvariantError("a swapped-in sequence found no room for its next tokens")
        else:
            ok = s.allocate(item.seqs[0], n, item.computed if item.waiting else ())
        if ok:
            self.allocated[item.request_id] = self.allocated.get(item.request_id, 0) + n
        return ok

    def free(self, item: _Item) -> None:
        if item.waiting:
            raise InvariantError(f"kv.free was called on waiting request {item.request_id}: only running "
                                 f"requests can be preempted")
        if item.seqs[0].status is SequenceStatus.RUNNING:
            self.preempted += self.sched.preempt(item.seqs[0])


class PlanPolicy:
    """Runs a ``schedule_step``-shaped function on the engine's queues (continuous batching)."""

    def __init__(self, step_fn=schedule_step):
        if not callable(step_fn):
            raise TypeError(f"scheduling_policy must be a schedule_step-like function or an object with "
                            f"schedule(scheduler); got {type(step_fn).__name__}")
        self.step_fn = step_fn

    def schedule(self, sched: Scheduler) -> SchedulerOutput:
        cfg = sched.config
        running = {s.seq_id: _Item([s], s.num_uncomputed_tokens) for s in sched.running}
        waiting = _LazyWaiting(sched)
        kv = _KVView(sched)
        extra = {} if cfg.enable_chunked_prefill else {"chunked_prefill": False}
        plan = self.step_fn(list(running.values()), waiting, cfg.max_num_batched_tokens, cfg.max_num_seqs, kv,
                            **extra)
        out = SchedulerOutput(preempted=kv.preempted)
        items = {**{i.request_id: i for i in waiting.items}, **running}
        for rid, n in plan.scheduled:
            item = items.get(rid)
            if item is None:
                raise InvariantError(f"schedule_step scheduled unknown request id {rid!r}")
            if rid in kv.gone:
                continue
            if kv.allocated.get(rid) != n:
                raise InvariantError(f"schedule_step scheduled {n} tokens of request {rid!r} but kv.allocate "
                                     f"succeeded for {kv.allocated.get(rid, 0)}: allocate exactly what you schedule")
            if item.waiting:
                for seq in item.seqs:
                    if seq.status is SequenceStatus.WAITING and seq in sched.waiting:
                        sched.admit(seq)
                    else:
                        sched._start_running(seq)
            for seq in item.seqs:
                num = n if len(item.seqs) == 1 else seq.num_uncomputed_tokens
                out.scheduled.append(ScheduledSeq(seq, num, "decode" if seq.is_decoding else "prefill"))
        scheduled = {r for r, _ in plan.scheduled}
        leaked = [rid for rid in kv.allocated if rid not in scheduled and items[rid].waiting]
        if leaked:
            raise InvariantError(f"schedule_step allocated KV for waiting request(s) {leaked} but did not schedule them")
        return out


class StaticBatching:
    """The batch is formed when nothing runs; its members prefill (as the budget allows), then
    decode in lockstep; finished members leave idle slots until the last one is done."""

    def __init__(self):
        self.batch_size = 0

    def _form_batch(self, sched: Scheduler) -> None:
        """Admit up to ``max_num_seqs`` arrived requests, each only if the memory it could ever need
        is guaranteed next to the others': a static batch never preempts."""
        kv, cfg = sched.kv, sched.config
        free = round((1.0 - kv.usage) * kv.capacity_tokens)
        while sched.waiting and sched.num_running_seqs() < cfg.max_num_seqs:
            seq = sched.waiting[0]
            if not sched.arrived(seq):
                break
            need = blocks_needed(kv.max_tokens_needed(seq), kv.block_size) * kv.block_size * (1 + seq.pending_forks)
            if need > free or not kv.allocate_slots(seq, 0):  # a contiguous manager reserves here
                break
            free -= need
            sched.admit(seq)
        self.batch_size = len(sched.running)

    def schedule(self, sched: Scheduler) -> SchedulerOutput:
        out = SchedulerOutput()
        if not sched.running:
            self._form_batch(sched)
        budget = sched.config.max_num_batched_tokens
        prefilling = [s for s in sched.running if not s.is_decoding]
        for seq in prefilling or list(sched.running):
            computed = sched.prefix_hit(seq)
            num_new = seq.num_uncomputed_tokens - sched.hit_tokens(computed)
            if out.scheduled and num_new > budget:
                break  # this prompt prefills next step (the first one always fits: budget >= max_model_len)
            kind = "decode" if seq.is_decoding else "prefill"
            if not sched.allocate(seq, num_new, computed):
                raise RuntimeError("static batching reserved memory for this batch, yet allocation failed")
            out.scheduled.append(ScheduledSeq(seq, num_new, kind))
            budget -= num_new
        out.num_idle_slots = max(self.batch_size - len(out.scheduled), 0)
        return out


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
