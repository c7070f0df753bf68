"""Small helpers for stage 5's lesson and exercise (plain PyTorch, no kernels).

* :func:`random_paged_batch` - a random decode batch whose pages are scattered through the cache.

The online softmax of stage 5's part 1 (``online_softmax_update``) is the PyTorch spec of the Triton kernel's loop
body: it lives with the other specs in ``tinypaged.kernels.reference``.
"""

import torch

from tinypaged.kv.block_pool import blocks_needed


def random_paged_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
                       device="cpu", seed=0, pad_block=None):
    """Random ``(query, key_cache, value_cache, block_tables, seq_lens)`` for decode attention.

    Each sequence gets ``ceil(len / block_size)`` pages in a shuffled order, and the block table
    has one spare column. Unused table entries point at ``pad_block`` when given (a real block,
    so reading it cannot crash but would change the answer), else hold -1.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [blocks_needed(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    fill = -1 if pad_block is None else pad_block
    if pad_block is not None:
        physical.remove(pad_block)
    tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), fill, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        tables[s, :nb] = torch.tensor(physical[used:used + nb], dtype=torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (query, key_cache, value_cache, tables, lens))
