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
* :func:`paged_attention_decode` - the Triton kernels: :func:`paged_attention_kernel` looks up
  block ids itself and reads each cached K/V vector exactly once (FlashAttention-style online
  softmax); :func:`merge_splits_kernel` merges split-K partitions.

The two kernels are the ones a learner writes in stage 5's assignment
(``solutions/05_triton_paged_attention.ipynb``), line for line; this file adds the launcher that
the engine calls (``attention_backend="triton"``): it picks the padding, the tile and the split count
and checks the layout. Decode attention is memory-bound (per query head ~2 FLOPs per K/V element
loaded), so the kernel is organised around *reading the cache once*, and around doing its little
arithmetic where it costs nothing:

* Grouped-query attention: one program per (sequence, KV head) handles all the query
  heads that share that KV head, so each K/V tile is loaded once for the whole group.
* Matrix products: per tile of ``TILE_N`` keys the scores are one product
  ``q [GROUP_PAD, DIM] @ k^T [DIM, TILE_N]`` and the value sum one product ``p [GROUP_PAD, TILE_N] @ v
  [TILE_N, DIM]``, both ``tl.dot``, which a GPU runs on its tensor cores with the tiles in registers and
  shared memory. The same sums written as broadcast products and ``tl.sum`` (the lesson's first kernels)
  give the same numbers but build a ``[GROUP_PAD, TILE_N, DIM]`` temporary and reduce it on the ordinary
  cores: on an H200 that form reached 15% of a device copy, where an earlier ``tl.dot`` kernel of this
  course reached 101-104% (``benchmarks/bench_paged_attention.py``).
  The tensor cores work on tiles of at least 16 (Triton refuses a reduction dimension under 16), so the
  query group is padded to ``GROUP_PAD >= 16`` rows, ``head_dim`` to ``DIM_PAD >= 16`` columns and the key
  tile is ``TILE_N >= 16`` tokens (masked loads fill the padding with zeros). The padding rows are
  arithmetic, not bytes: the K/V tile is read once whatever the number of rows, and a decode step is
  bound by those bytes, far below the tensor cores' limit.
* Split-K ("flash-decoding", vLLM's paged_attention_v2): with few sequences there
  are too few (sequence, KV head) programs to occupy the GPU, so each sequence's
  context is also cut into ``num_splits`` partitions. Each writes a partial output
  with its running max and sum of exponentials; a second small kernel merges them.

The organisation is that of vLLM v1's Triton attention (``triton_unified_attention.py``: tiles of keys
read through the block table, ``tl.dot`` for both products, a 3D split-over-segments variant plus a
reduce for long decodes) and of the paper's CUDA kernels (``paged_attention_v1`` walks a sequence's block
table in one thread block; ``paged_attention_v2`` adds fixed 512-token partitions and a reduce). This
kernel is written to be read, not copied from either.
"""

import torch
import triton
import triton.language as tl

from tinypaged.kernels.reference import check_decode_args as _check
from tinypaged.kernels.reference import check_kernel_layout

# tl.dot's smallest tile side. Triton refuses a reduction dimension under 16 (head_dim in q @ k^T, TILE_N
# in p @ v) for 16/32-bit inputs, and the tensor cores' instructions (mma m16n8k16 on sm_80+, wgmma m64nNk16
# on sm_90) work on at least 16 rows anyway: the compiler would pad a smaller query group itself. The kernel
# pads the query group, head_dim and the key tile to at least this, visibly and with masks.
MIN_DOT = 16
# Keys per loop iteration of the attention kernel, independent of the page size (a tile may span several
# small pages or part of a big one): 64 tokens for head_dim <= 128, so a K or V tile is at most
# TILE_ELEMENTS elements (16 KiB in 16-bit, in registers and shared memory on a GPU); fewer for wider heads.
MAX_TILE_TOKENS = 64
TILE_ELEMENTS = 8192
# Split-K heuristic (see _choose_num_splits).
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# Used when choosing splits on a machine without CUDA (e.g. under the interpreter):
# the SM count of an H100/H200, so the choice matches the course's target GPU.
_DEFAULT_SM_COUNT = 132


@triton.jit
def paged_attention_kernel(
    out_ptr, m_ptr, l_ptr,                   # partial outputs [num_seqs, num_heads, num_splits, head_dim], m/l [.., num_splits]
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
    stride_qs, stride_qh,                    # query [num_seqs, num_heads, head_dim]
    stride_kb, stride_kt, stride_kh,         # caches [num_blocks, block_size, num_kv_heads, head_dim]
    stride_bts,                              # block_tables [num_seqs, max_blocks]
    stride_os, stride_oh, stride_op,         # partial outputs
    stride_ms, stride_mh,                    # m and l
    BLOCK_SIZE: tl.constexpr, QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TILE_N: tl.constexpr,
    ACC_DTYPE: tl.constexpr,                 # the running softmax's dtype: float32 (float64 for float64 inputs)
):
    """One program per (sequence, KV head, split): the online softmax over this split's tokens, read
    through the block table, for the query heads that share the KV head. Per tile of TILE_N keys the
    scores are one matrix product, q @ k^T, and the weighted values another, p @ v (``tl.dot``: tensor
    cores on a GPU; every dimension padded to >= 16). Stores the split's output (already divided by
    its own sum) and its m and l for :func:`merge_splits_kernel`."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # This program's share of the context: whole tiles, so splits never share a tile.
    per_split = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), TILE_N) * TILE_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)                  # query rows of this KV group, padded to >= 16 for tl.dot
    d = tl.arange(0, DIM_PAD)                    # head_dim, padded to >= 16 for tl.dot
    g_mask = g < QUERIES_PER_KV
    d_mask = d < HEAD_DIM
    heads = kv_head * QUERIES_PER_KV + g
    # [GROUP_PAD, DIM_PAD] in the cache's dtype (tl.dot multiplies two tiles of one dtype); padding is zero.
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=ACC_DTYPE)
    l_i = tl.zeros([GROUP_PAD], dtype=ACC_DTYPE)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=ACC_DTYPE)

    for tile_start in range(start, end, TILE_N):
        tok = tile_start + tl.arange(0, TILE_N)
        t_mask = tok < end
        # int64: block * stride_kb can exceed 2**31 in a large cache.
        block = tl.load(block_tables_ptr + seq * stride_bts + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        row = tok % BLOCK_SIZE
        kv = block[:, None] * stride_kb + row[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv, mask=kv_mask, other=0.0)              # [TILE_N, DIM_PAD]
        v = tl.load(v_cache_ptr + kv, mask=kv_mask, other=0.0)
        # "ieee": float32 inputs are multiplied in float32, not rounded to TF32 (16-bit ones are exact anyway).
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale          # [GROUP_PAD, TILE_N], ACC_DTYPE
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split stores zeros, l = 0 and m = -inf
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_op + d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(m_ptr + seq * stride_ms + heads * stride_mh + split, m_i, mask=g_mask)
    tl.store(l_ptr + seq * stride_ms + heads * stride_mh + split, l_i, mask=g_mask)


@triton.jit
def merge_splits_kernel(
    out_ptr, partial_ptr, m_ptr, l_ptr,
    stride_os, stride_oh,                    # out [num_seqs, num_heads, head_dim]
    stride_ps, stride_ph, stride_pp,         # partial [num_seqs, num_heads, num_splits, head_dim]
    stride_ms, stride_mh,                    # m, l [num_seqs, num_heads, num_splits]
    num_splits, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """One program per (sequence, query head): merge the splits' outputs. Split i computed
    o_i = sum_j exp(s_j - m_i) v_j / l_i; brought to the largest max M, its weight is
    w_i = l_i exp(m_i - M), and out = sum_i w_i o_i / sum_i w_i (empty splits: w_i = 0)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    p_mask = p < num_splits
    m = tl.load(m_ptr + seq * stride_ms + head * stride_mh + p, mask=p_mask, other=float("-inf"))
    l = tl.load(l_ptr + seq * stride_ms + head * stride_mh + p, mask=p_mask, other=0.0)
    o = tl.load(partial_ptr + seq * stride_ps + head * stride_ph + p[:, None] * stride_pp + d[None, :],
                mask=p_mask[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all > float("-inf"), m_all, 0.0)  # every split empty: avoid -inf - -inf
    w = tl.where(l > 0, l * tl.exp(m - m_all), 0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out)  # the store casts to out's dtype


def _padded(n: int) -> int:
    """A tile dimension for ``tl.dot``: the next power of two, at least MIN_DOT."""
    return max(MIN_DOT, triton.next_power_of_2(n))


def _tile_tokens(dim_pad: int) -> int:
    """TILE_N for :func:`paged_attention_kernel`: MAX_TILE_TOKENS keys while a K tile [TILE_N, DIM_PAD] stays
    within TILE_ELEMENTS (64 for head_dim <= 128, 32 for 256), never fewer than MIN_DOT."""
    return max(MIN_DOT, min(MAX_TILE_TOKENS, TILE_ELEMENTS // dim_pad))


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
    [num_seqs, num_heads, head_dim] in query's dtype. ``head_dim`` must be a power of two.

    The kernel's tiles are padded for ``tl.dot``: the query group to ``GROUP_PAD`` rows and ``head_dim`` to
    ``DIM_PAD`` columns, both powers of two >= 16, so 1 query head per KV head or head_dim 8 run too (the
    padding is masked). Keys go through in tiles of ``TILE_N`` (64 for head_dim <= 128).

    ``num_splits=None`` chooses the split-K partition count from the batch shape
    (1, no merge, for short contexts or large batches). The context length used for
    that choice is the block table's width times the block size, an upper bound that
    needs no device-to-host sync.
    """
    _check(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    check_kernel_layout(head_dim, key_cache, value_cache)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r}: give a whole number >= 1, or None to choose")
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = _choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size,
                                        _sm_count(query.device))

    if query.stride(-1) != 1:  # a view whose rows are not contiguous (a slice of q's heads is fine as it is)
        query = query.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    group = num_heads // num_kv_heads
    dim_pad = _padded(head_dim)
    # The softmax state and the partial outputs: fp32 for 16/32-bit inputs, fp64 for fp64 (exact tests).
    acc_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=acc_dtype, device=query.device)
    maxes = torch.empty(num_seqs, num_heads, num_splits, dtype=acc_dtype, device=query.device)
    sums = torch.empty_like(maxes)
    paged_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        partial, maxes, sums, query, key_cache, value_cache, block_tables, seq_lens, scale,
        query.stride(0), query.stride(1), *key_cache.stride()[:3], block_tables.stride(0),
        *partial.stride()[:3], *maxes.stride()[:2],
        BLOCK_SIZE=block_size, QUERIES_PER_KV=group, GROUP_PAD=_padded(group),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, TILE_N=_tile_tokens(dim_pad),
        ACC_DTYPE=tl.float64 if acc_dtype == torch.float64 else tl.float32,
    )
    if num_splits == 1:  # the one partition is the answer
        return out.copy_(partial[:, :, 0])
    merge_splits_kernel[(num_seqs, num_heads)](
        out, partial, maxes, sums, out.stride(0), out.stride(1), *partial.stride()[:3], *maxes.stride()[:2],
        num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
    )
    return out
