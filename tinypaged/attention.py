"""Attention over a KV cache that lives in slots: the same maths for every stage.

Each layer first writes this step's keys and values to their slots (``slot_mapping``), then
every query attends to its sequence's cached keys. Where those keys are is the only thing
that differs between stages, and ``context_slots`` captures it:

* contiguous (stage 1): key j of a sequence is in slot ``region_start + j``;
* paged (stage 2):      key j is in slot ``block_table[j // block_size] * block_size + j % block_size``.

Decodes (one query per sequence) are batched together; each prefill chunk attends on its own
with a causal mask that starts at its first position (after cached prefix tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def slot_mapping(block_table, positions, block_size: int) -> list[int]:
    """Where each token's K/V goes: ``block_table[p // block_size] * block_size + p % block_size``.

    A negative position is padding and maps to slot -1 (the cache write skips it).
    """
    return [-1 if p < 0 else block_table[p // block_size] * block_size + p % block_size for p in positions]


def paged_context_slots(block_tables: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[num_seqs, max_blocks] block tables -> [num_seqs, context_len] slot of every key position."""
    j = torch.arange(context_len, device=block_tables.device)
    return block_tables[:, j // block_size].long() * block_size + j % block_size


def gather_kv(cache: torch.Tensor, block_table, context_len: int) -> torch.Tensor:
    """One sequence's keys (or values) in logical order, read through its block table.

    cache [num_blocks, block_size, KVH, D] -> [context_len, KVH, D]: key j is row ``j % block_size``
    of physical block ``block_table[j // block_size]``. Blocks beyond the context are never read.
    """
    bs = cache.shape[1]
    table = torch.as_tensor(block_table, dtype=torch.long, device=cache.device)
    j = torch.arange(context_len, device=cache.device)
    return cache[table[j // bs], j % bs]


def contiguous_context_slots(starts: torch.Tensor, context_len: int) -> torch.Tensor:
    """[num_seqs] region starts -> [num_seqs, context_len] slots (a region is one run of slots)."""
    return starts[:, None].long() + torch.arange(context_len, device=starts.device)


def attend_gathered(q, keys, values, q_positions, context_lens, scale):
    """Reference attention on gathered keys and values, with grouped-query heads.

    q [B, Q, H, D]; keys/values [B, C, KVH, D]; q_positions [B, Q]; context_lens [B].
    Query at position p sees key j when j <= p and j < context_len. Returns [B, Q, H, D].
    """
    B, Q, H, D = q.shape
    kvh = keys.shape[2]
    group = H // kvh
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qg = q.to(compute).view(B, Q, kvh, group, D).permute(0, 2, 3, 1, 4).reshape(B, kvh, group * Q, D)
    k = keys.to(compute).permute(0, 2, 1, 3)  # [B, KVH, C, D]
    v = values.to(compute).permute(0, 2, 1, 3)
    scores = (qg @ k.transpose(-1, -2)) * scale  # [B, KVH, group*Q, C]
    j = torch.arange(keys.shape[1], device=q.device)
    allowed = (j[None, None, :] <= q_positions[:, :, None]) & (j[None, None, :] < context_lens[:, None, None])
    allowed = allowed[:, None, None, :, :].expand(B, 1, group, Q, -1).reshape(B, 1, group * Q, -1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [B, KVH, group*Q, D]
    out = out.view(B, kvh, group, Q, D).permute(0, 3, 1, 2, 4).reshape(B, Q, H, D)
    return out.to(q.dtype)


@dataclass
class ForwardContext:
    """What attention needs for one engine step (built once per step by the model runner)."""

    keys: torch.Tensor  # [layers, slots, KVH, D]
    values: torch.Tensor
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V goes (-1: padding, skipped)
    # decodes, batched: rows of the flat token batch, their context slots and lengths
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None  # [B, C]
    decode_lens: torch.Tensor | None = None  # [B]
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] int32 (Triton backend)
    # prefills, one by one: (first row, last row + 1, context slots [C], first position)
    prefills: list[tuple[int, int, torch.Tensor, int]] = field(default_factory=list)
    backend: str = "torch"
    block_size: int = 1

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.backend == "triton":
            from tinypaged.kernels import reshape_and_cache

            bs = self.block_size
            kc = self.keys[layer].view(-1, bs, *self.keys.shape[2:])
            vc = self.values[layer].view(-1, bs, *self.values.shape[2:])
            reshape_and_cache(k, v, kc, vc, self.slot_mapping)
            return
        keep = self.slot_mapping >= 0
        slots = self.slot_mapping[keep]
        self.keys[layer, slots] = k[keep]
        self.values[layer, slots] = v[keep]

    def attend(self, layer: int, q, k, v, scale) -> torch.Tensor:
        self.write(layer, k, v)
        out = torch.empty_like(q)
        K, V = self.keys[layer], self.values[layer]
        if self.decode_rows is not None:
            qd = q[self.decode_rows]
            if self.backend == "triton":
                from tinypaged.kernels import paged_attention_decode

                bs = self.block_size
                out[self.decode_rows] = paged_attention_decode(
                    qd, K.view(-1, bs, *K.shape[1:]), V.view(-1, bs, *V.shape[1:]),
                    self.decode_block_tables, self.decode_lens.to(torch.int32), scale,
                )
            else:
                positions = (self.decode_lens - 1)[:, None]
                # padding past a short context may run off the arena's end (contiguous); it is masked anyway
                slots = self.decode_slots.clamp(max=K.shape[0] - 1)
                out[self.decode_rows] = attend_gathered(
                    qd[:, None], K[slots], V[slots], positions, self.decode_lens, scale
                )[:, 0]
        for start, end, slots, first_pos in self.prefills:
            n = end - start
            positions = torch.arange(first_pos, first_pos + n, device=q.device)[None]
            lens = torch.tensor([slots.shape[0]], device=q.device)
            out[start:end] = attend_gathered(q[None, start:end], K[slots][None], V[slots][None], positions, lens, scale)[0]
        return out
