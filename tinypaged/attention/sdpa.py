"""Decode and prefill through torch's fused attention kernel (the engine's fast form of ``TorchBackend``).

``TorchBackend``'s slots and masks, ``torch.nn.functional.scaled_dot_product_attention`` for the maths (one
kernel, no [B, H, C] score tensor kept around). ``attention_backend="sdpa"``, the default (but
where decode replays CUDA graphs); tests/test_one_forward.py checks it equals the reference ``TorchBackend``. On a float32 CPU
where tinypaged's C++ operators are built (``tinypaged.cpu_native``), decode reads the cache in place through the
block tables (or the slots) instead of gathering copies for torch's kernel (tests/test_cpu_native.py checks the two
agree).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinypaged import cpu_native
from tinypaged.attention.backends import TorchBackend, paged_context_slots


def _rows_packed(t: torch.Tensor) -> bool:
    """Whether each token's heads lie side by side in ``t`` [tokens, heads, head_dim] (the layout ``write_kv``
    reads; the key and value views into a fused qkv output have it). One ``stride()`` read: it runs twice a layer."""
    return t.stride()[-2:] == (t.shape[-1], 1)


class SDPABackend(TorchBackend):
    """``attention_backend="sdpa"``: ``TorchBackend``'s slots and masks, torch's fused
    attention kernel. Keys a query may not see (past its context, or after it in a prefill) are masked."""

    # the runner gives decode the block tables of a paged cache rather than every key's slot (cheaper to build);
    # context slots where the KV manager has its own
    takes_block_tables = True

    def write(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        # the runner's slot mappings hold no padding (check_slots refuses a negative slot): no mask to
        # build; a -1 would fail loudly here (index out of range), never write a wrong slot
        native = cpu_native.usable(key)
        if (native is not None and key_cache.dtype == torch.float32 and slot_mapping.dtype == torch.long
                and _rows_packed(key) and _rows_packed(value)):
            native.write_kv(key_cache, value_cache, key, value, slot_mapping)  # one C++ call for both
            return
        key_cache.index_copy_(0, slot_mapping, key)
        value_cache.index_copy_(0, slot_mapping, value)

    def decode(self, query, key_cache, value_cache, batch, scale: float) -> torch.Tensor:
        native = cpu_native.usable(query)
        if native is not None and key_cache.dtype == torch.float32:
            # tinypaged's C++ decode attention reads the cache in place through the block tables (a paged cache;
            # a table of slots, block size 1, from any other KV manager): no gathered copies, no mask (vLLM's CPU
            # backend reads its paged cache from C++ too)
            if "native" not in batch.per_step:
                table, size = ((batch.block_tables, batch.block_size) if batch.block_tables is not None
                               else (batch.context_slots, 1))
                batch.per_step["native"] = table.contiguous(), batch.context_lens.to(torch.long).contiguous(), size
            table, lens, size = batch.per_step["native"]
            return native.decode_attention(query, key_cache, value_cache, table, lens, size, scale)
        b, h, d = query.shape
        kvh = key_cache.shape[1]
        if "sdpa" not in batch.per_step:  # the same for every layer of the step: made once
            context = batch.context_slots
            if context is None:  # a paged cache's block tables only (takes_block_tables): the slot of every key
                context = paged_context_slots(batch.block_tables, int(batch.context_lens.max()), batch.block_size)
            slots = context.clamp(max=key_cache.shape[0] - 1).reshape(-1)  # padding past a short context
            visible = torch.arange(context.shape[1], device=query.device) < batch.context_lens[:, None]
            # an additive mask (0 or -inf): what torch would otherwise make of a boolean one in every layer
            additive = torch.zeros(visible.shape, dtype=query.dtype, device=query.device).masked_fill_(~visible, -torch.inf)
            batch.per_step["sdpa"] = slots, additive[:, None, None, :]
        slots, mask = batch.per_step["sdpa"]
        # index_select copies whole rows (about 3x faster than advanced indexing here): [B, KVH, C, D]
        keys = key_cache.index_select(0, slots).view(b, -1, kvh, d).transpose(1, 2)
        values = value_cache.index_select(0, slots).view(b, -1, kvh, d).transpose(1, 2)
        # the `group` query heads sharing a KV head stand in for query positions: a plain (non-GQA) call,
        # which torch runs on its fused CPU kernel (enable_gqa=True takes a slower path)
        grouped = query.reshape(b, kvh, h // kvh, d)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(b, h, d)

    def prefill(self, query, keys, values, first_pos: int, scale: float) -> torch.Tensor:
        """One chunk: query [n, H, D] at positions first_pos.. over keys/values [first_pos + n, KVH, D]."""
        q, k, v = query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        if first_pos == 0:  # a whole prompt (or its first chunk): the plain causal mask
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            n, c = query.shape[0], keys.shape[0]
            visible = torch.arange(c, device=q.device)[None, :] <= torch.arange(first_pos, first_pos + n,
                                                                                device=q.device)[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
