"""Decode steps replayed as CUDA graphs (``enforce_eager=False`` on a CUDA device), as vLLM v1 runs them.

A decode step of a small model is host-bound on a GPU: every layer launches a dozen kernels, each a few
microseconds of Python and driver work, while the kernels themselves finish in less. A CUDA graph records
the launches of one forward once and replays them with a single call. Three rules make that possible:

* **fixed shapes**: a graph replays the very kernels it recorded, on the very tensors. So graphs are
  captured for a list of batch sizes (``capture_sizes``: 1, 2, 4, then every multiple of 8 up to
  ``max_num_seqs``, vLLM's default shape) and a step of ``n`` decodes runs the smallest captured size
  ``>= n``, its extra rows padding;
* **static inputs**: every input lives in a buffer made once (``StaticDecodeInputs``); a step copies its
  token ids, positions, slots, block tables and context lengths into the first ``n`` rows and replays;
* **padding that does no harm**: a padding row writes its key and value nowhere (slot -1, which the cache
  write skips) and reads one key of block 0 (context length 1); its logits are sliced away.

Only decode-only steps replay (every token a decode query, each sampled); prefills and mixed steps, and
steps larger than the largest captured size or with a longer block table, run eagerly, as in vLLM.
Graphs need an attention backend that reads block tables (stage 5's Triton kernels): a gather by context
slots would change shape with the context.

The graph itself sits behind ``GraphLike`` (``capture(fn) -> output``, ``replay()``), so the logic above is
tested on a CPU with ``EagerReplay``, which re-runs the function into the captured output
(``tests/test_cuda_graphs.py``); ``CUDAGraphReplay`` is torch's ``torch.cuda.CUDAGraph``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from tinypaged.attention.backends import DecodeBatch, ForwardContext


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, then multiples of 8, up to and including ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs}: CUDA graphs need at least one sequence per step")
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class GraphLike(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...
    def replay(self) -> None: ...


class CUDAGraphReplay:
    """A ``torch.cuda.CUDAGraph``; all sizes share one memory pool (captured largest first, as vLLM does)."""

    def __init__(self, pool):
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool

    def capture(self, fn):
        fn()  # once eagerly first: Triton compiles and torch's allocator settles outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerReplay:
    """A stand-in for a CUDA graph on any device: replay re-runs the function into the captured output
    tensor, so the caller sees exactly what a graph replay gives it (the same tensor, new values)."""

    def __init__(self):
        self.fn = self.out = None
        self.replays = 0

    def capture(self, fn):
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        with torch.inference_mode():  # the output is the forward's (an inference tensor)
            self.out.copy_(self.fn())
        self.replays += 1


@dataclass
class StaticDecodeInputs:
    """The buffers every graph reads, sized for the largest captured batch. Invariant: rows past the step's
    ``n`` hold padding (slot -1, context length 1, a block table of zeros) whenever a graph replays."""

    input_ids: torch.Tensor      # [S] long
    positions: torch.Tensor      # [S] long
    slot_mapping: torch.Tensor   # [S] long, -1 on padding rows
    context_lens: torch.Tensor   # [S] long, 1 on padding rows
    block_tables: torch.Tensor   # [S, max_blocks] int32
    rows: torch.Tensor           # [S] arange: every row is a decode query

    @classmethod
    def make(cls, size: int, max_blocks: int, device) -> "StaticDecodeInputs":
        long = dict(dtype=torch.long, device=device)
        return cls(torch.zeros(size, **long), torch.zeros(size, **long), torch.full((size,), -1, **long),
                   torch.ones(size, **long), torch.zeros(size, max_blocks, dtype=torch.int32, device=device),
                   torch.arange(size, **long))

    def fill(self, ids, positions, ctx: ForwardContext, padded: int) -> None:
        """Copy a step's ``n`` decodes into rows [0, n) and reset rows [n, padded) to padding."""
        n, width = ids.shape[0], ctx.decode.block_tables.shape[1]
        self.input_ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        self.context_lens[:n].copy_(ctx.decode.context_lens)
        self.block_tables[:n, :width].copy_(ctx.decode.block_tables)
        if n < padded:
            self.input_ids[n:padded].zero_()
            self.positions[n:padded].zero_()
            self.slot_mapping[n:padded].fill_(-1)
            self.context_lens[n:padded].fill_(1)
            self.block_tables[n:padded].zero_()

    def context(self, size: int, keys, values, backend, block_size: int) -> ForwardContext:
        """The forward context a graph of ``size`` rows records: views of the static buffers."""
        decode = DecodeBatch(self.rows[:size], self.context_lens[:size], block_size,
                             block_tables=self.block_tables[:size])
        return ForwardContext(keys, values, self.slot_mapping[:size], backend, decode=decode)


class DecodeGraphs:
    """One graph per captured batch size over one ``StaticDecodeInputs``; ``run`` replays a decode-only step."""

    def __init__(self, model, keys, values, backend, block_size: int, sizes: list[int], max_blocks: int,
                 graph_factory: Callable = None):
        if not getattr(backend, "uses_block_tables", False):
            raise ValueError(f"CUDA graphs (enforce_eager=False on a GPU) need an attention backend that reads "
                             f"block tables, such as 'triton'; attention_backend={getattr(backend, 'name', backend)!r} "
                             f"gathers by context slots, whose shape changes every step")
        self.sizes = sorted(sizes)
        self.max_blocks = max_blocks
        device = keys.device
        self.inputs = StaticDecodeInputs.make(self.sizes[-1], max_blocks, device)
        if graph_factory is None:
            pool = torch.cuda.graph_pool_handle()
            graph_factory = lambda: CUDAGraphReplay(pool)  # noqa: E731
        self.graphs, self.outputs = {}, {}
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool's memory
            ctx = self.inputs.context(size, keys, values, backend, block_size)
            graph = graph_factory()
            ids, pos = self.inputs.input_ids[:size], self.inputs.positions[:size]
            self.outputs[size] = graph.capture(lambda ids=ids, pos=pos, ctx=ctx: model(ids, pos, ctx))
            self.graphs[size] = graph
        self.replays = 0

    def padded_size(self, n: int) -> int | None:
        """The smallest captured size that holds ``n`` rows, or None when none does."""
        return next((s for s in self.sizes if s >= n), None)

    def applies(self, ids: torch.Tensor, ctx: ForwardContext, sampled_rows: int) -> int | None:
        """The captured size a step replays at, or None when the step must run eagerly: not decode-only, a row
        that does not sample, more rows than the largest graph, or a block table wider than the buffers."""
        n, decode = ids.shape[0], ctx.decode
        if (decode is None or ctx.prefills or decode.rows.numel() != n or sampled_rows != n
                or decode.block_tables is None or decode.block_tables.shape[1] > self.max_blocks):
            return None
        return self.padded_size(n)

    def run(self, ids, positions, ctx: ForwardContext, size: int) -> torch.Tensor:
        """Replay the graph of ``size`` for this step; the logits of its ``n`` rows (a view of the graph's
        output: valid until the next replay, which comes after this step's sampling)."""
        self.inputs.fill(ids, positions, ctx, size)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][: ids.shape[0]]
