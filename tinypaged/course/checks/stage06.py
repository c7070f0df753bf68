"""Stage 6 checks: predict what a KV-size knob does, from first principles, then ask the engine.

* ``kv_blocks(kv_bytes, num_layers, num_kv_heads, head_dim, dtype_bytes, block_size)``: how many
  blocks a KV budget of ``kv_bytes`` holds (what ``gpu_memory_utilization`` or
  ``kv_cache_memory_bytes`` becomes inside the engine). Checked against the blocks the engine builds.
* ``max_concurrency(num_blocks, block_size, max_model_len)``: vLLM's "maximum concurrency" for requests
  of ``max_model_len`` tokens, the ratio it logs at start-up (whole part: how many such requests hold
  their KV at once). Checked by submitting such requests to the engine and counting how many it admits
  in one step.

The references are the engine's own sizing functions (``tinypaged.kv.sizing``). Both are checked on the
``tiny`` model (2 layers, 2 KV heads, head_dim 16), on the CPU.
"""

from __future__ import annotations

import logging

from tinypaged.course.checks import Case, register
from tinypaged.course.checks._util import rng
from tinypaged.kv.sizing import kv_blocks, max_concurrency

_TINY = dict(num_layers=2, num_kv_heads=2, head_dim=16)  # tinypaged.model.loader.tiny_hf_config()


def _table(what, rows):
    """One case: the implementation on each row of arguments."""
    return lambda f, t: t(what, [f(*row) for row in rows])


@register("06", "kv_blocks", reference=lambda: kv_blocks, points=1)
def cases_kv_blocks(hidden):
    if hidden is None:
        return [
            Case("round numbers", _table("1 MiB, 1 layer, 1 KV head, head_dim 64, fp16, block 16",
                                         [(2**20, 1, 1, 64, 2, 16)]),
                 "a token takes 2 x 1 x 1 x 64 x 2 = 256 bytes, a 16-token block 4 KiB: 1 MiB holds 256 blocks"),
            Case("less than a block", _table("4095 bytes, same model", [(4095, 1, 1, 64, 2, 16)]),
                 "only whole blocks count"),
            Case("SmolLM2 bf16", _table("512 MiB, 30 layers, 3 KV heads, head_dim 64, bf16, block 16",
                                        [(512 * 2**20, 30, 3, 64, 2, 16)]),
                 "23,040 bytes per token, 368,640 per block"),
            Case("tiny, as the engine sizes it", _table(
                "tiny (2 layers, 2 KV heads, head_dim 16): (300000 B, fp32, block 8), (512 KiB, fp16, block 32)",
                [(300_000, 2, 2, 16, 4, 8), (1 << 19, 2, 2, 16, 2, 32)]),
                 "the engine builds exactly this many blocks (tests/test_serving.py checks the reference against it)"),
        ]
    r = rng(hidden, 61)
    rows = [(r.randint(0, 2**34), r.randint(1, 80), r.choice([1, 2, 4, 8]), r.choice([64, 80, 128]),
             r.choice([1, 2, 4]), r.choice([1, 8, 16, 32])) for _ in range(60)]
    return [Case("random budgets and models", _table(f"60 random configurations, e.g. {rows[:1]}", rows), weight=2)]


@register("06", "max_concurrency", reference=lambda: max_concurrency, points=2)
def cases_max_concurrency(hidden):
    tol = 1e-9  # a ratio: the same quotient computed another way may differ in its last bits
    if hidden is None:
        return [
            Case("too few blocks", _table("100 blocks of 16, max_model_len 2048", [(100, 16, 2048)]),
                 "a 2048-token request needs 128 blocks of 16: 100 of them are 100/128 of one request", tol=tol),
            Case("a whole number of requests", _table("1024 blocks of 16, max_model_len 2048", [(1024, 16, 2048)]),
                 "1024 / 128", tol=tol),
            Case("a part-empty last block", _table("10 blocks of 16, max_model_len 17", [(10, 16, 17)]),
                 "a 17-token request needs 2 blocks of 16 (the second one holds 1 token): 10 / 2", tol=tol),
            Case("as the engine admits", _table("(24 blocks of 4, max_model_len 30), (40 blocks of 16, 40)",
                                                [(24, 4, 30), (40, 16, 40)]),
                 "the engine admits the whole part of this many full-length requests in its first step", tol=tol),
        ]
    r = rng(hidden, 62)
    rows = [(r.randint(0, 10**6), r.choice([1, 4, 8, 16, 32, 128]), r.randint(1, 8192)) for _ in range(60)]
    return [Case("random caches", _table(f"60 random (num_blocks, block_size, max_model_len), e.g. {rows[:1]}", rows),
                 weight=2, tol=tol)]


def engine_blocks(kv_bytes: int, dtype: str, block_size: int) -> int:
    """What the engine builds for the tiny model (tests compare the reference with it)."""
    from tinypaged import LLM
    from tinypaged.lab.serving import shared_weights

    with shared_weights():
        llm = LLM("tiny", device="cpu", dtype=dtype, block_size=block_size, kv_cache_memory_bytes=kv_bytes,
                  max_model_len=64)
    return llm.get_metrics()["kv_num_blocks"]


def engine_admits(num_blocks: int, block_size: int, max_model_len: int, requests: int) -> int:
    """How many full-length requests the engine admits in its first step (tests compare the reference)."""
    from tinypaged import LLM
    from tinypaged.sampling_params import SamplingParams
    from tinypaged.lab.serving import shared_weights

    log = logging.getLogger("tinypaged")
    old = log.level
    log.setLevel(logging.ERROR)
    try:
        with shared_weights():
            llm = LLM("tiny", device="cpu", dtype="float32", block_size=block_size, num_gpu_blocks_override=num_blocks,
                      max_model_len=max_model_len, max_num_seqs=64, max_num_batched_tokens=64 * max_model_len)
        engine = llm.llm_engine
        for i in range(requests):
            engine.add_request(f"r{i}", {"prompt_token_ids": [5 + (i + j) % 50 for j in range(max_model_len)]},
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        return len(engine.step().scheduled)
    finally:
        log.setLevel(old)
