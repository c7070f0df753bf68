"""Stage 6 checks: predict what a KV-size knob does, from first principles, then ask the engine.

* ``kv_blocks(kv_bytes, num_layers, num_kv_heads, head_dim, dtype_bytes, block_size)``: how many
  blocks a KV budget of ``kv_bytes`` holds (what ``gpu_memory_utilization`` or
  ``kv_cache_memory_bytes`` becomes inside the engine). The engine cases build the ``tiny`` model
  with that budget and record whether the prediction equals the blocks the engine made.
* ``max_concurrency(num_blocks, block_size, max_model_len)``: how many requests of
  ``max_model_len`` tokens can hold their KV at once (vLLM logs it at start-up). The engine cases
  submit such requests to the engine and record how many it admits in one step, next to the
  prediction.

The references are below (plain arithmetic, the same as the engine's sizing in
``tinypaged.model_runner`` and vLLM v1's ``kv_cache_utils``).
"""

from __future__ import annotations

import logging

from tinypaged.block_manager import blocks_needed
from tinypaged.checks import Case, register
from tinypaged.checks._util import rng


def kv_blocks(kv_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
              block_size: int) -> int:
    """Reference: a token's keys and values in every layer take 2 x layers x kv_heads x head_dim x
    bytes; a block holds ``block_size`` tokens; only whole blocks count."""
    return kv_bytes // (2 * num_layers * num_kv_heads * head_dim * dtype_bytes * block_size)


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """Reference: a full-length request holds ceil(max_model_len / block_size) blocks (its last block
    may be part empty); that many blocks at a time fit in ``num_blocks``."""
    return num_blocks // blocks_needed(max_model_len, block_size)


TINY = dict(num_layers=2, num_kv_heads=2, head_dim=16)  # tinypaged.model_loader.tiny_hf_config()
DTYPE_BYTES = {"float32": 4, "float16": 2}


def _tiny(**kw):
    from tinypaged import LLM
    from tinypaged.serving import quiet, shared_weights

    with shared_weights(), quiet():  # the same seeded weights for every case: load them once
        return LLM("tiny", device="cpu", **kw)


def _engine_blocks_case(kv_bytes: int, dtype: str, bs: int) -> Case:
    def run(fn, t):
        got = fn(kv_bytes, TINY["num_layers"], TINY["num_kv_heads"], TINY["head_dim"], DTYPE_BYTES[dtype], bs)
        built = _tiny(dtype=dtype, block_size=bs, kv_cache_memory_bytes=kv_bytes, max_model_len=64)
        t(f"tiny model (2 layers, 2 KV heads, head_dim 16), {dtype}, block_size {bs}, kv_cache_memory_bytes="
          f"{kv_bytes}: the prediction equals the {built.get_metrics()['kv_num_blocks']} blocks the engine built",
          got == built.get_metrics()["kv_num_blocks"])

    return Case(f"the engine, {dtype}, block {bs}", run, "the engine divides the bytes by the bytes of one block")


def _engine_admits_case(num_blocks: int, bs: int, mml: int) -> Case:
    def run(fn, t):
        from tinypaged.sampling_params import SamplingParams

        want = fn(num_blocks, bs, mml)
        if not isinstance(want, int) or isinstance(want, bool) or not 0 <= want <= 200:
            t("a whole number of requests", repr(want))
            return
        engine = _tiny(dtype="float32", block_size=bs, num_gpu_blocks_override=num_blocks, max_model_len=mml,
                       max_num_seqs=64, max_num_batched_tokens=64 * mml).llm_engine
        for i in range(want + 2):  # full-length prompts, all waiting at once
            engine.add_request(f"r{i}", {"prompt_token_ids": [5 + (i + j) % 50 for j in range(mml)]},
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        log = logging.getLogger("tinypaged")
        old, log.level = log.level, logging.ERROR
        try:
            admitted = len(engine.step().scheduled)
        finally:
            log.setLevel(old)
        t(f"{num_blocks} blocks of {bs}, max_model_len {mml}: [your prediction, requests the engine admitted at once]",
          [want, admitted])

    return Case(f"the engine, {num_blocks} blocks of {bs}", run,
                "the first step admits full-length requests while their blocks fit, and no more")


@register("06", "kv_blocks", reference=lambda: kv_blocks, points=1)
def cases_kv_blocks(hidden):
    if hidden is None:
        return [
            Case("round numbers", lambda f, t: t("kv_blocks(2**20, 1, 1, 64, 2, 16): 1 MiB, 256-byte tokens, "
                                                 "4 KiB blocks", f(2**20, 1, 1, 64, 2, 16))),
            Case("less than one block", lambda f, t: t("kv_blocks(4095, 1, 1, 64, 2, 16)", f(4095, 1, 1, 64, 2, 16)),
                 "only whole blocks count"),
            Case("SmolLM2 in bf16", lambda f, t: t("kv_blocks(512 * 2**20, 30, 3, 64, 2, 16): 23,040 bytes per token",
                                                   f(512 * 2**20, 30, 3, 64, 2, 16))),
            Case("OPT-13B in fp16", lambda f, t: t("kv_blocks(12 * 2**30, 40, 40, 128, 2, 16): the paper's 12 GB",
                                                   f(12 * 2**30, 40, 40, 128, 2, 16)),
                 "800 KB per token, 12.5 MiB per block"),
            _engine_blocks_case(300_000, "float32", 8),
            _engine_blocks_case(1 << 19, "float16", 32),
        ]
    r = rng(hidden, 61)
    calls = [(r.randrange(0, 2**34), r.randint(1, 80), r.choice([1, 2, 4, 8, 16]), r.choice([32, 64, 80, 128, 256]),
              r.choice([1, 2, 4]), r.choice([1, 8, 16, 32, 64, 128])) for _ in range(100)]
    return [Case("random models and budgets", lambda f, t: t(f"100 random configurations, e.g. kv_blocks{calls[0]}",
                                                             [f(*c) for c in calls]), weight=2),
            _engine_blocks_case(r.randrange(50_000, 2_000_000), r.choice(["float32", "float16"]), r.choice([4, 8, 16]))]


@register("06", "max_concurrency", reference=lambda: max_concurrency, points=1)
def cases_max_concurrency(hidden):
    if hidden is None:
        return [
            Case("not even one", lambda f, t: t("max_concurrency(100, 16, 2048)", f(100, 16, 2048)),
                 "a 2048-token request needs 128 blocks of 16"),
            Case("the paper's budget", lambda f, t: t("max_concurrency(983, 16, 2048): 15.7K token slots",
                                                      f(983, 16, 2048))),
            Case("a part-empty last block", lambda f, t: t("max_concurrency(10, 16, 17)", f(10, 16, 17)),
                 "a 17-token request holds 2 blocks of 16"),
            _engine_admits_case(24, 4, 30),
            _engine_admits_case(40, 16, 40),
        ]
    r = rng(hidden, 62)
    calls = [(r.randint(0, 5000), r.choice([1, 4, 8, 16, 32, 64]), r.randint(1, 4096)) for _ in range(100)]
    bs, mml = r.choice([4, 8]), r.randint(9, 33)
    return [Case("random caches", lambda f, t: t(f"100 random (num_blocks, block_size, max_model_len), e.g. "
                                                 f"{calls[0]}", [f(*c) for c in calls]), weight=2),
            _engine_admits_case(r.randint(blocks_needed(mml, bs), 30), bs, mml)]
