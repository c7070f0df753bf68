"""Swap space for ``preemption_mode="swap"`` (vLLM v0): CPU blocks that hold preempted sequences' KV.

A request's sequences swap out and in together, so blocks shared by siblings move once and stay shared
(v0 swapped whole sequence groups). The ``BlockManager`` owns the GPU side (its free queue, block tables
and reference counts); this class owns the CPU side: which CPU blocks are free, how many swapped tables
point at each, and each swapped sequence's CPU table.

Invariant: a CPU block is in ``cpu_free`` exactly when no swapped table points at it.
"""

from __future__ import annotations


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

    def swap_out(self, tables: dict[int, list[int]], copy_to_cpu) -> None:
        """Copy the GPU blocks of ``tables`` (seq_id -> GPU block ids) to CPU blocks, shared ones once."""
        gpu = distinct(tables.values())
        to_cpu = {b: self.cpu_free.pop() for b in gpu}
        copy_to_cpu(gpu, [to_cpu[b] for b in gpu])
        for seq_id, table in tables.items():
            self.swapped[seq_id] = [to_cpu[b] for b in table]
            for b in table:
                self.cpu_ref[to_cpu[b]] = self.cpu_ref.get(to_cpu[b], 0) + 1

    def blocks_of(self, seq_ids) -> list[int]:
        """The distinct CPU blocks the swapped sequences ``seq_ids`` hold."""
        return distinct(self.swapped.get(s, []) for s in seq_ids)

    def swap_in(self, seq_ids, allocator, refcounts: dict[int, int], copy_to_gpu) -> dict[int, list[int]]:
        """Copy the sequences' CPU blocks into fresh GPU blocks of ``allocator``; returns their new GPU tables
        (a block siblings shared is shared again: ``refcounts`` counts its tables) and releases the CPU blocks."""
        cpu = self.blocks_of(seq_ids)
        to_gpu = {c: allocator.allocate() for c in cpu}
        copy_to_gpu(cpu, [to_gpu[c] for c in cpu])
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
