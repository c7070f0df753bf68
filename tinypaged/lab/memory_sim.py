"""Replay a trace through the engine's own scheduler and KV cache manager, and account for every slot.

This is the measurement behind the vLLM paper's Figure 2, without running a model: ``ModelFreeEngine``
(``tinypaged.lab.simulator``) builds the real ``Scheduler`` and the real ``ContiguousKVManager`` or
``BlockManager``, and each step stands in for the forward (every scheduled token is computed, every
sequence whose prompt is done gets a dummy token). All requests are queued at the start (arrival
order = request id) and each asks for exactly its trace output length (``max_tokens``, ``ignore_eos``),
so the contiguous policies reserve from the true final length. The engine's own rules then apply:
running requests first, then first-come-first-served admission while memory allows (the head of the
queue blocks the rest), and under paging a request that cannot get its next block preempts the most
recently admitted one (recompute, vLLM v1). Whole prompts are prefilled at once (no chunking) and no
token budget or ``max_num_seqs`` binds: memory is the only limit.

At every step in which someone is waiting, the arena's slots are split into five parts that add up to
the whole arena, counted once the scheduler has decided the step (after admission and allocation,
counting the keys and values this step's forward writes):

* token states   - slots holding a token's keys and values (the useful part),
* reservation    - reserved for tokens the request will produce later (contiguous only),
* internal frag. - reserved beyond the request's final length (contiguous pow2/max), or the unused
                   tail of each sequence's last block (paged): allocated, never used,
* external frag. - free slots while the request at the head of the queue waits although the free
                   slots add up to its reservation: no single hole is large enough (contiguous only;
                   with equal-sized blocks every free block is usable),
* free           - any other free slots while the head request waits (too few for it, or, paged, a
                   step that preempted and so admits nothing).

Averages are taken over these "busy" steps, when memory is what limits the batch: the tail of the
run, when the queue is empty and the last requests drain, says nothing about the allocator.
``utilization`` is token states / allocated slots (what the allocated memory is used for);
``token_states`` is token states / all slots, the figure the paper quotes (20.4%-38.2% before
vLLM, 96.3% with it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tinypaged.lab.serving import quiet
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


@dataclass(frozen=True)
class StepAccount:
    """One step's memory, in slots: ``tokens + reservation + internal == allocated <= capacity``."""

    capacity: int
    tokens: int
    reservation: int
    internal: int
    allocated: int
    resident: int  # requests holding memory
    waiting: int  # requests waiting (the step is "busy" when there are any)
    scattered: bool  # the head request waits although the free slots add up to what it needs


def _engine(trace, capacity_tokens, kv_cache, policy, block_size, max_model_len):
    from tinypaged.config import EngineConfig
    from tinypaged.lab.simulator import ModelFreeEngine

    num_seqs = max(len(trace), 1)
    config = EngineConfig(model="(memory replay)", device="cpu", kv_cache_manager=kv_cache, reservation_policy=policy,
                          block_size=block_size, kv_cache_tokens=capacity_tokens, max_model_len=max_model_len,
                          max_num_seqs=num_seqs, max_num_batched_tokens=max(capacity_tokens, max_model_len, num_seqs),
                          enable_chunked_prefill=False)
    eng = ModelFreeEngine(config)
    for r in trace:
        eng.add(str(r.request_id), [1] * r.prompt_len, r.output_len, 0.0)
    return eng


def _steps(trace, capacity_tokens, kv_cache, policy, block_size, max_model_len):
    """Run the engine; yields ``(engine, tokens after this step by seq_id, StepAccount)`` once per step."""
    eng = _engine(trace, capacity_tokens, kv_cache, policy, block_size, max_model_len)
    kv, sched = eng.kv, eng.scheduler
    contiguous = kv_cache == "contiguous"
    with quiet():
        while eng.has_unfinished():
            batch, _ = eng.schedule(0.0)
            tokens = {s.seq_id: s.num_computed_tokens for s in sched.running}
            tokens.update({item[0].seq_id: item[1] + item[2] for item in batch})  # (seq, start, num_tokens, ...)
            held = sum(tokens.values())
            scattered = False
            if contiguous:
                u = kv.allocator.usage(tokens)
                reservation, allocated = u["reservation_waste"], u["reserved"]
                scattered = bool(sched.waiting) and u["free"] >= kv.max_tokens_needed(sched.waiting[0])
            else:
                reservation, allocated = 0, (kv.num_blocks - kv.num_free_blocks) * kv.block_size
            yield eng, tokens, StepAccount(kv.capacity_tokens, held, reservation, allocated - held - reservation,
                                           allocated, len(sched.running), len(sched.waiting), scattered)
            eng.complete(0.0)


@functools.lru_cache(maxsize=16)
def _replayed(trace: tuple, capacity_tokens, kv_cache, policy, block_size, max_model_len):
    """Every step's account, and the preemptions (one replay per configuration: it is deterministic)."""
    accounts, eng = [], None
    for eng, _, account in _steps(trace, capacity_tokens, kv_cache, policy, block_size, max_model_len):
        accounts.append(account)
    return tuple(accounts), eng.num_preemptions if eng is not None else 0


def replay(trace: list[TraceRequest], capacity_tokens: int, kv_cache: str = "paged", policy: str = "max",
           block_size: int = 16, max_model_len: int = 2048):
    """Replay ``trace`` step by step through the engine; yields one ``StepAccount`` per step."""
    yield from _replayed(tuple(trace), capacity_tokens, kv_cache, policy, block_size, max_model_len)[0]


def simulate(trace: list[TraceRequest], capacity_tokens: int, kv_cache: str = "paged", policy: str = "max",
             block_size: int = 16, max_model_len: int = 2048, name: str | None = None) -> MemoryReport:
    """Replay ``trace`` (all requests queued at the start) through the engine with ``capacity_tokens`` of KV
    cache and average the split of the arena over the busy steps (see the module docstring)."""
    accounts, preemptions = _replayed(tuple(trace), capacity_tokens, kv_cache, policy, block_size, max_model_len)
    busy = [a for a in accounts if a.waiting]
    b = max(len(busy), 1)
    cap = accounts[0].capacity if accounts else capacity_tokens

    def mean(f):
        return sum(f(a) for a in busy) / b

    return MemoryReport(
        name=name or (f"paged (block {block_size})" if kv_cache == "paged" else f"contiguous {policy}"),
        capacity_tokens=cap, steps=len(accounts), busy_steps=len(busy),
        token_states=mean(lambda a: a.tokens / cap), reservation=mean(lambda a: a.reservation / cap),
        internal_fragmentation=mean(lambda a: a.internal / cap),
        external_fragmentation=mean(lambda a: (cap - a.allocated) / cap if a.scattered else 0.0),
        free=mean(lambda a: 0.0 if a.scattered else (cap - a.allocated) / cap),
        utilization=mean(lambda a: a.tokens / a.allocated if a.allocated else 0.0),
        mean_resident=mean(lambda a: a.resident),
        theory_utilization=mean(lambda a: a.tokens / (a.tokens + a.resident * (block_size - 1) / 2)
                                if a.tokens else 0.0) if kv_cache == "paged" else None,
        preemptions=preemptions,
    )


def _slot_map(eng, tokens: dict) -> list[int]:
    """The arena slot by slot: FREE, TOKEN, RESERVED or INTERNAL, from the KV manager's own state."""
    kv = eng.kv
    slots = [FREE] * kv.capacity_tokens
    if eng.config.kv_layout == "contiguous":  # the regions
        for seq_id, (start, size, final) in kv.allocator.regions.items():
            held, final = tokens.get(seq_id, 0), min(final, size)
            for i in range(size):
                slots[start + i] = TOKEN if i < held else RESERVED if i < final else INTERNAL
        return slots
    bs = kv.block_size
    for seq in eng.scheduler.running:  # paged: the block tables
        for i, block in enumerate(kv.block_ids(seq)):
            for j in range(bs):
                slots[block * bs + j] = TOKEN if i * bs + j < tokens.get(seq.seq_id, 0) else INTERNAL
    return slots


def memory_map(trace: list[TraceRequest], capacity_tokens: int, kv_cache: str = "contiguous", policy: str = "max",
               block_size: int = 16, max_model_len: int = 2048, max_steps: int | None = None) -> list[list[int]]:
    """The arena slot by slot, one row per step: FREE, TOKEN, RESERVED, INTERNAL or EXTERNAL (free
    slots while the head request waits although they add up to its reservation). For plots."""
    rows = []
    for eng, tokens, account in _steps(trace, capacity_tokens, kv_cache, policy, block_size, max_model_len):
        if max_steps is not None and len(rows) >= max_steps:
            break
        row = _slot_map(eng, tokens)
        if account.scattered:
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
