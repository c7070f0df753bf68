"""KV sizing is one function (tinypaged.kv.sizing), the lesson's: the engine and the simulator call it, and it gives
the blocks the engine always built. The CUDA profiling run itself is tests/test_gpu_sizing.py's (on a GPU)."""

from __future__ import annotations

import logging
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinypaged import LLM
from tinypaged.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from tinypaged.kv.sizing import KVLayout, kv_blocks, max_concurrency, size_kv_cache

pytestmark = pytest.mark.usefixtures("one_thread", "shared_weights")

TINY_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=4)  # tiny in float32: 512 B/token


def tiny(**kw) -> LLM:
    return LLM("tiny", device="cpu", dtype="float32", max_model_len=kw.pop("max_model_len", 64), **kw)


@settings(max_examples=300, deadline=None)
@given(kv_bytes=st.integers(0, 2**40), layers=st.integers(1, 96), heads=st.integers(1, 64),
       head_dim=st.sampled_from([16, 64, 80, 128, 256]), dtype_bytes=st.sampled_from([1, 2, 4, 8]),
       block_size=st.sampled_from([1, 4, 8, 16, 32, 128]))
def test_kv_blocks_is_whole_tokens_then_whole_blocks(kv_bytes, layers, heads, head_dim, dtype_bytes, block_size):
    """The engine used to round bytes down to tokens, then tokens down to blocks: the lesson's one division
    gives the same count for every budget, so the engine could take the lesson's function unchanged."""
    layout = KVLayout(layers, heads, head_dim, dtype_bytes)
    tokens = kv_bytes // layout.bytes_per_token
    assert kv_blocks(kv_bytes, *layout, 1) == tokens
    assert kv_blocks(kv_bytes, *layout, block_size) == tokens // block_size


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(0, 10**6), block_size=st.sampled_from([1, 4, 8, 16, 32, 128]),
       max_model_len=st.integers(1, 8192))
def test_max_concurrency_is_vllms_ratio(num_blocks, block_size, max_model_len):
    per_request = -(-max_model_len // block_size)
    ratio = max_concurrency(num_blocks, block_size, max_model_len)
    assert int(ratio) == num_blocks // per_request  # whole requests that fit at once
    if max_model_len % block_size == 0:  # the start-up line's old formula, to the last bit
        assert ratio == num_blocks * block_size / max_model_len


def config(**kw) -> EngineConfig:
    c = EngineConfig(model="tiny", device="cpu", **kw)
    c.finalize(2048)
    return c


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
@pytest.mark.parametrize("knob", [dict(kv_cache_tokens=1000), dict(num_gpu_blocks_override=37),
                                  dict(kv_cache_memory_bytes=300_000)])
def test_the_engine_builds_what_the_sizing_function_says(kv_cache, knob):
    """Each knob, paged and contiguous: the engine's cache is size_kv_cache's, and that is what the runner
    computed before it was moved out (tokens from the knob, then whole blocks)."""
    block_size = 8
    llm = tiny(kv_cache_manager=kv_cache, block_size=block_size, **knob)
    built = llm.llm_engine.kv.num_blocks if kv_cache == "paged" else llm.llm_engine.kv_tensors.num_slots
    size = size_kv_cache(llm.llm_engine.config, llm.llm_engine.runner.kv_layout)
    assert llm.llm_engine.runner.kv_layout == TINY_LAYOUT
    assert (size.num_blocks, size.block_size) == (built, block_size if kv_cache == "paged" else 1)
    tokens = {"kv_cache_tokens": lambda v: v, "num_gpu_blocks_override": lambda v: v * block_size,
              "kv_cache_memory_bytes": lambda v: v // TINY_LAYOUT.bytes_per_token}
    [(name, value)] = knob.items()
    tokens = tokens[name](value)
    assert built == (tokens // block_size if kv_cache == "paged" else tokens)


def test_the_gpu_budget_is_asked_for_only_when_no_knob_sizes_the_cache():
    def never():
        raise AssertionError("profiled although a knob sizes the cache")

    assert size_kv_cache(config(kv_cache_tokens=64), TINY_LAYOUT, True, never).num_blocks == 4
    assert size_kv_cache(config(kv_cache_memory_bytes=10**6), TINY_LAYOUT, True, never).num_blocks == 122
    assert size_kv_cache(config(), TINY_LAYOUT, True, lambda: 16 * 8192).num_blocks == 16
    assert size_kv_cache(config(), TINY_LAYOUT, False, never).num_blocks == CPU_DEFAULT_KV_BYTES // 8192
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization=0.9 gives a KV cache of 15 tokens, less than one "
                                         r"block of block_size=16 tokens \(8192 bytes\): raise gpu_memory_utilization"):
        size_kv_cache(config(), TINY_LAYOUT, True, lambda: 15 * 512 + 511)


def test_without_a_model_a_size_in_bytes_is_refused_naming_the_token_knobs():
    for kw in (dict(kv_cache_memory_bytes=10**6), {}):
        with pytest.raises(ValueError, match=r"give the size in tokens with kv_cache_tokens="):
            size_kv_cache(config(**kw))


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("max_model_len, want", [(17, "5.00"), (32, "5.00"), (64, "2.50")])
def test_the_capacity_line_is_vllms_maximum_concurrency(max_model_len, want):
    """10 blocks of 16: a 17-token request holds 2 blocks, so 5 fit at once (vLLM logs 5.00x); tokens over
    max_model_len (160 / 17 = 9.41x, the line before) counted part-empty blocks as free room."""
    logger = logging.getLogger("tinypaged")
    cap, level = _Capture(), logger.level
    logger.addHandler(cap)
    logger.setLevel(logging.INFO)
    try:
        llm = tiny(block_size=16, num_gpu_blocks_override=10, max_model_len=max_model_len)
    finally:
        logger.removeHandler(cap)
        logger.setLevel(level)
    line = next(l for l in cap.lines if "KV cache (paged)" in l)
    assert re.search(rf"maximum concurrency for {max_model_len}-token requests: {re.escape(want)}x$", line), line
    assert llm.llm_engine.kv.num_blocks == 10
