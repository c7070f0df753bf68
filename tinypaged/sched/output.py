"""What the scheduler hands the model runner and the engine for one step (vLLM v1: ``sched/output.py``).

The scheduler produces one ``SchedulerOutput`` per step. The runner reads only its ``batch`` and its block
moves: plain data (``ScheduledChunk``: token ids, positions, slots, block ids or context slots, whether the
chunk samples; block id pairs to swap and copy), never a live ``Sequence`` and never the KV manager. The
engine reads ``scheduled`` (the sequences, in the same order) to advance progress, sample and report the
step. Nobody changes it after ``Scheduler.schedule`` has checked it (``check_schedule``).
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


@dataclass(frozen=True)
class ScheduledChunk:
    """What the model runner needs of one scheduled sequence, as data (vLLM v1's ``NewRequestData`` /
    ``CachedRequestData``): ``token_ids`` run through the model at positions ``start ..
    start + len(token_ids) - 1``; ``slot_mapping`` says where each one's keys and values go. The
    context (positions ``0 .. start + len(token_ids) - 1``) lives in ``block_ids`` (a paged manager's
    blocks, at least that many) or ``context_slots`` (one slot per context position: managers with
    ``context_slots``, or without ``block_ids``); the runner reads whichever its attention needs.
    ``samples``: the chunk reaches the sequence's end, so its last row's logits are sampled."""

    seq_id: int
    token_ids: list
    start: int
    slot_mapping: list
    is_prefill: bool
    samples: bool
    block_ids: list | None = None
    context_slots: object = None  # a list or a 1-D tensor of start + len(token_ids) slots

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step's batch, and the KV data the worker moves before it (vLLM v0's ``blocks_to_swap_out``,
    ``blocks_to_swap_in``, ``blocks_to_copy``).

    Invariants: a sequence appears in ``scheduled`` at most once; ``num_batched_tokens <=
    max_num_batched_tokens``; ``preempted`` lists the sequences preempted while this step was formed
    (recompute or swap), none of which is in ``scheduled``; ``num_idle_slots`` counts a static
    batch's members that have finished but still hold a batch slot (0 under continuous batching);
    ``batch`` is the runner's view of ``scheduled`` (one ``ScheduledChunk`` each, same order), made by
    the scheduler once the step is checked.

    The block moves are the KV manager's decisions of this step (``tinypaged.kv.block_moves``), as
    ``(from, to)`` block id pairs: ``blocks_to_swap_out`` (device block, CPU block) for swap preemption,
    ``blocks_to_swap_in`` (CPU block, device block) for a swapped group resuming, ``blocks_to_copy``
    (source, destination device blocks) for copy-on-write. The worker applies them before the forward
    (and in a step that runs nothing), in that order, each list as one batch: swap-outs first, so a device
    block freed by a swap-out can take a swap-in or a copy in the same step; copies last, so a block just
    swapped in can be copied. A destination appears once per list; no source is written by a later list.
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_idle_slots: int = 0
    batch: list[ScheduledChunk] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if not s.is_prefill)
