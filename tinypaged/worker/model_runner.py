"""The model runner owns the device: the KV tensors, the profiling forward, and one forward per step (what memory
is free and may be taken: ``tinypaged.worker.memory``).

Per step it reads the scheduler's batch (``SchedulerOutput.batch``: ``ScheduledChunk`` data, no live
``Sequence``), flattens the token ids and positions, builds the attention context from the slots and
block ids the scheduler put there, runs the model and returns the logits of the chunks that sample;
before that (``move_blocks``) it makes the step's swaps and copy-on-write copies, which the KV manager
decided and the scheduler listed in the ``SchedulerOutput``. It never calls the KV manager. ``check_slots``
enforces the cheap half of the KV manager's contract before anything is written (the scheduler's
``check_no_overwrite`` the other).
"""

from __future__ import annotations

import logging

import torch

from tinypaged.attention.backends import DecodeBatch, ForwardContext, paged_context_slots
from tinypaged.kv.block_pool import blocks_needed
from tinypaged.interfaces import InvariantError, KVCacheSpec
from tinypaged.kv.sizing import KVLayout, max_concurrency, size_kv_cache
from tinypaged.worker.cuda_graphs import DecodeGraphs, capture_sizes
from tinypaged.worker.kv_cache import KVCacheTensors, kv_bytes_per_token
from tinypaged.worker.memory import check_memory, memory_snapshot, profile_free_gpu_bytes

__all__ = ["ModelRunner", "memory_snapshot"]
from tinypaged.model.llama import head_dim_of

logger = logging.getLogger("tinypaged")


class ModelRunner:
    def __init__(self, model, device, backend):
        self.model = model
        self.device = device
        self.backend = backend
        self.tensors = None
        self.capacity = self.block_size = 0
        self.graphs = None  # DecodeGraphs once captured (enforce_eager=False on a GPU; worker/cuda_graphs.py)
        hf = model.config
        self.dtype = next(model.parameters()).dtype
        self.kv_shape = (hf.num_hidden_layers, hf.num_key_value_heads, head_dim_of(hf))
        self.bytes_per_token = kv_bytes_per_token(*self.kv_shape, self.dtype)

    def attach(self, kv_tensors, block_size: int) -> None:
        """The KV cache, once it is sized (profiling runs before it exists), and its block size."""
        self.tensors, self.capacity, self.block_size = kv_tensors, kv_tensors.num_slots, block_size

    # -- where the context lives (from the batch's data) -------------------------------------
    def block_tables(self, chunks, context_len: int) -> torch.Tensor:
        width = max(1, blocks_needed(context_len, self.block_size))
        rows = []
        for c in chunks:
            if c.block_ids is None:
                raise InvariantError(f"attention backend {self.backend.name!r} reads block tables, but the KV "
                                     f"manager has no block_ids (sequence {c.seq_id})")
            ids = c.block_ids[:width]
            rows.append(ids + [0] * (width - len(ids)))
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def context_slots(self, chunks, context_len: int) -> torch.Tensor:
        """[len(chunks), context_len] slot of every key position: the chunks' own context slots (padded
        with slot 0 past each one's context, which attention masks), or their block tables'."""
        if any(c.context_slots is None for c in chunks):
            return paged_context_slots(self.block_tables(chunks, context_len), context_len, self.block_size)
        rows = torch.zeros(len(chunks), context_len, dtype=torch.long)
        for i, c in enumerate(chunks):
            row = torch.as_tensor(c.context_slots, dtype=torch.long)[:context_len]
            rows[i, :len(row)] = row
        return rows.to(self.device)

    # -- one step ----------------------------------------------------------------------------
    def prepare(self, batch):
        """Tensors for one forward of ``batch`` (``ScheduledChunk``s); also returns the rows whose logits
        are sampled and their chunks."""
        input_ids, positions, slots = [], [], []
        decode_rows, decodes, prefills = [], [], []
        logits_rows, sampling = [], []
        for chunk in batch:
            n, start = len(chunk.token_ids), chunk.start
            row0 = len(input_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(range(start, start + n))
            slots.extend(chunk.slot_mapping)
            if not chunk.is_prefill:
                decode_rows.append(row0)
                decodes.append(chunk)
            else:
                prefills.append((row0, row0 + n, chunk))
            if chunk.samples:  # the chunk reaches the end: this sequence samples now
                logits_rows.append(row0 + n - 1)
                sampling.append(chunk)
        dev = self.device
        ctx = ForwardContext(self.tensors.keys, self.tensors.values,
                             torch.tensor(slots, dtype=torch.long, device=dev), self.backend)
        if decodes:
            lens = [c.context_len for c in decodes]
            ctx.decode = DecodeBatch(torch.tensor(decode_rows, device=dev), torch.tensor(lens, device=dev),
                                     self.block_size)
            # a backend that takes_block_tables (SDPABackend) gets them where the slots would be made from them
            if self.backend.uses_block_tables or (getattr(self.backend, "takes_block_tables", False)
                                                  and any(c.context_slots is None for c in decodes)):
                ctx.decode.block_tables = self.block_tables(decodes, max(lens))
            else:
                ctx.decode.context_slots = self.context_slots(decodes, max(lens))
        for row0, row1, chunk in prefills:
            ctx.prefills.append((row0, row1, self.context_slots([chunk], chunk.context_len)[0], chunk.start))
        self.check_slots(ctx)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, ctx, logits_rows, sampling

    def check_slots(self, ctx: ForwardContext) -> None:
        """The KV manager's contract, checked before the forward writes anything: every new token gets
        its own slot inside the cache (the scheduler's ``check_no_overwrite`` checks, for plug-ins, that
        no slot another sequence has cached is written)."""
        writes = ctx.slot_mapping
        if writes.numel() == 0:
            return
        if int(writes.min()) < 0 or int(writes.max()) >= self.capacity:
            raise InvariantError(f"the KV manager mapped a token to slot {int(writes.min()) if int(writes.min()) < 0 else int(writes.max())}, "
                                 f"outside the cache's {self.capacity} slots")
        if torch.unique(writes).numel() != writes.numel():
            raise InvariantError("the KV manager gave two new tokens of this step the same slot "
                                 "(a block handed out twice?)")

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, graph_factory=None) -> None:
        """Capture decode steps as CUDA graphs for batch sizes 1..``max_num_seqs`` (``capture_sizes``), block
        tables up to ``max_model_len`` tokens wide; ``graph_factory`` stands in for the CUDA graph in tests."""
        self.graphs = DecodeGraphs(self.model, self.tensors.keys, self.tensors.values, self.backend, self.block_size,
                                   capture_sizes(max_num_seqs), blocks_needed(max_model_len, self.block_size),
                                   graph_factory)

    def move_blocks(self, swap_out, swap_in, copies) -> None:
        """The step's block moves, decided by the KV manager (``SchedulerOutput.blocks_to_swap_out``,
        ``blocks_to_swap_in``, ``blocks_to_copy``), made before its forward: swap-outs, swap-ins, then copies."""
        if swap_out or swap_in or copies:
            self.tensors.move_blocks(swap_out, swap_in, copies)

    def execute(self, batch):
        """Forward ``batch`` (``SchedulerOutput.batch``); returns (logits of the sampling chunks [N, vocab],
        those chunks). A decode-only step replays a captured graph where there is one."""
        ids, pos, ctx, rows, sampling = self.prepare(batch)
        size = self.graphs.applies(ids, ctx, len(rows)) if self.graphs is not None else None
        if size is not None:
            return self.graphs.run(ids, pos, ctx, size), sampling
        # every row samples (a decode-only step): no row to pick, so no copy of the hidden states
        picks = None if len(rows) == ids.shape[0] else torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model(ids, pos, ctx, logits_indices=picks)
        return (logits, sampling) if rows else (None, [])

    # -- sizing the KV cache -----------------------------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        """What one token's keys and values take in this model (``tinypaged.kv.sizing``)."""
        return KVLayout(*self.kv_shape, torch.empty((), dtype=self.dtype).element_size())

    def allocate_kv_cache(self, c, mem_at_start=None) -> tuple[KVCacheTensors, KVCacheSpec]:
        """Size the cache (vLLM's knobs), allocate its tensors, and describe it for a KV manager."""
        size = size_kv_cache(c, self.kv_layout, self.device.type == "cuda",
                             lambda: profile_free_gpu_bytes(self, c, mem_at_start))
        num_blocks, block_size = size.num_blocks, size.block_size
        paged = c.kv_layout == "paged"
        cpu_blocks = 0
        if c.preemption_mode == "swap":
            cpu_blocks = int(c.swap_space * 2**30) // (self.bytes_per_token * c.block_size)
        check_memory(c, self.device, num_blocks * block_size * self.bytes_per_token,
                     cpu_blocks * c.block_size * self.bytes_per_token)
        tensors = KVCacheTensors(self.kv_shape[0], num_blocks * block_size, *self.kv_shape[1:], self.dtype,
                                 self.device, block_size=block_size, num_cpu_blocks=cpu_blocks)
        spec = KVCacheSpec(num_blocks, block_size, c.max_model_len, c.enable_prefix_caching, c.reservation_policy,
                           cpu_blocks, enable_kv_cache_events=c.enable_kv_cache_events)
        # stage 6's max_concurrency, for the log line only: a student edition's is the learner's, unwritten in an
        # earlier stage's class (it raises NotImplementedError, which no engine start should fail on)
        try:
            concurrency = "%.2fx" % max_concurrency(num_blocks, c.block_size if paged else 1, c.max_model_len)
        except NotImplementedError:
            concurrency = "(stage 6's max_concurrency, not written yet)"
        if paged:
            logger.info("KV cache (paged): %d blocks of %d tokens, %d bytes per block = %d tokens; maximum "
                        "concurrency for %d-token requests: %s", num_blocks, c.block_size,
                        self.bytes_per_token * c.block_size, num_blocks * c.block_size, c.max_model_len, concurrency)
        else:
            logger.info("KV cache (contiguous, policy %s): %d tokens, %d bytes per token; maximum concurrency "
                        "for %d-token requests: %s", c.reservation_policy, num_blocks, self.bytes_per_token,
                        c.max_model_len, concurrency)
        return tensors, spec

    # -- memory profiling (CUDA) ------------------------------------------------------------
    def profile_peak_bytes(self, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> int:
        """Peak memory torch holds during one forward of ``max_num_batched_tokens`` tokens (prompts of at
        most ``max_model_len``), the scratch KV cache excluded: vLLM's profiling run. It goes
        through ``prepare`` with a throw-away cache, like any step: each prompt's slots side by side
        (one spare slot after each, as a contiguous "oracle" reservation)."""
        from tinypaged.sched.output import ScheduledChunk

        n = max_num_batched_tokens
        sizes = [min(max_model_len, n - start) for start in range(0, n, max_model_len)]  # prompts <= max_model_len
        slots = n + len(sizes)
        scratch = KVCacheTensors(self.kv_shape[0], slots, *self.kv_shape[1:], self.dtype, self.device)
        batch, base = [], 0
        for i, size in enumerate(sizes):
            where = list(range(base, base + size))
            batch.append(ScheduledChunk(-1 - i, [0] * size, 0, where, True, True, context_slots=where))
            base += size + 1
        saved = self.tensors, self.capacity
        self.tensors, self.capacity = scratch, slots
        try:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            ids, pos, ctx, rows, _ = self.prepare(batch)
            self.model(ids, pos, ctx, logits_indices=torch.arange(min(n, max_num_seqs), device=self.device))
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - scratch.keys.numel() * 2 * scratch.keys.element_size()
        finally:
            self.tensors, self.capacity = saved
            del scratch
            torch.cuda.empty_cache()
        return peak
