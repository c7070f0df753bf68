"""Preemption (stage 4): a running sequence gives its KV memory back, by recompute (vLLM v1) or by swapping
to CPU memory with its running siblings (vLLM v0); a preempted group goes back to the front of its queue.
Functions of the scheduler's state, called by the scheduler and its plan adapter (``StepKV``) only; each comes in
two halves, memory (``release``, ``swap_in``) and queues (``settle``, ``resume``), so that the adapter changes the
queues once, after the step has decided.

Swapping here only decides: the KV manager picks the blocks and records the data moves, which the scheduler
hands the worker in the step's ``SchedulerOutput`` (``blocks_to_swap_out`` / ``blocks_to_swap_in``); the
worker makes them before the step's forward. Nothing in ``tinypaged.sched`` touches KV data.
"""

from __future__ import annotations

import logging

from tinypaged.sequence import Sequence, SequenceStatus

logger = logging.getLogger("tinypaged")


def recompute_stuck_swapped(sched) -> None:
    """A swapped group that does not fit back even with nothing running (siblings that outgrew
    the cache side by side) would wait forever: recompute its sequences one by one instead
    (course-only; vLLM v0 failed such a request)."""
    if sched.running or not sched.swapped:
        return
    group = sched.swapped[0]
    if sched.kv.can_swap_in(group, max(s.num_uncomputed_tokens for s in group)):
        return
    sched.swapped.popleft()
    for s in group:
        sched.kv.free(s)  # drops its CPU copy
        s.num_computed_tokens, s.status = 0, SequenceStatus.WAITING
    sched.waiting.extendleft(reversed(group))
    logger.warning("Swapped-out request %s (%d sequences) cannot fit back together even in an empty cache: "
                   "recomputing its sequences one by one", group[0].request_id, len(group))


def preempt(sched, seq: Sequence) -> list[Sequence]:
    """Preempt ``seq`` now (a scheduler acting by itself, ``Scheduler.preempt``): ``release`` its memory, ``settle``
    the queues, and put the group back at the front of its queue. Returns who was preempted."""
    group, swapped = release(sched, seq)
    settle(sched, group, swapped)
    requeue_group(sched, group)
    return group


def release(sched, seq: Sequence, gone=frozenset()) -> tuple[list[Sequence], bool]:
    """The memory side of preempting running ``seq``, touching no queue: swap (vLLM v0, ``preemption_mode="swap"``)
    moves it and its running siblings to CPU memory together, so blocks they share stay shared; recompute (vLLM v1,
    or when the swap space is full) frees its blocks and keeps its tokens. ``gone``: ids of sequences already
    released in this step (still in ``running`` until the step settles). Returns ``(group, swapped)``."""
    siblings = [s for s in sched.running if s.request_id == seq.request_id and s.seq_id not in gone]
    swap = sched.config.preemption_mode == "swap" and sched.kv.can_swap_out(siblings)
    group = siblings if swap else [seq]
    if swap:
        sched.kv.swap_out(group)  # the data moves go to the step's output
    else:
        sched.kv.free(seq)
    return group, swap


def settle(sched, group: list[Sequence], swapped: bool) -> None:
    """The queue side of a preemption ``release`` made: the group leaves ``running``, SWAPPED (its KV on the CPU) or
    WAITING with nothing computed (recompute)."""
    for s in group:
        sched.running.remove(s)
        sched.num_preemptions += 1
        s.num_preemptions += 1
        if swapped:
            s.status = SequenceStatus.SWAPPED
        else:
            s.num_computed_tokens = 0
            s.status = SequenceStatus.WAITING
    seq = group[0]
    how = (f"swapped {len(group)} sequence(s) to CPU memory" if swapped else
           f"freed its blocks; {len(seq)} tokens will be recomputed")
    logger.warning("Preempted sequence %d (request %s): %s. Total preemptions: %d",
                   seq.seq_id, seq.request_id, how, sched.num_preemptions)


def requeue_group(sched, group: list[Sequence]) -> None:
    """A preempted group goes to the front of its queue: first to swap back in, or to recompute."""
    if group[0].status is SequenceStatus.SWAPPED:
        sched.swapped.appendleft(group)
    else:
        sched.waiting.extendleft(reversed(group))


def swap_in(sched, group: list[Sequence], num_new_tokens: int = 1) -> bool:
    """The memory side of bringing a swapped group back (all or nothing), with room for each one's next tokens;
    ``resume`` then puts it back in ``running``."""
    if not sched.kv.can_swap_in(group, num_new_tokens):
        return False
    sched.kv.swap_in(group)  # the data moves go to the step's output
    return True


def resume(sched, group: list[Sequence]) -> None:
    """A group swapped back in leaves ``swapped`` and runs again."""
    sched.swapped.remove(group)
    for s in group:
        sched.start_running(s)
