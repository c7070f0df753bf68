"""The KV data one step moves, as the KV manager decides it: vLLM v0's ``blocks_to_swap_out``,
``blocks_to_swap_in`` and ``blocks_to_copy``.

The manager only decides. While the scheduler forms a step, the manager records each move the moment it
decides it (a copy-on-write copy, a preempted group's swap-out, a swapped group's swap-in); ``take``
hands the step's moves over as three lists of ``(from, to)`` block pairs, which the worker applies before
the forward, in vLLM v0's order: every swap-out, then every swap-in, then every copy (``cache_swap`` then
``cache_copy``), each list as one batch (its sources all read before any of its destinations is written).

A block freed during the step can be handed out again in the same step, so the recorded order is not the
applied order. ``take`` therefore resolves each move to the data it must carry: this log tracks, for every
block a move has written, which block's *start-of-step* data it holds now. A swapped-out block reused as a
swap-in or copy destination is right by the order alone (swap-out reads it first); a copy-on-write
destination swapped out later in the step (a sibling preempted with its group) is swapped out from the
copy's source, which still holds that data at swap-out time.

Invariant: applying ``take``'s lists in that order leaves every block with the data it would hold had
each move been made when it was decided; a step whose moves cannot be so applied (a swap-in reading a CPU
block that a later swap-out of the same step rewrote; a copy whose source a swap-in of the same step
rewrote) raises ``InvariantError``. The built-in policies never make one: ``schedule_step`` swaps in only
in a step that preempted nothing.
"""

from __future__ import annotations

from tinypaged.interfaces import InvariantError

GPU, CPU = "gpu", "cpu"


class BlockMoves:
    """One step's block moves, recorded in decision order, taken in application order (``take``)."""

    def __init__(self):
        self.gpu: dict[int, tuple[str, int]] = {}  # device block -> (GPU or CPU, block) whose start data it holds
        self.cpu: dict[int, tuple[str, int]] = {}  # CPU block -> the same

    def __bool__(self) -> bool:
        return bool(self.gpu or self.cpu)

    def copy(self, src: int, dst: int) -> None:
        """Copy-on-write: device block ``dst`` gets ``src``'s data."""
        self.gpu[dst] = self.gpu.get(src, (GPU, src))

    def swap_out(self, gpu_block: int, cpu_block: int) -> None:
        self.cpu[cpu_block] = self.gpu.get(gpu_block, (GPU, gpu_block))

    def swap_in(self, cpu_block: int, gpu_block: int) -> None:
        self.gpu[gpu_block] = self.cpu.get(cpu_block, (CPU, cpu_block))

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """``(blocks_to_swap_out, blocks_to_swap_in, blocks_to_copy)``: (device, CPU), (CPU, device) and
        (device src, device dst) pairs, to apply in that order; the log starts over."""
        swap_out, swap_in, copies = [], [], []
        for c, (where, b) in self.cpu.items():
            if where == GPU:
                swap_out.append((b, c))
            elif b != c:
                raise InvariantError(f"a step swapped a block in from CPU block {b} and out again to CPU block {c}: "
                                     f"swap-outs are applied before swap-ins, so this cannot be applied")
        written = {c for _, c in swap_out}
        for g, (where, b) in self.gpu.items():
            if where == CPU:
                if b in written:
                    raise InvariantError(f"a step swapped CPU block {b} in after swapping another block out into "
                                         f"it: swap-outs are applied first, so its data would be lost")
                swap_in.append((b, g))
            elif b != g:
                copies.append((b, g))
        written = {g for _, g in swap_in}
        for src, dst in copies:
            if src in written:
                raise InvariantError(f"a step copied device block {src} to {dst}, then swapped data into {src}: "
                                     f"swap-ins are applied before copies, so the copy would read the wrong data")
        self.gpu, self.cpu = {}, {}
        return swap_out, swap_in, copies
