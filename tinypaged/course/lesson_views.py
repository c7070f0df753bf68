"""Small read-only views the lesson notebooks share: interfaces, block tables, memory shares.

Nothing here changes engine state. The lessons show *what* a piece of the engine promises
(signature, contract, behaviour) rather than its code, since the exercises ask learners to write
that code; ``interface`` prints the promise. The other helpers format state the KV cache manager
owns (block tables) for printing, and add the whole-run view of the memory replay next to
``memory_sim``'s busy-step averages.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from tinypaged.lab import memory_sim


def interface(fn) -> str:
    """``name(signature)`` and its docstring, indented: the contract, not the body."""
    doc = "\n".join("    " + line if line else "" for line in (inspect.getdoc(fn) or "").splitlines())
    try:
        sig = inspect.signature(fn, eval_str=True)  # "list[int]" rather than "'list[int]'"
    except (NameError, TypeError):
        sig = inspect.signature(fn)
    return f"{fn.__name__}{sig}\n{doc}"


def format_tables(kv, seqs: dict) -> str:
    """``"A:[0, 1]  B:[2]"`` for the named sequences that hold blocks."""
    parts = []
    for name, seq in seqs.items():
        ids = kv.block_ids(seq)
        if ids:
            parts.append(f"{name}:{ids}")
    return "  ".join(parts)


def block_owners(kv, seqs) -> dict[int, list]:
    """Physical block id -> request ids of the sequences holding it (shared blocks list several)."""
    owners: dict[int, list] = {}
    for seq in seqs:
        for b in kv.block_ids(seq):
            owners.setdefault(b, []).append(seq.request_id)
    return owners


@dataclass
class MemoryShares:
    """Token-state share of the arena, averaged two ways, plus the paged waste model.

    ``busy_token_share``: over steps in which a request waits (``memory_sim``'s convention: memory
    is the bottleneck). ``whole_run_token_share``: over every step, the drain at the end included
    (closer to the paper's Fig. 2, averaged over a whole serving run). For paged caches,
    ``expected_utilization`` assumes (block_size - 1) / 2 empty slots per live sequence (the mean
    waste) and ``worst_utilization`` block_size - 1 (the maximum), both over the busy steps.
    """

    steps: int
    busy_steps: int
    busy_token_share: float
    whole_run_token_share: float
    expected_utilization: float | None = None
    worst_utilization: float | None = None


def memory_shares(trace, capacity_tokens: int, kv_cache: str = "paged", policy: str = "max",
                  block_size: int = 16, max_model_len: int = 2048) -> MemoryShares:
    """Replay ``trace`` once (``memory_sim.replay``) and average the token-state share both ways."""
    steps = busy = 0
    whole = busy_sum = expected = worst = 0.0
    for a in memory_sim.replay(trace, capacity_tokens, kv_cache, policy, block_size, max_model_len):
        share = a.tokens / a.capacity
        steps += 1
        whole += share
        if a.waiting:
            busy += 1
            busy_sum += share
            if a.tokens:
                expected += a.tokens / (a.tokens + a.resident * (block_size - 1) / 2)
                worst += a.tokens / (a.tokens + a.resident * (block_size - 1))
    paged = kv_cache == "paged"
    b = max(busy, 1)
    return MemoryShares(steps, busy, busy_sum / b, whole / max(steps, 1),
                        expected / b if paged else None, worst / b if paged else None)
