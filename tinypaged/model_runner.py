"""Runs one engine step through the model: flatten the scheduled tokens, build the attention
context (slots of new tokens, slots of every sequence's context), forward, and return logits."""

from __future__ import annotations

import torch

from tinypaged.attention import ForwardContext, contiguous_context_slots, paged_context_slots
from tinypaged.block_manager import blocks_needed


class ModelRunner:
    def __init__(self, model, kv_manager, kv_tensors, device, backend: str = "torch"):
        self.model = model
        self.kv = kv_manager
        self.tensors = kv_tensors
        self.device = device
        self.backend = backend

    def _context_slots(self, seqs, context_len: int) -> torch.Tensor:
        if self.kv.kind == "paged":
            tables = self.block_tables(seqs, context_len)
            return paged_context_slots(tables, context_len, self.kv.block_size)
        starts = torch.tensor([s.kv_region[0] for s in seqs], device=self.device)
        return contiguous_context_slots(starts, context_len)

    def block_tables(self, seqs, context_len: int) -> torch.Tensor:
        width = max(1, blocks_needed(context_len, self.kv.block_size))
        rows = [s.block_table[:width] + [0] * (width - len(s.block_table[:width])) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def prepare(self, scheduled) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int], list]:
        input_ids, positions, slots = [], [], []
        decode_rows, decode_seqs, prefills = [], [], []
        logits_rows, sampling = [], []
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            row0 = len(input_ids)
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(self.kv.slot(seq, p) for p in range(start, start + n))
            if item.kind == "decode":
                decode_rows.append(row0)
                decode_seqs.append(seq)
            else:
                prefills.append((row0, row0 + n, seq, start))
            if start + n == len(seq):  # the chunk reaches the end: this sequence samples now
                logits_rows.append(row0 + n - 1)
                sampling.append(seq)
        dev = self.device
        ctx = ForwardContext(
            keys=self.tensors.keys, values=self.tensors.values,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            backend=self.backend, block_size=getattr(self.kv, "block_size", 1),
        )
        if decode_seqs:
            lens = [s.num_computed_tokens + 1 for s in decode_seqs]
            ctx.decode_rows = torch.tensor(decode_rows, device=dev)
            ctx.decode_lens = torch.tensor(lens, device=dev)
            if self.backend == "triton":
                ctx.decode_block_tables = self.block_tables(decode_seqs, max(lens))
            else:
                ctx.decode_slots = self._context_slots(decode_seqs, max(lens))
        for row0, row1, seq, start in prefills:
            ctx.prefills.append((row0, row1, self._context_slots([seq], start + row1 - row0)[0], start))
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, ctx, logits_rows, sampling

    def execute(self, scheduled):
        """Forward the scheduled tokens; returns (logits of sampling sequences [N, vocab], those sequences)."""
        ids, pos, ctx, rows, sampling = self.prepare(scheduled)
        if not rows:
            self.model(ids, pos, ctx, logits_indices=torch.tensor([], dtype=torch.long, device=self.device))
            return None, []
        logits = self.model(ids, pos, ctx, logits_indices=torch.tensor(rows, device=self.device))
        return logits, sampling
