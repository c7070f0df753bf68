"""Replay a trace through a KV allocator, step by step, and account for every token slot.

This is the measurement behind the vLLM paper's Figure 2, without running a model: each step
admits waiting requests in arrival order while memory allows, every running request grows by
one token, and finished ones leave. At every step the arena's slots are split into

* token states       - slots holding a token's keys and values (useful),
* reservation        - reserved for tokens the request will produce later (contiguous only),
* internal frag.     - reserved beyond the request's final length, or the unused tail of the last
                       block (paged), never used,
* external frag.     - free slots while a request waits because no hole is large enough,
* free               - free slots while nobody waits.

Figures are averaged over the steps in which requests are waiting (the memory-bound period).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tinypaged.block_manager import BlockPool, blocks_needed
from tinypaged.contiguous import ContiguousArena, reservation_tokens
from tinypaged.workloads import TraceRequest


@dataclass
class MemoryReport:
    name: str
    capacity_tokens: int
    steps: int
    busy_steps: int
    token_states: float  # fractions of the arena, averaged over busy steps
    reservation: float
    internal_fragmentation: float
    external_fragmentation: float
    free: float
    utilization: float  # token states / allocated (reserved regions or allocated blocks)
    mean_resident: float  # requests holding memory at once, averaged over busy steps
    theory_utilization: float | None = None  # paged: tokens / (tokens + live * (block_size - 1) / 2)
    preemptions: int = 0


class _ContiguousPolicy:
    def __init__(self, capacity: int, policy: str, max_model_len: int):
        self.arena = ContiguousArena(capacity)
        self.policy, self.max_model_len = policy, max_model_len
        self.reserved: dict[int, int] = {}

    def admit(self, req: TraceRequest, length: int) -> bool:
        size = reservation_tokens(self.policy, req.total_len, self.max_model_len)
        if self.arena.allocate(size, req.request_id) is None:
            return False
        self.reserved[req.request_id] = size
        return True

    def grow(self, req: TraceRequest, length: int) -> bool:
        return True  # the region was reserved for the whole request

    def free(self, req: TraceRequest) -> None:
        self.arena.free(req.request_id)
        del self.reserved[req.request_id]

    def account(self, running: dict[int, tuple[TraceRequest, int]]) -> dict:
        tokens = sum(length for _, length in running.values())
        final = sum(min(r.total_len, self.reserved[r.request_id]) for r, _ in running.values())
        reserved = sum(self.reserved.values())
        return {"tokens": tokens, "reservation": final - tokens, "internal": reserved - final, "allocated": reserved}


class _PagedPolicy:
    def __init__(self, capacity: int, block_size: int):
        self.pool = BlockPool(capacity // block_size)
        self.block_size = block_size
        self.tables: dict[int, list] = {}

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


def simulate(trace: list[TraceRequest], capacity_tokens: int, kv_cache: str = "paged", policy: str = "max",
             block_size: int = 16, max_model_len: int = 2048, name: str | None = None) -> MemoryReport:
    """Replay ``trace`` (all requests queued at the start) through one allocator of ``capacity_tokens``."""
    if kv_cache == "paged":
        alloc = _PagedPolicy(capacity_tokens, block_size)
        cap = alloc.pool.num_blocks * block_size
    else:
        alloc = _ContiguousPolicy(capacity_tokens, policy, max_model_len)
        cap = capacity_tokens
    for r in trace:
        if r.total_len > cap or (kv_cache == "contiguous" and reservation_tokens(policy, r.total_len, max_model_len) > cap):
            raise ValueError(f"trace request {r.request_id} ({r.total_len} tokens) can never fit in {cap} tokens")
    waiting: deque[tuple[TraceRequest, int]] = deque((r, r.prompt_len) for r in trace)
    running: dict[int, tuple[TraceRequest, int]] = {}  # insertion order = admission order
    sums = dict(tokens=0.0, reservation=0.0, internal=0.0, external=0.0, free=0.0, util=0.0, resident=0.0, theory=0.0)
    steps = busy = preemptions = 0
    while waiting or running:
        while waiting and alloc.admit(waiting[0][0], waiting[0][1] + 1):
            req, length = waiting.popleft()
            running[req.request_id] = (req, length + 1)  # the prefill step also yields the first token
        steps += 1
        if waiting:
            busy += 1
            a = alloc.account(running)
            free = cap - a["allocated"] - (0 if kv_cache == "paged" else 0)
            sums["tokens"] += a["tokens"] / cap
            sums["reservation"] += a["reservation"] / cap
            sums["internal"] += a["internal"] / cap
            sums["external"] += free / cap  # someone waits although these slots are free
            sums["util"] += a["tokens"] / a["allocated"] if a["allocated"] else 0.0
            sums["resident"] += len(running)
            expected_waste = len(running) * (block_size - 1) / 2
            sums["theory"] += a["tokens"] / (a["tokens"] + expected_waste) if a["tokens"] else 0.0
        for rid in list(running):
            if rid not in running:
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
                waiting.appendleft((victim, vlen))
                preemptions += 1
                if victim_id == rid:
                    break
            else:
                running[rid] = (req, length + 1)
    b = max(busy, 1)
    return MemoryReport(
        name=name or (f"paged (block {block_size})" if kv_cache == "paged" else f"contiguous {policy}"),
        capacity_tokens=cap, steps=steps, busy_steps=busy,
        token_states=sums["tokens"] / b, reservation=sums["reservation"] / b,
        internal_fragmentation=sums["internal"] / b, external_fragmentation=sums["external"] / b,
        free=0.0 if busy else 1.0, utilization=sums["util"] / b, mean_resident=sums["resident"] / b,
        theory_utilization=sums["theory"] / b if kv_cache == "paged" else None, preemptions=preemptions,
    )


def compare_policies(trace, capacity_tokens: int, block_size: int = 16, max_model_len: int = 2048) -> list[MemoryReport]:
    """The paper's comparison on one trace and one byte budget: three contiguous policies and paging."""
    reports = [simulate(trace, capacity_tokens, "contiguous", p, max_model_len=max_model_len) for p in ("max", "pow2", "oracle")]
    reports.append(simulate(trace, capacity_tokens, "paged", block_size=block_size, max_model_len=max_model_len))
    return reports


def format_reports(reports: list[MemoryReport]) -> str:
    head = f"{'allocator':<22}{'tokens':>8}{'reserv.':>9}{'int.frag':>9}{'ext.frag':>9}{'util':>8}{'resident':>10}"
    lines = [head, "-" * len(head)]
    for r in reports:
        lines.append(f"{r.name:<22}{r.token_states:>8.1%}{r.reservation:>9.1%}{r.internal_fragmentation:>9.1%}"
                     f"{r.external_fragmentation:>9.1%}{r.utilization:>8.1%}{r.mean_resident:>10.1f}")
    return "\n".join(lines)
