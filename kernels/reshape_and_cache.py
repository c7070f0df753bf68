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
* :func:`reshape_and_cache` - the Triton kernel :func:`reshape_and_cache_kernel`, one program per token (the
  one a learner writes in stage 5's assignment, line for line) and its launcher.
"""

import triton
import triton.language as tl

from tinypaged.kernels.reference import check_cache_write_args as _check
from tinypaged.kernels.reference import check_kernel_layout


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh,                    # key, value [num_tokens, num_kv_heads, head_dim]
    stride_cb, stride_ct, stride_ch,         # caches [num_blocks, block_size, num_kv_heads, head_dim]
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its key and value (all KV heads) to its slot. Padding tokens (slot -1)
    are masked out of the store rather than returned from, which keeps the kernel branch-free; the store
    casts to the cache's dtype (e.g. fp32 activations into an fp16 cache)."""
    token = tl.program_id(0)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: block * stride_cb can exceed 2**31
    mask = (h < NUM_KV_HEADS) & (slot >= 0)
    src = token * stride_kt + h * stride_kh + d
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h * stride_ch + d
    tl.store(key_cache_ptr + dst, tl.load(key_ptr + src, mask=mask), mask=mask)
    tl.store(value_cache_ptr + dst, tl.load(value_ptr + src, mask=mask), mask=mask)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Scatter ``key``/``value`` [num_tokens, num_kv_heads, head_dim] into the caches, in place.

    ``slot_mapping`` (integer, [num_tokens]): ``block_id * block_size + offset``; -1 skips the token.
    ``head_dim`` must be a power of two, and the caches must share one layout with contiguous rows.
    """
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    check_kernel_layout(head_dim, key_cache, value_cache)
    if num_tokens == 0:
        return
    if key.stride() != value.stride() or key.stride(-1) != 1:  # the kernel reads both with key's strides
        key, value = key.contiguous(), value.contiguous()
    slot_mapping = slot_mapping.contiguous()
    reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, key.stride(0), key.stride(1), *key_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
    )
