"""Write freshly computed keys and values into the paged KV cache.

Every forward pass produces one key and one value vector per token (per KV head).
Before attention can read them they must land in the cache, at the *slot* the
block manager chose for that token::

    slot = block_id * block_size + offset_in_block      (vLLM's slot mapping)

Cache layout (one tensor each for K and V, per layer)::

    key_cache[num_blocks, block_size, num_kv_heads, head_dim]

A slot of -1 marks a padding token (batches are padded to a common length or to
a CUDA-graph size): nothing is written for it.

Two implementations, same contract:

* :func:`reshape_and_cache_reference` - three lines of PyTorch indexing: the spec (in ``reference.py``,
  importable without Triton).
* :func:`reshape_and_cache` - a Triton kernel, one program per token.
"""

import torch
import triton
import triton.language as tl

from tinypaged.kernels.reference import check_cache_write_args as _check
from tinypaged.kernels.reference import reshape_and_cache_reference  # noqa: F401 (re-exported)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,            # key   [num_tokens, num_kv_heads, head_dim]
    stride_vt, stride_vh, stride_vd,            # value [num_tokens, num_kv_heads, head_dim]
    stride_kcb, stride_kcs, stride_kch, stride_kcd,  # key_cache   [blocks, block_size, heads, dim]
    stride_vcb, stride_vcs, stride_vch, stride_vcd,  # value_cache [blocks, block_size, heads, dim]
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    # int64: block_id * stride can exceed 2**31 in a large cache.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # Padding tokens (-1) are masked out of the store rather than returned from,
    # which keeps the kernel branch-free.
    is_real = slot >= 0
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & is_real

    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)

    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d * stride_kcd
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d * stride_vcd
    # The cache may use a narrower dtype than the activations (e.g. fp16 cache).
    tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Scatter ``key``/``value`` [num_tokens, num_kv_heads, head_dim] into the caches, in place.

    ``slot_mapping`` (integer, [num_tokens]): ``block_id * block_size + offset``; -1 skips the token.
    """
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = key_cache.shape[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )
