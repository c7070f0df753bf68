"""Replay a trace through a KV allocator, step by step, and account for every token slot.

This is the measurement behind the vLLM paper's Figure 2, without running a model. All requests
are queued at the start (arrival order = request id). Each step admits waiting requests first-come
first-served while memory allows (the head of the queue blocks the rest), every running request
grows by one token, and finished ones leave. Under paging a request that cannot get its next block
preempts the most recently admitted one (recompute, as vLLM does). At every step in which someone
is waiting, the arena's slots are split into five parts that add up to the whole arena:

* token states   - slots holding a token's keys and values (the useful part),
* reservation    - reserved for tokens the request will produce later (contiguous only),
* internal frag. - reserved beyond the request's final length (contiguous pow2/max), or the unused
                   tail of each sequence's last block (paged): allocated, never used,
* external frag. - free slots while the request at the head of the queue waits although the free
                   slots add up to its reservation: no single hole is large enough (contiguous only;
                   with equal-sized blocks every free block is usable),
* free           - free slots while the head request waits because even all of them together are
                   too few for it (headroom that the running requests' growth will use up).

Averages are taken over these "busy" steps, when memory is what limits the batch: the tail of the
run, when the queue is empty and the last requests drain, says nothing about the allocator.
``utilization`` is token states / allocated slots (what the allocated memory is used for);
``token_states`` is token states / all slots, the figure the paper quotes (20.4%-38.2% before
vLLM, 96.3% with it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tinypaged.block_manager import BlockPool, blocks_needed
from tinypaged.contiguous import ContiguousArena, reservation_tokens
from tinypaged.lab.workloads import TraceRequest

# Slot states in a memory map (``memory_map``): one small integer per token slot.
FREE, TOKEN, RESERVED, INTERNAL, EXTERNAL = 0, 1, 2, 3, 4
SLOT_STATES = ("free", "token state", "reservation", "internal frag.", "external frag.")


@dataclass
class MemoryReport:
    name: str
    capacity_tokens: int
    steps: int
    busy_steps: int  # steps with a request waiting: the averages below are over these
    token_states: float  # fractions of the arena; the five of them add up to 1
    reservation: float
    internal_fragmentation: float
    external_fragmentation: float
    free: float
    utilization: float  # token states / allocated slots (reserved regions or allocated blocks)
    mean_resident: float  # requests holding memory at once
    theory_utilization: float | None = None  # paged: tokens / (tokens + live * (block_size - 1) / 2)
    preemptions: int = 0


class _ContiguousPolicy:
    """One first-fit region per request, sized by the reservation policy from the TRUE final length."""

    def __init__(self, capacity: int, policy: str, max_model_len: int):
        self.arena = ContiguousArena(capacity)
        self.capacity = capacity
        self.policy, self.max_model_len = policy, max_model_len
        self.reserved: dict[int, int] = {}

    def need(self, req: TraceRequest, length: int) -> int:
        return reservation_tokens(self.policy, req.total_len, self.max_model_len)

    def admit(self, req: TraceRequest, length: int) -> bool:
        size = self.need(req, length)
        if self.arena.allocate(size, req) is None:
            return False
        self.reserved[req.request_id] = size
        return True

    def grow(self, req: TraceRequest, length: int) -> bool:
        return True  # the region was reserved for the whole request

    def free(self, req: TraceRequest) -> None:
        self.arena.free(req)
        del self.reserved[req.request_id]

    def account(self, running: dict[int, tuple[TraceRequest, int]]) -> dict:
        tokens = sum(length for _, length in running.values())
        final = sum(min(r.total_len, self.reserved[r.request_id]) for r, _ in running.values())
        reserved = sum(self.reserved.values())
        return {"tokens": tokens, "reservation": final - tokens, "internal": reserved - final, "allocated": reserved}

    def slot_map(self, running) -> list[int]:
        slots = [FREE] * self.capacity
        for region in self.arena.regions:
            req = region.owner
            length = running[req.request_id][1]
            final = min(req.total_len, region.size)
            for i in range(region.size):
                slots[region.start + i] = TOKEN if i < length else RESERVED if i < final else INTERNAL
        return slots


class _PagedPolicy:
    """Blocks allocated one at a time as a request grows; waste is only each last block's tail."""

    def __init__(self, capacity: int, block_size: int):
        self.pool = BlockPool(capacity // block_size)
        self.block_size = block_size
        self.capacity = self.pool.num_blocks * block_size
        self.tables: dict[int, list] = {}

    def need(self, req: TraceRequest, length: int) -> int:
        return blocks_needed(length, self.block_size) * self.block_size

    def _ensure(self, req: TraceRequest, length: int) -> bool:
        table = self.tables.setdefault(req.request_id, [])
        need = blocks_needed(length, self.block_size) - len(table)
        if need > self.pool.num_free:
            return False
        table.extend(self.pool.allocate() for _ in range(need))
        return True

    def admit(self, req: TraceRequest, length: int) -> bool:
        if blocks_needed(length, self.block_size) > self.pool.num_free:
            return False
        return self._ensure(req, length)

    def grow(self, req: TraceRequest, length: int) -> bool:
        return self._ensure(req, length)

    def free(self, req: TraceRequest) -> None:
        self.pool.release(reversed(self.tables.pop(req.request_id, [])))

    def account(self, running) -> dict:
        tokens = sum(length for _, length in running.values())
        allocated = sum(len(t) for t in self.tables.values()) * self.block_size
        return {"tokens": tokens, "reservation": 0, "internal": allocated - tokens, "allocated": allocated}

    def slot_map(self, running) -> list[int]:
        slots = [FREE] * self.capacity
        for rid, table in self.tables.items():
            length = running[rid][1]
            for i, block in enumerate(table):
                for j in range(self.block_size):
                    slots[block.block_id * self.block_size + j] = TOKEN if i * self.block_size + j < length else INTERNAL
        return slots


def _make_allocator(capacity_tokens, kv_cache, policy, block_size, max_model_len):
    if kv_cache == "paged":
        return _PagedPolicy(capacity_tokens, block_size)
    if kv_cache == "contiguous":
        return _ContiguousPolicy(capacity_tokens, policy, max_model_len)
    raise ValueError(f"kv_cache={kv_cache!r}: use 'contiguous' or 'paged'")


def replay(trace: list[TraceRequest], capacity_tokens: int, kv_cache: str = "paged", policy: str = "max",
           block_size: int = 16, max_model_len: int = 2048):
    """Replay ``trace`` step by step; yields ``(allocator, running, waiting)`` once per step, after
    admission and before the step's tokens are added (the moment the memory is accounted)."""
    alloc = _make_allocator(capacity_tokens, kv_cache, policy, block_size, max_model_len)
    for r in trace:
        if alloc.need(r, r.total_len) > alloc.capacity:
            raise ValueError(f"trace request {r.request_id} (needs {alloc.need(r, r.total_len)} tokens) can never "
                             f"fit in {alloc.capacity} tokens")
    alloc.preemptions = 0
    waiting: deque[tuple[TraceRequest, int]] = deque((r, r.prompt_len) for r in trace)
    running: dict[int, tuple[TraceRequest, int]] = {}  # insertion order = admission order
    while waiting or running:
        while waiting and alloc.admit(waiting[0][0], waiting[0][1] + 1):
            req, length = waiting.popleft()
            running[req.request_id] = (req, length + 1)  # the prefill step also yields the first token
        yield alloc, running, waiting
        for rid in list(running):
            if rid not in running:  # preempted earlier in this step
                continue
            req, length = running[rid]
            if length >= req.total_len:
                alloc.free(req)
                del running[rid]
                continue
            while not alloc.grow(req, length + 1):
                victim_id = next(reversed(running))  # the most recently admitted request
                victim, vlen = running.pop(victim_id)
                alloc.free(victim)
                waiting.appendleft((victim, vlen))  # recompute: keeps its tokens, frees its memory
                alloc.preemptions += 1
                if victim_id == rid:
                    break
            else:
                running[rid] = (req, length + 1)


def simulate(trace: list[TraceRequest], capacity_tokens: int, kv_cache: str = "paged", policy: str = "max",
             block_size: int = 16, max_model_len: int = 2048, name: str | None = None) -> MemoryReport:
    """Replay ``trace`` (all requests queued at the start) through one allocator of ``capacity_tokens``
    and average the split of the arena over the busy steps (see the module docstring)."""
    sums = dict(tokens=0.0, reservation=0.0, internal=0.0, external=0.0, free=0.0, util=0.0, resident=0.0,
                theory=0.0)
    steps = busy = 0
    alloc = None
    for alloc, running, waiting in replay(trace, capacity_tokens, kv_cache, policy, block_size, max_model_len):
        steps += 1
        if not waiting:
            continue
        busy += 1
        cap = alloc.capacity
        a = alloc.account(running)
        free = cap - a["allocated"]
        head, head_len = waiting[0]
        scattered = free >= alloc.need(head, head_len + 1)  # enough in total, but no hole fits
        sums["tokens"] += a["tokens"] / cap
        sums["reservation"] += a["reservation"] / cap
        sums["internal"] += a["internal"] / cap
        sums["external" if scattered else "free"] += free / cap
        sums["util"] += a["tokens"] / a["allocated"] if a["allocated"] else 0.0
        sums["resident"] += len(running)
        expected_waste = len(running) * (block_size - 1) / 2
        sums["theory"] += a["tokens"] / (a["tokens"] + expected_waste) if a["tokens"] else 0.0
    b = max(busy, 1)
    return MemoryReport(
        name=name or (f"paged (block {block_size})" if kv_cache == "paged" else f"contiguous {policy}"),
        capacity_tokens=alloc.capacity, steps=steps, busy_steps=busy,
        token_states=sums["tokens"] / b, reservation=sums["reservation"] / b,
        internal_fragmentation=sums["internal"] / b, external_fragmentation=sums["external"] / b,
        free=sums["free"] / b, utilization=sums["util"] / b, mean_resident=sums["resident"] / b,
        theory_utilization=sums["theory"] / b if kv_cache == "paged" else None, preemptions=alloc.preemptions,
    )


def memory_map(trace: list[TraceRequest], capacity_tokens: int, kv_cache: str = "contiguous", policy: str = "max",
               block_size: int = 16, max_model_len: int = 2048, max_steps: int | None = None) -> list[list[int]]:
    """The arena slot by slot, one row per step: FREE, TOKEN, RESERVED, INTERNAL or EXTERNAL (free
    slots while the head request waits although they add up to its reservation). For plots."""
    rows = []
    for alloc, running, waiting in replay(trace, capacity_tokens, kv_cache, policy, block_size, max_model_len):
        if max_steps is not None and len(rows) >= max_steps:
            break
        row = alloc.slot_map(running)
        if waiting and row.count(FREE) >= alloc.need(waiting[0][0], waiting[0][1] + 1):
            row = [EXTERNAL if s == FREE else s for s in row]
        rows.append(row)
    return rows


def compare_policies(trace, capacity_tokens: int, block_size: int = 16, max_model_len: int = 2048) -> list[MemoryReport]:
    """The paper's comparison on one trace and one byte budget: three contiguous policies and paging."""
    reports = [simulate(trace, capacity_tokens, "contiguous", p, max_model_len=max_model_len) for p in ("max", "pow2", "oracle")]
    reports.append(simulate(trace, capacity_tokens, "paged", block_size=block_size, max_model_len=max_model_len))
    return reports


def format_reports(reports: list[MemoryReport]) -> str:
    """A fixed-width table; every figure is a share of the whole arena except util (share of allocated)."""
    head = (f"{'allocator':<20}{'tokens':>8}{'reserv.':>9}{'int.frag':>9}{'ext.frag':>9}{'free':>7}"
            f"{'util':>8}{'resident':>10}")
    lines = [head, "-" * len(head)]
    for r in reports:
        lines.append(f"{r.name:<20}{r.token_states:>8.1%}{r.reservation:>9.1%}{r.internal_fragmentation:>9.1%}"
                     f"{r.external_fragmentation:>9.1%}{r.free:>7.1%}{r.utilization:>8.1%}{r.mean_resident:>10.1f}")
    return "\n".join(lines)
