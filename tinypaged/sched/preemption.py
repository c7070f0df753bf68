"""Preemption (stage 4): a running sequence gives its KV memory back, by recompute (vLLM v1) or by swapping
to CPU memory with its running siblings (vLLM v0); a preempted group goes back to the front of its queue.
Functions of the scheduler's state, called by the scheduler and its plan adapter (``StepKV``) only.

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


def preempt(sched, seq: Sequence, requeue: bool = True) -> list[Sequence]:
    """Take ``seq`` off the running list. Recompute (vLLM v1): free its blocks, keep its tokens,
    re-queue it at the front. Swap (vLLM v0, ``preemption_mode="swap"``): move it and its running
    siblings to CPU memory together, so blocks they share stay shared. Returns who was preempted;
    with ``requeue=False`` the caller puts them back with ``requeue_group`` later."""
    siblings = [s for s in sched.running if s.request_id == seq.request_id]
    swap = sched.config.preemption_mode == "swap" and sched.kv.can_swap_out(siblings)
    group = siblings if swap else [seq]
    for s in group:
        sched.running.remove(s)
        sched.num_preemptions += 1
        s.num_preemptions += 1
    if swap:
        sched.kv.swap_out(group)  # the data moves go to the step's output
        for s in group:
            s.status = SequenceStatus.SWAPPED
        how = f"swapped {len(group)} sequence(s) to CPU memory"
    else:
        sched.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        how = f"freed its blocks; {len(seq)} tokens will be recomputed"
    if requeue:
        requeue_group(sched, group)
    logger.warning("Preempted sequence %d (request %s): %s. Total preemptions: %d",
                   seq.seq_id, seq.request_id, how, sched.num_preemptions)
    return group


def requeue_group(sched, group: list[Sequence]) -> None:
    """A preempted group goes to the front of its queue: first to swap back in, or to recompute."""
    if group[0].status is SequenceStatus.SWAPPED:
        sched.swapped.appendleft(group)
    else:
        sched.waiting.extendleft(reversed(group))


def swap_in(sched, group: list[Sequence], num_new_tokens: int = 1) -> bool:
    """Bring a swapped group back (all or nothing), with room for each one's next tokens; it runs again."""
    if not sched.kv.can_swap_in(group, num_new_tokens):
        return False
    sched.kv.swap_in(group)  # the data moves go to the step's output
    sched.swapped.remove(group)
    for s in group:
        sched.start_running(s)
    return True
