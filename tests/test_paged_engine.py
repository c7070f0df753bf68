"""Stage 2 end to end: the paged engine produces the same greedy tokens as the contiguous engine and
as transformers, at any block size; a tiny cache serves many requests a few at a time; a request
that can never fit is refused at admission; metrics and the capacity log line report the blocks."""

from __future__ import annotations

import logging
import random
import re

import pytest
import torch

from tinypaged import LLM, SamplingParams
from tinypaged.model.loader import tiny_hf_model

MAX_NEW = 10
PROMPT_LENS = (1, 5, 17, 33, 9)  # ragged: shorter than, equal to and longer than a block


def tiny(**kw) -> LLM:
    kw = {"dtype": "float64", "device": "cpu", "max_model_len": 64, **kw}
    return LLM("tiny", **kw)


def token_prompts(lens, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(n)]} for n in lens]


def greedy(max_tokens=MAX_NEW):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts():
    return token_prompts(PROMPT_LENS)


@pytest.fixture(scope="module")
def hf_tokens(prompts):
    model = tiny_hf_model().double()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p["prompt_token_ids"]])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def contiguous_tokens(prompts):
    return token_ids(tiny(kv_cache_manager="contiguous", kv_cache_tokens=512).generate(prompts, greedy()))


def test_contiguous_matches_transformers(contiguous_tokens, hf_tokens):
    assert contiguous_tokens == hf_tokens


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_matches_contiguous_and_transformers(block_size, prompts, hf_tokens, contiguous_tokens):
    llm = tiny(kv_cache_manager="paged", block_size=block_size, kv_cache_tokens=512)
    got = token_ids(llm.generate(prompts, greedy()))
    assert got == contiguous_tokens == hf_tokens
    m = llm.get_metrics()
    assert m["kv_blocks_used"] == 0 and m["kv_blocks_free"] == 512 // block_size, "blocks leaked after the run"


def test_smollm2_paged_matches_contiguous(monkeypatch):
    from tinypaged.engine import core as llm_engine
    from tinypaged.model.loader import smollm2_folder

    try:
        smollm2_folder()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    loaded = {}

    def load_once(*args):  # both engines read the same weights: load them once (the engine never writes them)
        if args not in loaded:
            loaded[args] = llm_engine.load_model.__wrapped__(*args)
        return loaded[args]

    load_once.__wrapped__ = llm_engine.load_model
    monkeypatch.setattr(llm_engine, "load_model", load_once)
    prompts = ["The capital of France is", "Paged memory lets an operating system"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    common = {"dtype": "float32", "device": "cpu", "kv_cache_tokens": 256, "max_model_len": 64}
    contiguous = LLM("smollm2-135m", kv_cache_manager="contiguous", **common).generate(prompts, params)
    paged = LLM("smollm2-135m", kv_cache_manager="paged", block_size=16, **common).generate(prompts, params)
    assert len(loaded) == 1
    assert token_ids(paged) == token_ids(contiguous)
    assert all(len(t) == 32 for t in token_ids(paged))


@pytest.mark.parametrize("scheduler", ["static", None])
def test_four_block_cache_serves_many_requests_a_few_at_a_time(scheduler):
    """4 blocks of 8 tokens; 12 requests of up to 12 tokens each. Static batching reserves each
    request's worst case (2 blocks) before admitting it, so it never preempts; continuous batching
    admits on the prompt's blocks and preempts (recompute) when the cache runs dry."""
    prompts = token_prompts([3, 6, 4, 5, 2, 6, 3, 4, 5, 6, 2, 3], seed=1)
    params = greedy(6)
    reference = token_ids(tiny(kv_cache_manager="paged", block_size=8, kv_cache_tokens=1024).generate(prompts, params))
    llm = tiny(kv_cache_manager="paged", block_size=8, num_gpu_blocks_override=4, scheduler_cls=scheduler)
    engine = llm.llm_engine
    seen = []

    def watch(step):
        m = engine.get_metrics()
        assert m["kv_blocks_used"] <= 4
        seen.append(len(step.scheduled))

    outs = llm.generate(prompts, params, on_step=watch)
    assert token_ids(outs) == reference, "a small cache must change the schedule, never the tokens"
    assert all(o.finished and len(o.outputs[0].token_ids) == 6 for o in outs)
    assert 2 <= max(seen) <= 4, f"expected a few requests at a time, saw batches of {sorted(set(seen))}"
    m = llm.get_metrics()
    assert m["num_requests_finished"] == 12 and m["kv_blocks_used"] == 0 and not engine.has_unfinished_requests()
    if scheduler == "static":
        assert m["num_preemptions"] == 0, "static batching guarantees the blocks up front"
    else:
        assert m["num_preemptions"] > 0


def test_request_larger_than_the_cache_is_refused_and_nothing_is_lost():
    llm = tiny(kv_cache_manager="paged", block_size=8, num_gpu_blocks_override=4)  # 32 tokens in all
    engine = llm.llm_engine
    good = token_prompts([5, 7], seed=2)
    expected = token_ids(tiny(kv_cache_manager="paged", block_size=8, kv_cache_tokens=512).generate(good, greedy(6)))
    big = token_prompts([10])[0]
    with pytest.raises(ValueError, match="can never fit"):  # generate() validates before queueing anything
        llm.generate([good[0], big], [greedy(6), greedy(40)])
    assert not engine.has_unfinished_requests()
    engine.add_request("a", good[0], greedy(6))
    engine.add_request("b", good[1], greedy(6))
    with pytest.raises(ValueError, match=r"can never fit in the KV cache.*needs up to 50 tokens.*holds 32"):
        engine.add_request("too-big", big, greedy(40))
    finished = {}
    for _ in range(100):
        for out in engine.step().finished:
            finished[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert finished == {"a": expected[0], "b": expected[1]}
    assert token_ids(llm.generate(good, greedy(6))) == expected  # and the engine keeps working


def test_metrics_report_blocks_and_waste():
    llm = tiny(kv_cache_manager="paged", block_size=4, num_gpu_blocks_override=32)
    engine = llm.llm_engine
    checked = []

    def watch(step):
        m = engine.get_metrics()
        assert m["kv_blocks_used"] + m["kv_blocks_free"] == m["kv_num_blocks"] == 32
        assert m["kv_cache_usage"] == m["kv_blocks_used"] / 32
        held = sum(s.num_computed_tokens for s in engine.scheduler.running)
        assert m["kv_waste_tokens"] == m["kv_blocks_used"] * 4 - held
        assert 0 <= m["kv_waste_tokens"] < 4 * max(len(engine.scheduler.running), 1)
        checked.append(m["kv_blocks_used"])

    llm.generate(token_prompts([3, 9, 14]), greedy(7), on_step=watch)
    assert max(checked) > 0
    m = llm.get_metrics()
    assert (m["kv_cache_usage"], m["kv_blocks_used"], m["kv_blocks_free"], m["kv_waste_tokens"]) == (0.0, 0, 32, 0)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_capacity_log_line():
    logger = logging.getLogger("tinypaged")
    cap, level = _Capture(), logger.level
    logger.addHandler(cap)
    logger.setLevel(logging.INFO)  # the engine configures logging only when it finds no handler: do not depend on order
    try:
        tiny(kv_cache_manager="paged", block_size=16, num_gpu_blocks_override=32)
    finally:
        logger.removeHandler(cap)
        logger.setLevel(level)
    lines = [l for l in cap.lines if "KV cache (paged)" in l]
    assert len(lines) == 1, cap.lines
    # tiny: 2 layers x 2 KV heads x head_dim 16 x 2 (K and V) x 8 bytes (float64) = 1024 bytes per token
    assert "32 blocks of 16 tokens" in lines[0]
    assert "16384 bytes per block" in lines[0]
    assert "= 512 tokens" in lines[0]
    assert re.search(r"maximum concurrency for 64-token requests: 8\.00x", lines[0]), lines[0]
