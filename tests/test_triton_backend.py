"""The whole engine with ``attention_backend="triton"`` generates exactly what the torch backend does.

With the Triton backend, decode attention runs ``paged_attention_decode`` (reading K/V through the
block tables) and every K/V write goes through ``reshape_and_cache``; prefill attention stays on the
torch path. Greedy decoding must not notice the swap, under everything that moves blocks around:
several block sizes, ragged prompts, grouped-query attention ("tiny" has 4 query heads sharing 2 KV
heads), prefix caching (decodes read blocks another request wrote) and preemption (blocks freed and
recomputed).

Both float64 (the kernel keeps its softmax state in fp64 then) and float32 are covered. Without CUDA
the kernels run in Triton's interpreter, so the model is "tiny" and the generations are short.
"""

import pytest
import torch

import tinypaged.kernels
from tinypaged import LLM, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels need CUDA tensors
SHARED = list(range(300, 320))  # 20 tokens: more than one full block at block sizes 8 and 16


def prompts_ragged():
    # 1 token, less than a block, exactly two blocks of 8, and longer than two blocks of 16.
    lengths = [1, 5, 16, 37]
    return [{"prompt_token_ids": [(7 * i + 3 * n) % 1000 + 10 for i in range(n)]} for n in lengths]


def prompts_shared_prefix():
    return [{"prompt_token_ids": SHARED + tail} for tail in ([11, 12], [13], [14, 15, 16], [11, 12, 99])]


def generate(backend, prompts, max_tokens=8, **kw):
    """Greedy token ids per prompt, the engine's metrics, and how many decode kernel calls ran."""
    calls = {"decode": 0}
    original = tinypaged.kernels.paged_attention_decode

    def counting(*args, **kwargs):
        calls["decode"] += 1
        return original(*args, **kwargs)

    llm = LLM(model="tiny", device=DEVICE, attention_backend=backend, **kw)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tinypaged.kernels.paged_attention_decode = counting  # attention.py looks it up at call time
    try:
        outs = llm.generate(prompts, params)
    finally:
        tinypaged.kernels.paged_attention_decode = original
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics(), calls["decode"]


def assert_same_tokens(prompts, **kw):
    ref, ref_metrics, ref_calls = generate("torch", prompts, **kw)
    got, metrics, calls = generate("triton", prompts, **kw)
    assert ref_calls == 0, "the torch backend must not call the Triton kernel"
    assert calls > 0, "the Triton backend never ran paged_attention_decode"
    assert got == ref, f"triton tokens {got} != torch tokens {ref}"
    return ref_metrics, metrics


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_ragged_prompts(dtype, block_size):
    assert_same_tokens(prompts_ragged(), dtype=dtype, block_size=block_size, num_gpu_blocks_override=64)


@pytest.mark.parametrize("block_size", [8, 16])
def test_prefix_caching(block_size):
    ref_m, m = assert_same_tokens(prompts_shared_prefix(), dtype="float64", block_size=block_size,
                                  enable_prefix_caching=True, num_gpu_blocks_override=64)
    assert m["prefix_cache_hits"] > 0, "the prompts share a full block: later requests must hit the cache"
    assert m["prefix_cache_hits"] == ref_m["prefix_cache_hits"]


def test_preemption():
    # 10 blocks of 8 tokens cannot hold four sequences growing to 21-52 tokens: the scheduler must
    # preempt (recompute), and the recomputed requests must still decode the same tokens.
    ref_m, m = assert_same_tokens(prompts_ragged(), max_tokens=15, dtype="float64", block_size=8,
                                  num_gpu_blocks_override=10)
    assert m["num_preemptions"] > 0, "the cache is sized to force preemption"
    assert m["num_preemptions"] == ref_m["num_preemptions"]


def test_prefix_caching_with_preemption_float32():
    _, m = assert_same_tokens(prompts_shared_prefix(), max_tokens=10, dtype="float32", block_size=8,
                              enable_prefix_caching=True, num_gpu_blocks_override=8)
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
