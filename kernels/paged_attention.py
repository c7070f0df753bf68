"""PagedAttention for decoding: attention that reads keys and values through a block table.

During decode every sequence contributes one new query token, and that query must
attend to every token the sequence has cached so far. With paging, those cached
tokens are not contiguous: sequence ``s`` keeps its ``i``-th chunk of
``block_size`` tokens in physical block ``block_tables[s, i]``::

    token t of sequence s  ->  key_cache[block_tables[s, t // block_size], t % block_size]

Cache layout: ``key_cache/value_cache[num_blocks, block_size, num_kv_heads, head_dim]``.

Three implementations with one signature
``(query, key_cache, value_cache, block_tables, seq_lens, scale, num_splits=None)``:

* :func:`paged_attention_reference` - a Python loop over sequences: the readable spec.
* :func:`gather_then_attend` - the baseline: copy every sequence's K/V out of the
  pages into padded contiguous tensors, then run ordinary masked attention.
  Correct and vectorised, but it reads the context twice and writes it once.
  (These two are PyTorch only and live in ``reference.py``, importable without Triton.)
* :func:`paged_attention_decode` - the Triton kernel: it looks up block ids itself
  and reads each cached K/V vector exactly once (FlashAttention-style online softmax).

Decode attention is memory-bound: per query head it does ~2 FLOPs per K/V element
loaded. So the kernel is organised around *reading the cache once*:

* Grouped-query attention: one program per (sequence, KV head) handles all the query
  heads that share that KV head, so each K/V tile is loaded once for the whole group.
* Split-K ("flash-decoding", vLLM's paged_attention_v2): with few sequences there
  are too few (sequence, KV head) programs to occupy the GPU, so each sequence's
  context is also cut into ``num_splits`` partitions. Each writes a partial output
  with its running max and sum of exponentials; a second small kernel merges them.
"""

import torch
import triton
import triton.language as tl

from tinypaged.kernels.reference import check_decode_args as _check
from tinypaged.kernels.reference import gather_then_attend, paged_attention_reference  # noqa: F401 (re-exported)

# Tokens handled per loop iteration of the attention kernel. Independent of the
# page size: a tile may span several small pages or part of a big one.
TILE_TOKENS = 64
# Split-K heuristic (see _choose_num_splits).
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# Used when choosing splits on a machine without CUDA (e.g. under the interpreter):
# the SM count of an H100/H200, so the choice matches the course's target GPU.
_DEFAULT_SM_COUNT = 132

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr, max_ptr, sum_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e): we use exp2, which is cheaper than exp
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_op, stride_od,
    stride_ms, stride_mh, stride_mp,
    BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,          # True: write partial results for the reduce kernel
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 so the GPU does not round to TF32
    ACC_DTYPE: tl.constexpr,      # softmax state: fp32, or fp64 for fp64 inputs
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # Each sequence divides its *own* context evenly among the splits (rounded to
    # whole tiles), so no host-side maximum length is needed and short sequences
    # simply leave their last splits empty.
    seq_len = tl.load(seq_lens_ptr + seq)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    # The query heads of this KV group, padded to GROUP_PAD rows (tl.dot needs >= 16).
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * QUERIES_PER_KV + g
    g_mask = g < QUERIES_PER_KV
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    # Online softmax state: fp32 for 16/32-bit inputs, fp64 for fp64 (exact tests).
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=ACC_DTYPE)    # running max (log2 units)
    l_i = tl.zeros([GROUP_PAD], dtype=ACC_DTYPE)                  # running sum of exp2
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=ACC_DTYPE)         # running sum of p * v

    bt_row = block_tables_ptr + seq * stride_bts
    for tile_start in range(start, end, TILE_N):
        tok = tile_start + tl.arange(0, TILE_N)
        t_mask = tok < end
        # The paging step: logical token -> physical block id -> address.
        # int64 because block * stride overflows int32 in caches over 2 GiB elements.
        block = tl.load(bt_row + (tok // BLOCK_SIZE) * stride_btb, mask=t_mask, other=0).to(tl.int64)
        offset = tok % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]

        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_kt
                    + kv_head * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale   # [GROUP_PAD, TILE_N]
        s = tl.where(t_mask[None, :], s, float("-inf"))

        # Every tile holds at least one real token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)          # rescales what was accumulated so far
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vt
                    + kv_head * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (or an empty sequence) has l_i == 0: emit zeros, not NaNs.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_op + d[None, :] * stride_od
    o_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # Partial output (already normalised by its own sum) plus the softmax
        # statistics the reduce kernel needs to reweight it.
        tl.store(o_ptrs, out, mask=o_mask)
        stat_off = seq * stride_ms + heads * stride_mh + split * stride_mp
        tl.store(max_ptr + stat_off, m_i, mask=g_mask)
        tl.store(sum_ptr + stat_off, l_i, mask=g_mask)
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _split_reduce_kernel(
    out_ptr, partial_ptr, max_ptr, sum_ptr,
    stride_os, stride_oh, stride_od,
    stride_ps, stride_ph, stride_pp, stride_pd,
    stride_ms, stride_mh, stride_mp,
    num_splits,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    # One program per (sequence, query head): merge the partitions' results.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    p_mask = p < num_splits

    stat_off = seq * stride_ms + head * stride_mh + p * stride_mp
    m = tl.load(max_ptr + stat_off, mask=p_mask, other=float("-inf"))
    l = tl.load(sum_ptr + stat_off, mask=p_mask, other=0.0)
    # Split i computed o_i = sum_j exp2(s_j - m_i) v_j / l_i. Bringing every split to the
    # global max M: weight_i = l_i * exp2(m_i - M); out = sum_i weight_i o_i / sum_i weight_i.
    m_global = tl.max(m, axis=0)
    m_global = tl.where(m_global > float("-inf"), m_global, 0.0)  # all splits empty: avoid -inf - -inf
    weight = tl.where(l > 0, l * tl.exp2(m - m_global), 0.0)   # empty splits contribute nothing
    total = tl.sum(weight, axis=0)

    o = tl.load(partial_ptr + seq * stride_ps + head * stride_ph + p[:, None] * stride_pp + d[None, :] * stride_pd,
                mask=p_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(weight[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _dot_precision(dtype) -> str:
    """``tl.dot``'s precision: IEEE for fp32/fp64, so a GPU does not round the inputs to TF32 (10-bit
    mantissa) and the fp32 kernel stays within the checks' 1e-4 of the fp32 reference. 16-bit inputs
    are multiplied exactly by the tensor cores anyway (the argument is ignored for them)."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SM_COUNT


def _choose_num_splits(num_seqs, num_kv_heads, max_context, sm_count) -> int:
    """How many partitions to cut each context into.

    Split only when the plain grid (one program per sequence and KV head) would leave
    the GPU underused, i.e. has fewer than ~2 programs per SM, and never make a
    partition shorter than MIN_TOKENS_PER_SPLIT tokens: below that the extra writes
    and the reduce kernel cost more than the parallelism gains. Short contexts -> 1.
    """
    if max_context <= 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    programs = num_seqs * num_kv_heads
    by_occupancy = triton.cdiv(2 * sm_count, programs)
    by_length = max_context // MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, num_splits=None):
    """Decode attention over a paged KV cache (Triton).

    query [num_seqs, num_heads, head_dim]; key_cache/value_cache
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32
    [num_seqs, max_blocks_per_seq]; seq_lens int32 [num_seqs]. Returns
    [num_seqs, num_heads, head_dim] in query's dtype.

    ``num_splits=None`` chooses the split-K partition count from the batch shape
    (1, the single-pass kernel, for short contexts or large batches). The context
    length used for that choice is the block table's width times the block size,
    an upper bound that needs no device-to-host sync.
    """
    _check(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    queries_per_kv = num_heads // num_kv_heads
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out

    if num_splits is None:
        num_splits = _choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size,
                                        _sm_count(query.device))
    assert num_splits >= 1

    meta = dict(
        BLOCK_SIZE=block_size,
        QUERIES_PER_KV=queries_per_kv,
        GROUP_PAD=max(16, triton.next_power_of_2(queries_per_kv)),
        HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        TILE_N=TILE_TOKENS,
        DOT_PRECISION=_dot_precision(query.dtype),
        ACC_DTYPE=tl.float64 if query.dtype == torch.float64 else tl.float32,
    )
    grid = (num_seqs, num_kv_heads, num_splits)
    common = (query, key_cache, value_cache, block_tables, seq_lens, scale * _LOG2E,
              *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride())

    if num_splits == 1:
        # Single pass: write the final output directly; max/sum pointers unused.
        _paged_attention_kernel[grid](
            out, out, out, *common,
            out.stride(0), out.stride(1), 0, out.stride(2),
            0, 0, 0,
            SPLIT=False, **meta)
        return out

    acc_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=acc_dtype, device=query.device)
    maxes = torch.empty(num_seqs, num_heads, num_splits, dtype=acc_dtype, device=query.device)
    sums = torch.empty_like(maxes)
    _paged_attention_kernel[grid](
        partial, maxes, sums, *common,
        *partial.stride(), *maxes.stride(),
        SPLIT=True, **meta)
    _split_reduce_kernel[(num_seqs, num_heads)](
        out, partial, maxes, sums,
        *out.stride(), *partial.stride(), *maxes.stride(),
        num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
    )
    return out
