"""Stage 1: the naive contiguous KV cache, as serving systems worked before vLLM.

Every request gets ONE contiguous region of the KV arena, reserved up front for the longest it
could become. How long that is depends on the reservation policy the vLLM paper compares:

* ``max``    reserve ``max_model_len`` tokens (FasterTransformer-style: the length is unknown),
* ``pow2``   reserve the next power of two of the final length (Orca "Pow2"),
* ``oracle`` reserve exactly the final length (Orca "Oracle": an impossible, perfect guess).

Placement is first-fit over the free holes, so external fragmentation is real: the arena can
have enough free tokens in total and still no hole large enough for the next request.

The engine knows a request's final length only as ``prompt + max_tokens`` (it cannot see the
future); the trace replay in ``tinypaged.lab.memory_sim`` sets ``max_tokens`` to each request's true
output length, so there the reservation policies see the true lengths.
"""

from __future__ import annotations

import torch

POLICIES = ("max", "pow2", "oracle")


def reservation_tokens(policy: str, final_len: int, max_model_len: int) -> int:
    """How many tokens of arena a request reserves when it is admitted."""
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        size = 1
        while size < final_len:
            size *= 2
        return min(size, max_model_len)
    if policy == "oracle":
        return min(final_len, max_model_len)
    raise ValueError(f"unknown reservation policy {policy!r}: choose 'max', 'pow2' or 'oracle'")


def free_holes(regions: list[tuple[int, int]], capacity: int) -> list[tuple[int, int]]:
    """The free gaps between ``regions`` ((start, size) pairs sorted by start) as (start, size), in address order."""
    holes, cursor = [], 0
    for start, size in regions:
        if start > cursor:
            holes.append((cursor, start - cursor))
        cursor = start + size
    if cursor < capacity:
        holes.append((cursor, capacity - cursor))
    return holes


def first_fit(holes: list[tuple[int, int]], size: int) -> int | None:
    """Start of the first hole (in address order) with room for ``size`` slots; None when none has.

    None can happen while the holes add up to far more than ``size``: that is external fragmentation.
    """
    for start, gap in holes:
        if gap >= size:
            return start
    return None


class ContiguousAllocator:
    """One contiguous region per sequence (any hashable id), placed first-fit, sized by the reservation
    policy from the final length it is told. The stage-1 assignment's allocator, and the engine's.

    Invariant: regions never overlap and never move; everything outside them is free.
    """

    def __init__(self, capacity: int, policy: str, max_model_len: int):
        reservation_tokens(policy, 1, max_model_len)  # an unknown policy raises now, not at first use
        self.capacity, self.policy, self.max_model_len = capacity, policy, max_model_len
        self.regions = {}  # seq_id -> (start, size, final_len)

    def holes(self) -> list[tuple[int, int]]:
        """Free gaps as (start, size), in address order."""
        return free_holes(sorted((start, size) for start, size, _ in self.regions.values()), self.capacity)

    def allocate(self, seq_id, final_len: int) -> int | None:
        """Reserve a region for ``final_len`` tokens; its start, or None (and no change) when no hole fits."""
        if seq_id in self.regions:
            raise ValueError(f"sequence {seq_id!r} already holds a region")
        size = reservation_tokens(self.policy, final_len, self.max_model_len)
        start = first_fit(self.holes(), size)
        if start is not None:
            self.regions[seq_id] = (start, size, final_len)
        return start

    def free(self, seq_id) -> None:
        """Release the region; its slots merge with any neighbouring holes (the other regions stay put)."""
        del self.regions[seq_id]

    def slot(self, seq_id, position: int) -> int:
        start, size, _ = self.regions[seq_id]
        if not 0 <= position < size:
            raise IndexError(f"position {position} is outside the region of {size} slots of {seq_id!r}")
        return start + position

    def usage(self, written: dict) -> dict:
        """Where the slots go, given how many tokens each sequence has written:
        reserved = token_states + reservation_waste + internal_fragmentation."""
        reserved = sum(size for _, size, _ in self.regions.values())
        will_hold = sum(min(final, size) for _, size, final in self.regions.values())
        states = sum(written.get(seq_id, 0) for seq_id in self.regions)
        return {
            "reserved": reserved,
            "token_states": states,
            "reservation_waste": will_hold - states,
            "internal_fragmentation": reserved - will_hold,
            "free": self.capacity - reserved,
            "largest_hole": max((size for _, size in self.holes()), default=0),
        }


class ContiguousKVManager:
    """The engine's stage-1 KV manager: a region per sequence from a ``ContiguousAllocator``, slot = start + position.

    Implements ``tinypaged.interfaces.KVCacheManager`` with blocks of one token. It uses only the allocator's
    methods of the stage-1 assignment (``allocate``, ``free``, ``slot``, ``usage``) and sizes regions with
    ``reservation`` (``reservation_tokens``), so a learner's allocator and function drop in (``factory``).
    It never changes a sequence. A sequence's final length, as far as the engine can know it, is
    ``prompt + max_tokens`` (capped at ``max_model_len``).
    """

    block_size = 1
    layout = "contiguous"  # the KV tensors as one arena of token slots (EngineConfig.kv_layout reads it)

    def __init__(self, capacity_tokens: int, policy: str, max_model_len: int, allocator=None,
                 reservation=reservation_tokens):
        if capacity_tokens < 1:
            raise ValueError(f"the contiguous KV cache needs kv_cache_tokens >= 1, got {capacity_tokens}")
        if policy not in POLICIES:
            raise ValueError(f"unknown reservation_policy {policy!r}: choose one of {POLICIES}")
        self.capacity_tokens, self.policy, self.max_model_len = capacity_tokens, policy, max_model_len
        self.allocator = ContiguousAllocator(capacity_tokens, policy, max_model_len) if allocator is None else allocator
        self.reservation = reservation
        self.live: dict[int, tuple] = {}  # seq_id -> (the sequence holding a region, the region's size)
        self.reserved = 0  # slots in live regions, kept so usage is O(1)

    @classmethod
    def from_spec(cls, spec) -> "ContiguousKVManager":
        return cls(spec.capacity_tokens, spec.reservation_policy, spec.max_model_len)

    @classmethod
    def factory(cls, allocator_cls=ContiguousAllocator, reservation=reservation_tokens):
        """``LLM(kv_cache_manager=ContiguousKVManager.factory(ContiguousAllocator, reservation_tokens))``: the
        engine's manager over the given allocator class and reservation function (the stage-1 assignment's)."""
        def build(spec):
            allocator = allocator_cls(spec.capacity_tokens, spec.reservation_policy, spec.max_model_len)
            return cls(spec.capacity_tokens, spec.reservation_policy, spec.max_model_len, allocator, reservation)
        build.layout = cls.layout
        return build

    @property
    def usage(self) -> float:
        return self.reserved / self.capacity_tokens

    def final_len(self, seq) -> int:
        return seq.max_total_tokens(self.max_model_len)

    def max_tokens_needed(self, seq) -> int:
        return self.reservation(self.policy, self.final_len(seq), self.max_model_len)

    def region(self, seq) -> tuple[int, int] | None:
        """(start, reserved tokens) of ``seq``'s region, or None."""
        if seq.seq_id not in self.live:
            return None
        return self.allocator.slot(seq.seq_id, 0), self.live[seq.seq_id][1]

    def get_computed_blocks(self, seq) -> list:
        return []  # no prefix caching in stage 1

    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks=()) -> bool:
        """Reserve the region on first call; later calls only check the reservation holds the tokens."""
        if seq.seq_id not in self.live:
            if self.allocator.allocate(seq.seq_id, self.final_len(seq)) is None:
                return False
            self.live[seq.seq_id] = (seq, self.max_tokens_needed(seq))
            self.reserved += self.live[seq.seq_id][1]
        size = self.live[seq.seq_id][1]
        if seq.num_computed_tokens + num_new_tokens > size:
            raise RuntimeError(f"sequence {seq.seq_id} outgrew its contiguous reservation of {size} tokens")
        return True

    def free(self, seq) -> None:
        held = self.live.pop(seq.seq_id, None)
        if held is not None:
            self.allocator.free(seq.seq_id)
            self.reserved -= held[1]

    def slot_mapping(self, seq, start: int, end: int) -> list[int]:
        base = self.allocator.slot(seq.seq_id, 0)
        return list(range(base + start, base + end))

    def context_slots(self, seqs, context_len: int) -> torch.Tensor:
        starts = torch.tensor([self.allocator.slot(s.seq_id, 0) for s in seqs])
        return starts[:, None] + torch.arange(context_len)

    def stats(self) -> dict:
        u = self.allocator.usage({i: s.num_computed_tokens for i, (s, _) in self.live.items()})  # slots written
        return {
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_token_states": u["token_states"],
            "kv_reserved_tokens": u["reserved"],
            "kv_reservation_waste": u["reservation_waste"],  # held for tokens not generated yet
            "kv_internal_fragmentation": u["internal_fragmentation"],  # held beyond the final length, never used
            "kv_free_tokens": u["free"],
            "kv_largest_hole": u["largest_hole"],
            "kv_cache_usage": self.usage,
        }
