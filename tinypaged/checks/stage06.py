"""Stage 6 checks: predict what a KV-size knob does, from first principles, then ask the engine.

* ``kv_blocks(kv_bytes, num_layers, num_kv_heads, head_dim, dtype_bytes, block_size)``: how many
  blocks a KV budget of ``kv_bytes`` holds (what ``gpu_memory_utilization`` or
  ``kv_cache_memory_bytes`` becomes inside the engine). Checked against the blocks the engine builds.
* ``max_concurrency(num_blocks, block_size, max_model_len)``: how many requests of
  ``max_model_len`` tokens can hold their KV at once (vLLM logs it at start-up). Checked by
  submitting such requests to the engine and counting how many it admits in one step.

Both are checked on the ``tiny`` model (2 layers, 2 KV heads, head_dim 16), on the CPU.
"""

from __future__ import annotations

import logging

from tinypaged.block_manager import blocks_needed
from tinypaged.checks import register


def kv_blocks(kv_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
              block_size: int) -> int:
    """Reference: a token's keys and values in every layer take 2 x layers x kv_heads x head_dim x
    bytes; a block holds ``block_size`` tokens; only whole blocks count."""
    return kv_bytes // (2 * num_layers * num_kv_heads * head_dim * dtype_bytes * block_size)


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """Reference: a full-length request holds ceil(max_model_len / block_size) blocks (its last block
    may be part empty); that many blocks at a time fit in ``num_blocks``."""
    return num_blocks // blocks_needed(max_model_len, block_size)


_TINY = dict(num_layers=2, num_kv_heads=2, head_dim=16)  # tinypaged.model_loader.tiny_hf_config()


def _tiny(**kw):
    from tinypaged import LLM
    from tinypaged.serving import shared_weights

    with shared_weights():  # the same seeded weights for every check: load them once
        return LLM("tiny", device="cpu", **kw)


def _call_int(fn, *args, what: str) -> int:
    got = fn(*args)
    assert isinstance(got, int) and not isinstance(got, bool), \
        f"{what}: return a whole number (int), got {got!r} ({type(got).__name__})"
    return got


@register("06", "kv_blocks", reference=lambda: kv_blocks)
def check_kv_blocks(fn) -> None:
    # first principles, on round numbers
    got = _call_int(fn, 2**20, 1, 1, 64, 2, 16, what="1 MiB, 1 layer, 1 KV head, head_dim 64, fp16, block 16")
    assert got == 256, f"a token takes 2 x 1 x 1 x 64 x 2 = 256 bytes, a block of 16 tokens 4 KiB; 1 MiB holds " \
                       f"256 blocks, got {got}"
    got = _call_int(fn, 4095, 1, 1, 64, 2, 16, what="4095 bytes")
    assert got == 0, f"4095 bytes is less than one 4096-byte block: 0 blocks (only whole blocks count), got {got}"
    # SmolLM2-135M in bf16: 30 layers, 3 KV heads, head_dim 64 -> 23,040 bytes per token
    got = _call_int(fn, 512 * 2**20, 30, 3, 64, 2, 16, what="SmolLM2 bf16, 512 MiB, block 16")
    assert got == 1456, f"SmolLM2 in bf16 takes 23,040 bytes per token, 368,640 per 16-token block: 512 MiB " \
                        f"holds 1456 blocks, got {got}"
    # the engine: tiny model, several budgets, dtypes and block sizes
    for kv_bytes, dtype, nbytes, bs in ((300_000, "float32", 4, 8), (1 << 19, "float16", 2, 32)):
        llm = _tiny(dtype=dtype, block_size=bs, kv_cache_memory_bytes=kv_bytes, max_model_len=64)
        engine_blocks = llm.get_metrics()["kv_num_blocks"]
        got = _call_int(fn, kv_bytes, _TINY["num_layers"], _TINY["num_kv_heads"], _TINY["head_dim"], nbytes, bs,
                        what=f"tiny, {kv_bytes} bytes, {dtype}, block {bs}")
        assert got == engine_blocks, f"tiny model (2 layers, 2 KV heads, head_dim 16), {dtype}, block_size {bs}, " \
                                     f"kv_cache_memory_bytes={kv_bytes}: the engine built {engine_blocks} blocks, " \
                                     f"your kv_blocks says {got}"


@register("06", "max_concurrency", reference=lambda: max_concurrency)
def check_max_concurrency(fn) -> None:
    got = _call_int(fn, 100, 16, 2048, what="100 blocks of 16, max_model_len 2048")
    assert got == 0, f"a 2048-token request needs 128 blocks of 16; 100 blocks hold none at full length, got {got}"
    got = _call_int(fn, 1000, 16, 2048, what="1000 blocks of 16, max_model_len 2048")
    assert got == 7, f"1000 blocks // 128 blocks per 2048-token request = 7, got {got}"
    got = _call_int(fn, 10, 16, 17, what="10 blocks of 16, max_model_len 17")
    assert got == 5, f"a 17-token request needs 2 blocks of 16 (its last block is nearly empty): 10 // 2 = 5, got {got}"
    # the engine: requests whose prompt is max_model_len tokens long, all waiting at once; the first
    # step admits (and prefills) as many as can hold their KV, and no more.
    from tinypaged.sampling_params import SamplingParams

    log = logging.getLogger("tinypaged")
    old = log.level
    log.setLevel(logging.ERROR)
    try:
        for num_blocks, bs, mml in ((24, 4, 30), (40, 16, 40)):
            want = _call_int(fn, num_blocks, bs, mml, what=f"{num_blocks} blocks of {bs}, max_model_len {mml}")
            llm = _tiny(dtype="float32", block_size=bs, num_gpu_blocks_override=num_blocks, max_model_len=mml,
                        max_num_seqs=64, max_num_batched_tokens=64 * mml)
            engine = llm.llm_engine
            for i in range(want + 2):
                engine.add_request(f"r{i}", {"prompt_token_ids": [5 + (i + j) % 50 for j in range(mml)]},
                                   SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            admitted = len(engine.step().scheduled)
            assert admitted == want, f"{num_blocks} blocks of {bs} tokens, max_model_len {mml}: you predicted " \
                                     f"{want} full-length requests at once, the engine admitted {admitted}"
    finally:
        log.setLevel(old)
