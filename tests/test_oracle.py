"""Correctness oracle: tinypaged's own forward against Hugging Face transformers on the same weights.

Greedy token ids must be identical, and the logits of every step must agree within a stated
tolerance: 1e-6 for the float64 "tiny" model (transformers returns scores in float32), 2e-3 for SmolLM2 in float32
(logits there are O(10-30); the difference is summation order across 30 layers).
"""

import json

import pytest
import torch

from tinypaged import LLM, SamplingParams
from tinypaged.model.loader import smollm2_folder, tiny_hf_model

TINY_LOGIT_TOL = 1e-6  # transformers hands back scores in float32
SMOLLM2_LOGIT_TOL = 2e-3


def record_logits(llm):
    """Wrap the model runner so every step's sampled-row logits are kept (test-only)."""
    runner = llm.llm_engine.runner
    seen = []
    original = runner.execute

    def execute(scheduled):
        logits, seqs = original(scheduled)
        if logits is not None:
            seen.extend(zip([s.seq_id for s in seqs], logits.clone()))
        return logits, seqs

    runner.execute = execute
    return seen


def hf_greedy(hf, prompt_ids, max_new_tokens):
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                      output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt_ids):].tolist(), [s[0] for s in out.scores]


@pytest.fixture(scope="module")
def tiny_hf():
    return tiny_hf_model(seed=0).double()


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_tiny_float64_tokens_and_logits_match_transformers(tiny_hf, kv_cache):
    prompts = [[1, 5, 7, 9, 11], list(range(100, 137)), [42], [7] * 20]
    llm = LLM("tiny", dtype="float64", device="cpu", kv_cache_manager=kv_cache, kv_cache_tokens=1024, max_model_len=128,
              block_size=4)
    seen = record_logits(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=16))
    by_seq = {}
    for seq_id, row in seen:
        by_seq.setdefault(seq_id, []).append(row)
    for p, out, rows in zip(prompts, outs, by_seq.values()):
        ref_tokens, ref_scores = hf_greedy(tiny_hf, p, 16)
        assert out.outputs[0].token_ids == ref_tokens[: len(out.outputs[0].token_ids)]
        for mine, ref in zip(rows, ref_scores):
            assert torch.allclose(mine.double(), ref.double(), atol=TINY_LOGIT_TOL, rtol=0)


def test_tiny_model_from_a_local_folder(tmp_path, tiny_hf):
    """Any local Hugging Face folder (config.json + safetensors) loads by path."""
    tiny_hf.float().save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float64", device="cpu", kv_cache_tokens=512)
    out = llm.generate({"prompt_token_ids": [3, 1, 4, 1, 5]}, SamplingParams(temperature=0, max_tokens=8))[0]
    ref, _ = hf_greedy(tiny_hf_model(seed=0).double(), [3, 1, 4, 1, 5], 8)
    assert out.outputs[0].token_ids == ref[: len(out.outputs[0].token_ids)]


def test_qwen2_folder_matches_transformers(tmp_path):
    """Qwen2-style checkpoints (biases on q/k/v) run through the same forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-zero biases, so forgetting them would show
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    prompt = [5, 17, 33, 2, 250, 99]
    llm = LLM(str(tmp_path), dtype="float64", device="cpu", kv_cache_tokens=512)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    ref = hf.double().generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == ref


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown model 'no-such-model'"):
        LLM("no-such-model")


@pytest.fixture(scope="module")
def smollm2():
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", kv_cache_tokens=4096, max_model_len=512)
    return llm


def test_smollm2_greedy_matches_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run all 32 steps, like ignore_eos (no stop, no suppression)
    tok = smollm2.get_tokenizer()
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "A KV cache stores"]
    seen = record_logits(smollm2)
    outs = smollm2.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    rows = {}
    for seq_id, row in seen:
        rows.setdefault(seq_id, []).append(row)
    for prompt, out, mine_rows in zip(prompts, outs, rows.values()):
        ids = tok(prompt).input_ids
        assert out.prompt_token_ids == ids
        ref_tokens, ref_scores = hf_greedy(hf, ids, 32)
        assert out.outputs[0].token_ids == ref_tokens, prompt
        assert len(out.outputs[0].token_ids) == 32
        for mine, ref in zip(mine_rows, ref_scores):
            assert (mine - ref).abs().max().item() < SMOLLM2_LOGIT_TOL


def test_smollm2_converted_folder_is_a_plain_checkpoint():
    folder = smollm2_folder()
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 3, 49152)


def test_smollm2_chat_template(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=16))[0]
    assert out.prompt.startswith("<|im_start|>")
    assert out.outputs[0].text.strip()
