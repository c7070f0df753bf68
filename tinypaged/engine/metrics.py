"""The engine's counters and step history (vLLM's stats, the course's waste accounting).

``EngineMetrics`` owns the counters and the bounded history; it is told of each event (a step, a
finished or aborted request) and never reads a sequence's internals beyond its progress. Everything
else ``get_metrics()`` reports is asked of its owner when asked for: queue sizes of the scheduler,
usage and ``stats()`` of the KV manager. Per-step work is O(batch), never O(cache).
"""

from __future__ import annotations

from collections import deque

COUNTERS = ("num_steps", "num_generated_tokens", "num_prefill_tokens", "num_requests_finished",
            "num_requests_aborted", "num_busy_slot_steps", "num_idle_slot_steps")


def prefill_tokens(scheduled) -> int:
    return sum(s.num_tokens for s in scheduled if s.is_prefill)


def kv_waste_tokens(kv, running) -> int:
    """Slots the KV manager has handed out that hold no token's keys and values (paged: the unfilled
    tail of last blocks; contiguous: reserved but unwritten). Asked through the KV contract: slots in
    use are ``usage x capacity_tokens``; slots holding state are the distinct slots of every running
    sequence's computed tokens (a block shared by forks counts once)."""
    allocated = round(kv.usage * kv.capacity_tokens)
    held = set()
    for seq in running:
        if seq.num_computed_tokens:
            held.update(kv.slot_mapping(seq, 0, seq.num_computed_tokens))
    return allocated - len(held)


class EngineMetrics:
    def __init__(self, history_size: int, clock):
        self.clock = clock
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.history: deque[dict] = deque(maxlen=history_size)

    def record_step(self, out, num_sampled: int, scheduler, kv) -> None:
        """One step ran ``out`` (the scheduler's output) and sampled ``num_sampled`` tokens. Batch
        slot-steps: every scheduled sequence is busy; idle slots are the ones a policy reports (static
        batching's finished members; a continuous policy has none)."""
        c = self.counters
        c["num_steps"] += 1
        c["num_generated_tokens"] += num_sampled
        prefill = prefill_tokens(out.scheduled)
        c["num_prefill_tokens"] += prefill
        c["num_busy_slot_steps"] += len(out.scheduled)
        c["num_idle_slot_steps"] += out.num_idle_slots
        if self.history.maxlen == 0:
            return
        self.history.append({
            "step": c["num_steps"] - 1, "time": self.clock(), "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting), "num_prefill_tokens": prefill,
            "num_decode_tokens": out.num_batched_tokens - prefill, "kv_cache_usage": kv.usage,
            "num_preemptions": scheduler.num_preemptions, "running": [s.seq.request_id for s in out.scheduled],
        })

    def record_finished(self, n: int = 1) -> None:
        self.counters["num_requests_finished"] += n

    def record_aborted(self, n: int = 1) -> None:
        self.counters["num_requests_aborted"] += n

    def snapshot(self, scheduler, kv) -> dict:
        """Counters, queue sizes and the KV manager's statistics (computed on demand)."""
        m = dict(self.counters)
        m["num_preemptions"] = scheduler.num_preemptions
        m["num_running"] = len(scheduler.running)
        m["num_waiting"] = len(scheduler.waiting) + sum(len(g) for g in scheduler.swapped)
        m["kv_cache_usage"] = kv.usage
        if hasattr(kv, "stats"):
            m.update(kv.stats())
        m["kv_waste_tokens"] = kv_waste_tokens(kv, scheduler.running)
        slots = m["num_busy_slot_steps"] + m["num_idle_slot_steps"]
        m["idle_slot_fraction"] = m["num_idle_slot_steps"] / slots if slots else 0.0
        return m
