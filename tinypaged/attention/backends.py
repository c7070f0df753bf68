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

from tinypaged.interfaces import InvariantError


def slot_mapping(block_table, positions, block_size: int) -> list[int]:
    """Where each token's K/V goes: ``block_table[p // block_size] * block_size + p % block_size``.

    A negative position is padding and maps to slot -1 (the cache write skips it).
    """
    return [-1 if p < 0 else block_table[p // block_size] * block_size + p % block_size for p in positions]


def gather_kv(cache: torch.Tensor, block_table, context_len: int) -> torch.Tensor:
    """One sequence's keys (or values) in logical order, read through its block table.

    cache [num_blocks, block_size, KVH, D] -> [context_len, KVH, D]: key j is row ``j % block_size``
    of physical block ``block_table[j // block_size]``. Blocks beyond the context are never read.
    A batch of tables ``[num_seqs, max_blocks]`` gathers ``[num_seqs, context_len, ...]`` at once.
    """
    block_size = cache.shape[1]
    table = torch.as_tensor(block_table, dtype=torch.long, device=cache.device)
    j = torch.arange(context_len, device=cache.device)
    return cache[table[..., j // block_size], j % block_size]


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """Decode attention over a paged cache, one sequence at a time: the readable reference.

    query [num_seqs, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables [num_seqs, max_blocks];
    seq_lens [num_seqs]. Query head h reads KV head ``h // (H // KVH)``; only the first ``seq_lens[s]``
    keys of sequence s count. ``DecodeFunctionBackend(paged_attention)`` serves with it.
    """
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for s in range(query.shape[0]):
        n = int(seq_lens[s])
        k = gather_kv(key_cache, block_tables[s], n).repeat_interleave(group, dim=1)    # [n, heads, dim]
        v = gather_kv(value_cache, block_tables[s], n).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[s], k) * scale
        out[s] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out


def paged_context_slots(block_tables: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[num_seqs, max_blocks] block tables -> [num_seqs, context_len] slot of every key position:
    ``gather_kv`` over a cache whose every row holds its own slot number (one formula for both)."""
    num_blocks = int(block_tables.max()) + 1 if block_tables.numel() else 1
    slots = torch.arange(num_blocks * block_size, device=block_tables.device).view(num_blocks, block_size)
    return gather_kv(slots, block_tables, context_len)


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


# -- attention backends (tinypaged.interfaces.AttentionBackend) ----------------------------------------
@dataclass
class DecodeBatch:
    """Where the decode queries' keys are: ``context_lens`` [B], plus ``block_tables`` [B, max_blocks]
    (int32; paged caches) and/or ``context_slots`` [B, max_len] (slot of every key position)."""

    rows: torch.Tensor  # rows of the flat token batch that are decode queries
    context_lens: torch.Tensor
    block_size: int
    block_tables: torch.Tensor | None = None
    context_slots: torch.Tensor | None = None
    # what a backend derives from the fields above once per step and reuses in every layer (the fields do not
    # change between layers): e.g. the fast path's padded slots and visibility mask
    per_step: dict = field(default_factory=dict)


def _blocked(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """[num_slots, KVH, D] -> [num_blocks, block_size, KVH, D] (a view: the kernels' layout)."""
    return cache.view(-1, block_size, *cache.shape[1:])


class TorchBackend:
    """Reference backend: index-copy writes; decode gathers each sequence's keys by slot, then attends."""

    name = "torch"
    uses_block_tables = False

    def write(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        key_cache[slots] = key[keep]
        value_cache[slots] = value[keep]

    def decode(self, query, key_cache, value_cache, batch: DecodeBatch, scale: float) -> torch.Tensor:
        # padding past a short context may run off the cache's end (a contiguous region near the end of
        # the arena): clamp it in range; those keys are masked out anyway
        slots = batch.context_slots.clamp(max=key_cache.shape[0] - 1)
        positions = (batch.context_lens - 1)[:, None]
        return attend_gathered(query[:, None], key_cache[slots], value_cache[slots], positions,
                               batch.context_lens, scale)[:, 0]


class DecodeFunctionBackend(TorchBackend):
    """A paged decode function, ``fn(query, k_cache, v_cache, block_tables, context_lens, scale)`` with
    caches in the blocked layout (``paged_attention_decode``'s signature): a learner's kernel plugs in here."""

    uses_block_tables = True

    def __init__(self, fn, name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "custom")

    def decode(self, query, key_cache, value_cache, batch: DecodeBatch, scale: float) -> torch.Tensor:
        bs = batch.block_size
        return self.fn(query, _blocked(key_cache, bs), _blocked(value_cache, bs), batch.block_tables,
                       batch.context_lens.to(torch.int32), scale)


class TritonBackend(DecodeFunctionBackend):
    """Stage 5: the Triton kernels write the cache (``reshape_and_cache``) and walk block tables."""

    def __init__(self, block_size: int):
        self.name, self.block_size = "triton", block_size

    @property
    def fn(self):
        import tinypaged.kernels  # looked up at call time, so tests and notebooks can wrap it

        return tinypaged.kernels.paged_attention_decode

    def write(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        from tinypaged.kernels import reshape_and_cache

        bs = self.block_size
        reshape_and_cache(key, value, _blocked(key_cache, bs), _blocked(value_cache, bs), slot_mapping)


@dataclass
class ForwardContext:
    """What attention needs for one engine step (built once per step by the model runner)."""

    keys: torch.Tensor  # [layers, slots, KVH, D]
    values: torch.Tensor
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V goes (-1: padding, skipped)
    backend: object = field(default_factory=TorchBackend)
    decode: DecodeBatch | None = None
    # prefills, one by one: (first row, last row + 1, context slots [C], first position)
    prefills: list[tuple[int, int, torch.Tensor, int]] = field(default_factory=list)

    def attend(self, layer: int, q, k, v, scale) -> torch.Tensor:
        K, V = self.keys[layer], self.values[layer]
        self.backend.write(K, V, k, v, self.slot_mapping)
        if self.decode is not None and not self.prefills and self.decode.rows.numel() == q.shape[0]:
            # every token is a decode query, in row order (the runner lays decodes out so): no scatter
            return self._checked("decode", self.backend.decode(q, K, V, self.decode, scale), q)
        out = torch.empty_like(q)
        if self.decode is not None:
            rows = self.decode.rows
            out[rows] = self._checked("decode", self.backend.decode(q[rows], K, V, self.decode, scale), q[rows])
        prefill = getattr(self.backend, "prefill", None)  # a backend may bring its own (the fast path's)
        for start, end, slots, first_pos in self.prefills:
            if prefill is not None:
                out[start:end] = self._checked("prefill", prefill(q[start:end], K[slots], V[slots], first_pos, scale),
                                               q[start:end])
                continue
            n = end - start
            positions = torch.arange(first_pos, first_pos + n, device=q.device)[None]
            lens = torch.tensor([slots.shape[0]], device=q.device)
            out[start:end] = attend_gathered(q[None, start:end], K[slots][None], V[slots][None], positions, lens, scale)[0]
        return out

    def _checked(self, what: str, result, query: torch.Tensor) -> torch.Tensor:
        """A backend's output must be one row per query, shaped like the query: anything else would be
        broadcast into the batch and generate wrong text without an error."""
        if not isinstance(result, torch.Tensor) or result.shape != query.shape:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise InvariantError(f"attention_backend {getattr(self.backend, 'name', type(self.backend).__name__)!r}: "
                                 f"{what} returned {got}, but the output must have the query's shape "
                                 f"{tuple(query.shape)} ([tokens, heads, head_dim])")
        return result
