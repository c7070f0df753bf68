"""The loader's opt-in model cache (``shared_weights``): engines built inside share one model per (model, dtype,
device, seed) and compute what engines with their own copy compute; the cache is bounded; outside, loads are fresh."""

import torch

from tinypaged import LLM, SamplingParams
from tinypaged.lab.serving import shared_weights
from tinypaged.model import loader


def test_engines_built_inside_share_one_model_and_compute_the_same():
    knobs = dict(device="cpu", dtype="float32", kv_cache_tokens=256, max_model_len=64)
    with shared_weights():
        a, b = LLM("tiny", **knobs), LLM("tiny", block_size=4, **knobs)
    c = LLM("tiny", **knobs)
    assert a.llm_engine.model is b.llm_engine.model and c.llm_engine.model is not a.llm_engine.model
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in (a, b, c)]
    assert tokens[0] == tokens[1] == tokens[2]


def test_the_cache_keeps_the_most_recently_used_models_and_loads_outside_are_fresh():
    cpu = torch.device("cpu")
    with loader.shared_weights():
        first = loader.load_model("tiny", torch.float32, cpu)
        second = loader.load_model("tiny", torch.float64, "cpu")
        assert loader.load_model("tiny", torch.float32, "cpu") is first  # a device by name is the same device
        third = loader.load_model("tiny", torch.bfloat16, cpu)  # past SHARED_MODELS (2): the least recent goes
        assert loader.load_model("tiny", torch.bfloat16, cpu) is third
        assert loader.load_model("tiny", torch.float32, cpu) is first
        assert loader.load_model("tiny", torch.float64, cpu) is not second
    assert loader.load_model("tiny", torch.float64, cpu) is not loader.load_model("tiny", torch.float64, cpu)
