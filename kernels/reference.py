"""The PyTorch side of the kernels: the specs and the baseline, importable without Triton.

* :func:`paged_attention_reference` - decode attention as a Python loop over sequences: the readable spec.
* :func:`gather_then_attend` - the baseline: copy every sequence's K/V out of the pages into padded
  contiguous tensors, then ordinary masked attention.
* :func:`online_softmax_update` - one step of the online softmax, the recurrence at the heart of
  ``paged_attention_kernel`` (and every FlashAttention-style kernel), written with torch so it can be read
  and tested on its own: the kernel's loop body, in stage 5's part 1.
* :func:`merge_splits_reference` - what ``merge_splits_kernel`` computes: split-K partitions merged by their
  maxima and sums.
* :func:`reshape_and_cache_reference` - the cache write in three lines of indexing: the spec.

The Triton kernels in ``paged_attention.py`` and ``reshape_and_cache.py`` share these argument checks and are
tested against these references. They live apart from the kernels so that a machine without Triton (macOS,
Windows: ``tinypaged.triton_mode.AVAILABLE``) can still import them.
"""

import torch


def check_decode_args(query, key_cache, value_cache, block_tables, seq_lens):
    assert query.dim() == 3, "query: [num_seqs, num_heads, head_dim]"
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape, \
        "caches: [num_blocks, block_size, num_kv_heads, head_dim]"
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    assert key_cache.shape[3] == head_dim, "query and cache disagree on head_dim"
    assert query.dtype == key_cache.dtype == value_cache.dtype, "query and caches must share a dtype"
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads (GQA)"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert seq_lens.shape == (num_seqs,)
    assert not block_tables.is_floating_point() and not seq_lens.is_floating_point()


def check_cache_write_args(key, value, key_cache, value_cache, slot_mapping):
    assert key.shape == value.shape and key.dim() == 3, "key/value: [num_tokens, num_kv_heads, head_dim]"
    assert key_cache.shape == value_cache.shape and key_cache.dim() == 4, \
        "caches: [num_blocks, block_size, num_kv_heads, head_dim]"
    assert key_cache.shape[2:] == key.shape[1:], "cache and key disagree on (num_kv_heads, head_dim)"
    assert slot_mapping.shape == (key.shape[0],), "one slot per token"
    assert not slot_mapping.is_floating_point(), "slot_mapping must be an integer tensor"


def check_kernel_layout(head_dim, key_cache, value_cache):
    """What the Triton kernels assume beyond the shapes: ``tl.arange(0, HEAD_DIM)`` spans a power of two, and
    both caches share one layout with contiguous rows (the engine's caches are views of one tensor)."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}: the Triton kernels need a power of two; use "
                         "attention_backend=\"torch\" for this model")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError(f"key_cache/value_cache: the Triton kernels need one layout for both, with contiguous "
                         f"rows (strides {key_cache.stride()} and {value_cache.stride()})")


def paged_attention_reference(query, key_cache, value_cache, block_tables, seq_lens, scale, num_splits=None):
    """The spec: for each sequence, gather its keys/values through its block table and attend.

    Computed in fp32 (fp64 for fp64 inputs), returned in query's dtype. ``num_splits`` is accepted for a
    uniform signature and ignored (splitting changes the order of sums, not the answer).
    """
    check_decode_args(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.empty_like(query)
    for s in range(num_seqs):
        n = int(seq_lens[s])
        positions = torch.arange(n, device=query.device)
        blocks = block_tables[s, positions // block_size].long()
        offsets = positions % block_size
        k = key_cache[blocks, offsets].to(compute)    # [n, num_kv_heads, head_dim]
        v = value_cache[blocks, offsets].to(compute)
        # Query head h reads KV head h // queries_per_kv.
        k = k.repeat_interleave(queries_per_kv, dim=1)
        v = v.repeat_interleave(queries_per_kv, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[s].to(compute), k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[s] = torch.einsum("hn,nhd->hd", probs, v).to(query.dtype)
    return out


def gather_then_attend(query, key_cache, value_cache, block_tables, seq_lens, scale, num_splits=None):
    """Baseline: gather the whole batch's K/V into padded contiguous tensors, then masked attention.

    This is what an engine without a paged kernel would do. It moves each cached
    K/V vector three times (read, write the copy, read the copy) instead of once.
    """
    check_decode_args(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    # Pad to the block table's width: a static shape, no device-to-host sync.
    max_len = block_tables.shape[1] * block_size

    positions = torch.arange(max_len, device=query.device)
    blocks = block_tables[:, positions // block_size].long()        # [num_seqs, max_len]
    # Entries past a sequence's end may hold garbage (e.g. -1): point them at block 0, mask later.
    valid = positions[None, :] < seq_lens[:, None].long()
    blocks = torch.where(valid, blocks, torch.zeros_like(blocks))
    offsets = (positions % block_size).expand(num_seqs, -1)
    k = key_cache[blocks, offsets]                                  # [num_seqs, max_len, kv_heads, dim]
    v = value_cache[blocks, offsets]

    # GQA without copying K/V per query head: view the query as [seq, kv_head, group, dim].
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query.to(compute).reshape(num_seqs, num_kv_heads, queries_per_kv, head_dim)
    scores = torch.einsum("skgd,snkd->skgn", q, k.to(compute)) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A 0-length sequence would give NaN rows; make them zero like the kernel does.
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("skgn,snkd->skgd", probs, v.to(compute))
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def online_softmax_update(m, l, acc, scores, values):
    """Fold one chunk of keys into a running softmax-weighted sum, without revisiting old chunks.

    For G query rows: ``m`` [G] is the largest score seen so far (-inf before any), ``l`` [G] the
    sum of ``exp(score - m)`` so far, ``acc`` [G, D] the sum of ``exp(score - m) * value``.
    ``scores`` [G, N] are this chunk's (already scaled) scores, ``values`` [N, D] its values.
    Returns the new ``(m, l, acc)``. Invariant: after the last chunk, ``acc / l[:, None]``
    equals ``softmax(all scores) @ all values``. Inputs are not modified.
    """
    m_new = torch.maximum(m, scores.max(dim=1).values)
    alpha = torch.exp(m - m_new)  # how much the old terms shrink under the new max (0 at the start)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ values


def merge_splits_reference(partial, maxes, sums):
    """Merge split-K partial results: split i holds ``o_i = sum_j exp(s_j - m_i) v_j / l_i`` with its max
    ``m_i`` and sum ``l_i`` (natural-log units); empty splits have ``l_i = 0`` and ``m_i = -inf``.

    partial [S, H, P, D], maxes/sums [S, H, P] -> [S, H, D]:
    ``out = sum_i w_i o_i / sum_i w_i`` with ``w_i = l_i exp(m_i - max_i m_i)``.
    """
    m_global = maxes.max(dim=-1, keepdim=True).values
    m_global = torch.where(torch.isfinite(m_global), m_global, torch.zeros_like(m_global))
    w = torch.where(sums > 0, sums * torch.exp(maxes - m_global), torch.zeros_like(sums))
    total = w.sum(dim=-1, keepdim=True)
    return (w[..., None] * partial).sum(dim=-2) / torch.where(total > 0, total, torch.ones_like(total))


def reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping):
    """The spec in PyTorch: same contract as ``reshape_and_cache`` (the Triton kernel)."""
    check_cache_write_args(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[1]
    real = slot_mapping >= 0
    slots = slot_mapping[real].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[real].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[real].to(value_cache.dtype)
