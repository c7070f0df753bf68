"""The KV cache's tensors and how big they may be.

Both stages store keys and values per layer as a flat run of token *slots*:
``[num_layers, num_slots, num_kv_heads, head_dim]``. Stage 1 carves that run into contiguous
regions; stage 2 views it as ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer (the
layout the Triton kernel reads) and addresses slots through block tables. How many slots the sizing
knobs give is decided in ``tinypaged.kv.sizing`` (the engine's and the simulator's one sizing).
"""

from __future__ import annotations

import torch


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys and values of one token across all layers: 2 x layers x kv_heads x head_dim x element size."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVCacheTensors:
    def __init__(self, num_layers, num_slots, num_kv_heads, head_dim, dtype, device, block_size=1,
                 num_cpu_blocks=0):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # Zeros, not empty: padded reads in the reference attention must never see NaN garbage.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        cpu_shape = (num_layers, num_cpu_blocks * block_size, num_kv_heads, head_dim)
        self.cpu_keys = torch.zeros(cpu_shape, dtype=dtype) if num_cpu_blocks else None
        self.cpu_values = torch.zeros(cpu_shape, dtype=dtype) if num_cpu_blocks else None

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    def paged_view(self, layer: int, which: str = "keys") -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] view of one layer."""
        t = getattr(self, which)[layer]
        return t.view(-1, self.block_size, *t.shape[1:])

    def _block_slots(self, block_ids) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        return (ids[:, None] * self.block_size + torch.arange(self.block_size)).flatten()

    def copy_blocks(self, src_blocks, dst_blocks) -> None:
        """Copy-on-write: each source block's keys and values to its destination block, in every layer (all
        sources are read before any destination is written)."""
        s, d = self._block_slots(src_blocks).to(self.keys.device), self._block_slots(dst_blocks).to(self.keys.device)
        self.keys[:, d] = self.keys[:, s]
        self.values[:, d] = self.values[:, s]

    def copy_to_cpu(self, gpu_blocks, cpu_blocks) -> None:
        g, c = self._block_slots(gpu_blocks), self._block_slots(cpu_blocks)
        self.cpu_keys[:, c] = self.keys[:, g.to(self.keys.device)].cpu()
        self.cpu_values[:, c] = self.values[:, g.to(self.keys.device)].cpu()

    def copy_to_gpu(self, cpu_blocks, gpu_blocks) -> None:
        g, c = self._block_slots(gpu_blocks), self._block_slots(cpu_blocks)
        self.keys[:, g.to(self.keys.device)] = self.cpu_keys[:, c].to(self.keys.device)
        self.values[:, g.to(self.keys.device)] = self.cpu_values[:, c].to(self.keys.device)

    def move_blocks(self, swap_out=(), swap_in=(), copies=()) -> None:
        """One step's block moves, lists of ``(from, to)`` block id pairs (``SchedulerOutput.blocks_to_swap_out``,
        ``blocks_to_swap_in``, ``blocks_to_copy``), in vLLM v0's order: swap-outs (device -> CPU), then swap-ins
        (CPU -> device), then copy-on-write copies (``cache_swap`` then ``cache_copy``)."""
        if swap_out:
            self.copy_to_cpu(*zip(*swap_out))
        if swap_in:
            self.copy_to_gpu(*zip(*swap_in))
        if copies:
            self.copy_blocks(*zip(*copies))
