"""Stage 3's sharing over a paged manager's block tables: reference counts, fork, copy-on-write, freeing.

``SharedBlocks`` runs the lessons' parts (``fork``, ``append_slot``, ``free_table`` in
``tinypaged.kv.block_manager``) on the ``BlockManager``'s tables and free queue, and records the
copy-on-write copies it decides in the step's ``BlockMoves`` (``tinypaged.kv.block_moves``): the worker
makes them before the forward. It never touches KV data.

Invariants: a block is in the free queue exactly when no table holds it (no entry in ``refcounts``); a
block is written only when one table holds it (before a sequence writes into a shared, partly filled
last block, it gets a private copy). Until a block can be held by two tables (``sharing``: prefix
caching, or a fork happened), stage 2's ``BlockTables`` grows and frees every table by itself (the same
blocks in the same order), so stage 2's engine runs on stage 2's parts alone.
"""

from __future__ import annotations

from tinypaged.kv.block_pool import blocks_needed


class SharedBlocks:
    """Reference-counted block tables (``block_tables.tables``: seq_id -> block ids) over ``allocator``, with
    the copies decided recorded in ``moves`` (a ``BlockMoves``); ``on_copy(src, dst)``, if given, is told of
    each (a watcher: ``BlockManager``'s ``copy_block``)."""

    def __init__(self, parts, block_tables, allocator, block_size: int, sharing: bool, moves, on_copy=None):
        self.parts, self.block_tables, self.allocator, self.block_size = parts, block_tables, allocator, block_size
        self.tables = block_tables.tables
        self.refcounts: dict[int, int] = {}  # block -> how many tables hold it (no entry: free)
        self.sharing = sharing
        self.on_copy = on_copy
        self.moves = moves
        self.num_copies = 0

    def ref_count(self, block_id: int) -> int:
        return self.refcounts.get(block_id, 0)

    def needs_copy(self, table: list[int], start: int) -> bool:
        """Does the token at ``start`` land in the table's last block while another table shares it?"""
        return start % self.block_size != 0 and len(table) == blocks_needed(start, self.block_size) \
            and self.ref_count(table[-1]) > 1

    def hold(self, table: list[int], blocks) -> None:
        """``blocks`` (prefix-cache hits) join ``table``, one more holder each."""
        for block in blocks:
            if self.ref_count(block) == 0:
                self.allocator.touch(block)  # a hit waiting in the free queue leaves it
            self.refcounts[block] = self.ref_count(block) + 1
            table.append(block)

    def write_at(self, table: list[int], start: int) -> None:
        """Before the token at ``start`` is written: a shared, partly filled last block is replaced by a
        private copy (``append_slot``), the copy recorded in ``moves``."""
        if not self.sharing or len(table) != blocks_needed(start, self.block_size):
            return
        copy = self.parts.append_slot(table, start, self.block_size, self.refcounts, self.allocator)
        if copy is not None:
            self.moves.copy(*copy)
            self.num_copies += 1
            if self.on_copy is not None:
                self.on_copy(*copy)

    def grow(self, seq_id, num_tokens: int) -> None:
        """The table of ``seq_id`` holds ``num_tokens`` tokens (new blocks from ``BlockTables``, one holder each)."""
        held = len(self.tables[seq_id])
        if held < blocks_needed(num_tokens, self.block_size):
            self.block_tables.allocate_slots(seq_id, num_tokens)
            for block in self.tables[seq_id][held:]:
                self.refcounts[block] = 1

    def fork(self, parent_id, child_id) -> None:
        """The child's table holds the parent's blocks (reference counts go up; nothing is copied)."""
        self.sharing = True
        self.tables[child_id] = self.parts.fork(self.tables.get(parent_id, []), self.refcounts)

    def release(self, seq_id) -> None:
        """Drop the table's references, tail first; a block nobody holds goes back to the free queue."""
        if self.sharing:
            self.parts.free_table(self.tables.pop(seq_id, []), self.refcounts, self.allocator)
        else:  # every block has one holder: stage 2's free, tail first as free_table does
            for block in self.tables.get(seq_id, []):
                self.refcounts.pop(block, None)
            self.block_tables.free(seq_id)
