"""Swap space for ``preemption_mode="swap"`` (vLLM v0): CPU blocks that hold preempted sequences' KV.

A request's sequences swap out and in together, so blocks shared by siblings move once and stay shared
(v0 swapped whole sequence groups). The ``BlockManager`` owns the GPU side (its free queue, block tables
and reference counts); this class owns the CPU side: which CPU blocks are free, how many swapped tables
point at each, and each swapped sequence's CPU table. Neither moves any data: ``swap_out`` and ``swap_in``
record the block pairs to move in the step's ``BlockMoves`` (``tinypaged.kv.block_moves``), which reach the
worker through the step's ``SchedulerOutput`` (``blocks_to_swap_out`` / ``blocks_to_swap_in``).

Invariant: a CPU block is in ``cpu_free`` exactly when no swapped table points at it.
"""

from __future__ import annotations

from tinypaged.kv.block_pool import blocks_needed


def distinct(tables) -> list[int]:
    """Block ids of ``tables``, each once, in first-seen order."""
    return list(dict.fromkeys(b for table in tables for b in table))


class SwapSpace:
    """The CPU side of swap preemption; the caller frees (or fills) the GPU blocks."""

    def __init__(self, num_cpu_blocks: int):
        self.cpu_free = list(range(num_cpu_blocks))
        self.cpu_ref: dict[int, int] = {}  # CPU block -> how many swapped tables point at it
        self.swapped: dict[int, list[int]] = {}  # seq_id -> the CPU blocks holding its KV

    def can_swap_out(self, tables) -> bool:
        return len(distinct(tables)) <= len(self.cpu_free)

    def swap_out(self, tables: dict[int, list[int]], moves) -> None:
        """Give the GPU blocks of ``tables`` (seq_id -> GPU block ids) CPU blocks, shared ones once; each
        ``(GPU block, CPU block)`` data move goes to ``moves`` (a ``BlockMoves``)."""
        gpu = distinct(tables.values())
        to_cpu = {b: self.cpu_free.pop() for b in gpu}
        for b in gpu:
            moves.swap_out(b, to_cpu[b])
        for seq_id, table in tables.items():
            self.swapped[seq_id] = [to_cpu[b] for b in table]
            for b in table:
                self.cpu_ref[to_cpu[b]] = self.cpu_ref.get(to_cpu[b], 0) + 1

    def blocks_of(self, seq_ids) -> list[int]:
        """The distinct CPU blocks the swapped sequences ``seq_ids`` hold."""
        return distinct(self.swapped.get(s, []) for s in seq_ids)

    def can_swap_in(self, seqs, num_new_tokens: int, block_size: int, num_free: int) -> bool:
        """Room among ``num_free`` GPU blocks for the swapped blocks of ``seqs`` plus what each one's next
        ``num_new_tokens`` need (and a copy-on-write), so the allocation right after swapping in cannot fail."""
        grow = sum(max(blocks_needed(s.num_computed_tokens + num_new_tokens, block_size)
                       - len(self.swapped.get(s.seq_id, [])), 0) + 1 for s in seqs)
        return len(self.blocks_of([s.seq_id for s in seqs])) + grow <= num_free

    def swap_in(self, seq_ids, allocator, refcounts: dict[int, int], moves) -> dict[int, list[int]]:
        """Give the sequences' CPU blocks fresh GPU blocks of ``allocator`` (each ``(CPU block, GPU block)`` data
        move goes to ``moves``); returns their new GPU tables (a block siblings shared is shared again:
        ``refcounts`` counts its tables) and releases the CPU blocks."""
        cpu = self.blocks_of(seq_ids)
        to_gpu = {c: allocator.allocate() for c in cpu}
        for c in cpu:
            moves.swap_in(c, to_gpu[c])
        tables = {}
        for s in seq_ids:
            table = []
            for c in self.swapped.pop(s):
                refcounts[to_gpu[c]] = refcounts.get(to_gpu[c], 0) + 1  # a sibling may already hold it
                table.append(to_gpu[c])
                self.release(c)
            tables[s] = table
        return tables

    def drop(self, seq_id: int) -> None:
        """A swapped-out sequence that is aborted: its CPU blocks are released."""
        for c in self.swapped.pop(seq_id, []):
            self.release(c)

    def release(self, cpu_block: int) -> None:
        self.cpu_ref[cpu_block] -= 1
        if self.cpu_ref[cpu_block] == 0:
            del self.cpu_ref[cpu_block]
            self.cpu_free.append(cpu_block)
