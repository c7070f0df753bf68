"""Stage 4: who runs in the next step. The step function and the orders it reads the queues in.

* continuous batching (vLLM v1's iteration-level scheduling): ``schedule_step``, a pure function of
  the running and waiting requests, a token budget and a ``kv`` that allocates and frees. It is the
  stage-4 exercise's answer, and the engine runs exactly this function (``PlanPolicy.plan``: the
  scheduler runs it on its own requests through the plan adapter, ``sched/step_adapter.StepKV``). Every step
  is a new batch. Running requests go first (a decode costs one token of the
  ``max_num_batched_tokens`` budget, a prefill chunk its length); waiting requests are admitted in
  arrival order with what is left. When the KV cache runs out, the most recently admitted running
  request is preempted. A step that preempted admits nothing new. What only the engine knows (forked
  samples' seats, chunked prefill switched off) its ``kv`` enforces, so the function is the lesson's.
* the order (``scheduling_policy``, one seam: ``tinypaged.interfaces.WaitingOrder``): ``FcfsOrder`` ("fcfs",
  vLLM's default), ``PriorityOrder`` ("priority": the same step over requests ranked by ``(priority, arrival)``,
  lower first, the waiting queue and the running requests alike, so the step's victim, the last running request, is
  the one vLLM v1 preempts: the largest priority value, then the latest arrival; one difference: running requests
  here take the token budget in that order, in vLLM v1 in admission order, which matters only when the budget cannot
  cover every running request), and stage 7's ``CacheAwareOrder`` ("lpm", ``sched/radix_policy.py``).
* static batching (the pre-Orca baseline, course-only) is a scheduler of its own: ``sched/static.py``.

A learner's own ``schedule_step`` plugs in the same way: ``LLM(..., scheduler_cls=my_step)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinypaged.kv.block_pool import blocks_needed


# -- the continuous policy: one step, on plain objects ---------------------------------------------
@dataclass(eq=False)  # compared by identity: two requests with equal fields are still two requests
class PlanRequest:
    """A request as the step sees it: its id, how many tokens it still has to compute (the rest of
    its prompt while prefilling, 1 while decoding), and how many sequences it runs as (n > 1
    samples forked after the prompt count n against ``max_num_seqs`` from the start; the engine's
    ``kv`` refuses a request whose samples do not fit, see ``StepKV.admissible``)."""

    request_id: object
    num_new_tokens: int
    num_seqs: int = 1


@dataclass
class StepPlan:
    """What one step decided: ``scheduled`` holds ``(request, tokens this step)`` and ``preempted``
    the requests preempted, both as the very objects the step was given (not their ids)."""

    scheduled: list[tuple[PlanRequest, int]] = field(default_factory=list)
    preempted: list[PlanRequest] = field(default_factory=list)


def schedule_step(running, waiting, budget: int, max_num_seqs: int, kv) -> StepPlan:
    """One continuous-batching step (vLLM v1's rules). The engine runs exactly this function.

    ``running`` is in admission order, ``waiting`` in queue order; neither is modified.
    ``kv.allocate(req, n)`` reserves room for ``n`` more tokens of ``req`` and says whether it
    could; ``kv.free(req)`` preempts ``req`` (releases everything it holds).

    1. Running requests first, in order: each takes ``min(num_new_tokens, budget)`` tokens. When
       the KV cache cannot hold them, preempt the most recently admitted running request (it has
       done the least work; under first-come-first-served the latest arrival yields first, the
       paper's fairness rule, section 4.5) and retry; if the victim is the request itself, move on.
    2. Only if nothing was preempted: admit waiting requests in queue order while there is budget
       and room under ``max_num_seqs``; stop at the first that does not fit.

    The engine's ``kv`` (``StepKV``) also refuses what its configuration forbids: a waiting request
    whose forked samples would exceed ``max_num_seqs``, and, without chunked prefill, part of a prompt.
    """
    plan = StepPlan()
    running = list(running)
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        n = min(req.num_new_tokens, budget)
        while not kv.allocate(req, n):
            victim = running[-1]  # the most recently admitted
            running.remove(victim)
            kv.free(victim)
            plan.preempted.append(victim)
            if victim is req:
                break
        else:
            plan.scheduled.append((req, n))
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
        plan.scheduled.append((req, n))
        budget -= n
    return plan


class BlockCounter:
    """The stage-4 exercise's ``kv``: a KV cache reduced to block counting, ``num_blocks`` blocks of
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


class PlanPolicy:
    """Continuous batching with a ``schedule_step``-shaped function: ``plan`` only decides; each step
    the scheduler runs it on its own requests through the plan adapter (``StepKV``), which applies it."""

    def __init__(self, step_fn=schedule_step):
        if not callable(step_fn):
            raise TypeError(f"scheduler_cls must be a schedule_step-like function, an object with plan(...) or a "
                            f"Scheduler subclass; got {type(step_fn).__name__}")
        self.step_fn = step_fn

    def plan(self, running, waiting, budget: int, max_num_seqs: int, kv) -> StepPlan:
        return self.step_fn(running, waiting, budget, max_num_seqs, kv)


def priority_key(seq) -> tuple:
    """vLLM v1's order of requests under the priority policy: lower ``priority`` first, then earlier arrival."""
    return seq.priority, seq.times.arrival


# -- the waiting-order seam: who the step reads first -----------------------------------------------------
class FcfsOrder:
    """``scheduling_policy="fcfs"`` (vLLM's default): the queue as it stands, arrival order (a preempted request goes
    back to the front), and running requests in admission order. The contract is ``tinypaged.interfaces.WaitingOrder``:
    ``waiting_order(scheduler)`` gives the waiting sequences in the order the step reads them (those still to arrive
    last), ``rank_running(requests)`` the running ones in the order they take the budget (the last one is the
    step's first victim)."""

    def waiting_order(self, sched):
        return sched.waiting

    def rank_running(self, running: list) -> list:
        return running


class PriorityOrder(FcfsOrder):
    """``scheduling_policy="priority"``: requests ranked by ``priority_key``, lower first. ``waiting_order`` ranks the
    arrived waiting sequences (a stable sort: equal keys keep queue order, so a preempted request goes back before
    its equals, as under fcfs); ``rank_running`` ranks the running ones, so the step preempts the lowest-priority,
    latest-arrived running request first. Swapped groups (``preemption_mode="swap"``, vLLM v0's, which had no
    priority policy) still resume before any waiting request."""

    def waiting_order(self, sched):
        queue = list(sched.waiting)
        arrived = [s for s in queue if sched.arrived(s)]
        if len(arrived) < 2:
            return sched.waiting
        return sorted(arrived, key=priority_key) + [s for s in queue if not sched.arrived(s)]

    def rank_running(self, running: list) -> list:
        return sorted(running, key=lambda r: priority_key(r.seqs[0]))  # the adapter's QueuedRequest
