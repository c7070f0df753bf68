"""Stage 1: the naive contiguous KV cache, as serving systems worked before vLLM.

Every request gets ONE contiguous region of the KV arena, reserved up front for the longest it
could become. How long that is depends on the reservation policy the vLLM paper compares:

* ``max``    reserve ``max_model_len`` tokens (FasterTransformer-style: the length is unknown),
* ``pow2``   reserve the next power of two of the final length (Orca "Pow2"),
* ``oracle`` reserve exactly the final length (Orca "Oracle": an impossible, perfect guess).

Placement is first-fit over the free holes, so external fragmentation is real: the arena can
have enough free tokens in total and still no hole large enough for the next request.

The engine knows a request's final length only as ``prompt + max_tokens`` (it cannot see the
future); the trace simulator in ``tinypaged.lab.memory_sim`` knows the true lengths.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

POLICIES = ("max", "pow2", "oracle")


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def reservation_tokens(policy: str, final_len: int, max_model_len: int) -> int:
    """How many tokens of arena a request reserves when it is admitted."""
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return min(next_power_of_two(final_len), max_model_len)
    if policy == "oracle":
        return min(final_len, max_model_len)
    raise ValueError(f"Unknown reservation policy {policy!r}; choose one of {POLICIES}")


def free_holes(regions: list[tuple[int, int]], capacity: int) -> list[tuple[int, int]]:
    """The free gaps between ``regions`` ((start, size) pairs sorted by start) as (start, size), in address order."""
    gaps, cursor = [], 0
    for start, size in regions:
        if start > cursor:
            gaps.append((cursor, start - cursor))
        cursor = start + size
    if cursor < capacity:
        gaps.append((cursor, capacity - cursor))
    return gaps


def first_fit(holes: list[tuple[int, int]], size: int) -> int | None:
    """Start of the first hole (in address order) with room for ``size`` slots; None when none has.

    None can happen while the holes add up to far more than ``size``: that is external fragmentation.
    """
    for start, gap in holes:
        if gap >= size:
            return start
    return None


@dataclass
class Region:
    start: int
    size: int
    owner: object


class ContiguousArena:
    """A 1-D arena of ``capacity`` token slots; regions are placed first-fit and never move.

    Invariant: ``regions`` is sorted by start and no two regions overlap; everything else is free.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"The KV arena needs at least one token of capacity, got {capacity}")
        self.capacity = capacity
        self.regions: list[Region] = []

    def holes(self) -> list[tuple[int, int]]:
        """Free gaps as (start, size), in address order."""
        return free_holes([(r.start, r.size) for r in self.regions], self.capacity)

    def first_fit(self, size: int) -> int | None:
        return first_fit(self.holes(), size)

    def allocate(self, size: int, owner: object) -> int | None:
        """Reserve ``size`` contiguous slots; None when no single hole is large enough."""
        start = self.first_fit(size)
        if start is None:
            return None
        region = Region(start, size, owner)
        bisect.insort(self.regions, region, key=lambda r: r.start)
        return start

    def free(self, owner: object) -> None:
        """Release ``owner``'s region; its slots merge with any neighbouring holes (regions never move)."""
        self.regions = [r for r in self.regions if r.owner is not owner]

    @property
    def reserved(self) -> int:
        return sum(r.size for r in self.regions)

    @property
    def free_tokens(self) -> int:
        return self.capacity - self.reserved

    @property
    def largest_hole(self) -> int:
        return max((size for _, size in self.holes()), default=0)


class ContiguousKVManager:
    """The engine's stage-1 KV manager: one reserved region per sequence, slot = start + position.

    Implements ``tinypaged.interfaces.KVCacheManager`` with blocks of one token. It alone owns the
    regions (``region(seq)``); it never changes a sequence.
    """

    block_size = 1

    def __init__(self, capacity_tokens: int, policy: str, max_model_len: int):
        if policy not in POLICIES:
            raise ValueError(f"Unknown reservation policy {policy!r}; choose one of {POLICIES}")
        self.arena = ContiguousArena(capacity_tokens)
        self.policy = policy
        self.max_model_len = max_model_len
        self.regions: dict[int, tuple[int, int]] = {}  # seq_id -> (start, reserved tokens)
        self.live: dict[int, object] = {}
        self._reserved = 0

    @classmethod
    def from_spec(cls, spec) -> "ContiguousKVManager":
        return cls(spec.capacity_tokens, spec.reservation_policy, spec.max_model_len)

    @property
    def capacity_tokens(self) -> int:
        return self.arena.capacity

    @property
    def usage(self) -> float:
        return self._reserved / self.arena.capacity

    def reservation_for(self, seq) -> int:
        return reservation_tokens(self.policy, seq.max_total_tokens(self.max_model_len), self.max_model_len)

    def max_tokens_needed(self, seq) -> int:
        return self.reservation_for(seq)

    def region(self, seq) -> tuple[int, int] | None:
        return self.regions.get(seq.seq_id)

    def get_computed_blocks(self, seq) -> list:
        return []  # no prefix caching in stage 1

    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks=()) -> bool:
        """Reserve the region on first call; later calls only check the reservation holds the tokens."""
        region = self.regions.get(seq.seq_id)
        if region is None:
            size = self.reservation_for(seq)
            start = self.arena.allocate(size, seq)
            if start is None:
                return False
            region = self.regions[seq.seq_id] = (start, size)
            self.live[seq.seq_id] = seq
            self._reserved += size
        if seq.num_computed_tokens + num_new_tokens > region[1]:
            raise RuntimeError(f"sequence {seq.seq_id} outgrew its contiguous reservation of {region[1]} tokens")
        return True

    def free(self, seq) -> None:
        region = self.regions.pop(seq.seq_id, None)
        if region is not None:
            self.arena.free(seq)
            self.live.pop(seq.seq_id, None)
            self._reserved -= region[1]

    def slot_mapping(self, seq, start: int, end: int) -> list[int]:
        base = self.regions[seq.seq_id][0]
        return list(range(base + start, base + end))

    def context_slots(self, seqs, context_len: int) -> torch.Tensor:
        starts = torch.tensor([self.regions[s.seq_id][0] for s in seqs])
        return starts[:, None] + torch.arange(context_len)

    def stats(self) -> dict:
        used = sum(s.num_computed_tokens for s in self.live.values())  # slots whose K/V are written
        final = sum(min(s.max_total_tokens(self.max_model_len), self.regions[i][1]) for i, s in self.live.items())
        reserved = self._reserved
        return {
            "kv_capacity_tokens": self.arena.capacity,
            "kv_token_states": used,
            "kv_reserved_tokens": reserved,
            "kv_reservation_waste": final - used,  # held for tokens not generated yet
            "kv_internal_fragmentation": reserved - final,  # held beyond the final length, never used
            "kv_free_tokens": self.arena.capacity - reserved,
            "kv_largest_hole": self.arena.largest_hole,
            "kv_cache_usage": self.usage,
        }
