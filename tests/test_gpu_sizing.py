"""vLLM v1's KV sizing on a CUDA device (skipped without one; scripts/gpu_check.sh runs it on a GPU).

requested = total x gpu_memory_utilization; start-up fails when less than that is free; the KV cache
gets requested - (weights + activation peak of the profiling forward + memory torch does not track).
"""

import gc

import pytest
import torch

from tinypaged import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_kv_cache_is_sized_from_gpu_memory_utilization():
    free, total = torch.cuda.mem_get_info()
    small = LLM("tiny", dtype="float32", device="cuda", gpu_memory_utilization=0.05, max_model_len=256)
    kv = small.llm_engine.kv
    bytes_per_block = small.llm_engine.bytes_per_token * kv.block_size
    kv_bytes = kv.num_blocks * bytes_per_block
    assert 0 < kv_bytes <= 0.05 * total
    assert kv_bytes > 0.05 * total - 2 * 2**30, "weights and activations of 'tiny' are far below 2 GiB"
    n_small = kv.num_blocks
    del small, kv
    gc.collect()
    torch.cuda.empty_cache()
    big = LLM("tiny", dtype="float32", device="cuda", gpu_memory_utilization=0.10, max_model_len=256)
    assert big.llm_engine.kv.num_blocks > 1.9 * n_small, "twice the share, about twice the blocks"


def test_start_up_fails_when_less_than_the_share_is_free():
    free, total = torch.cuda.mem_get_info()
    hog = torch.empty(int(free - 0.5 * total), dtype=torch.uint8, device="cuda")  # leave under half free
    try:
        with pytest.raises(ValueError, match="less than the requested share gpu_memory_utilization=0.9"):
            LLM("tiny", dtype="float32", device="cuda", gpu_memory_utilization=0.9, max_model_len=256)
    finally:
        del hog
        torch.cuda.empty_cache()
