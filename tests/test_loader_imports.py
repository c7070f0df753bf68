"""Loading SmolLM2 reads its config and tokenizer without transformers' model stack (``LlamaConfig``,
``AutoTokenizer`` and meta-device initialisers import ``torch._dynamo`` and ``torch.distributed.tensor``:
3-5 s of CPU in every process that loads a model: each notebook kernel, server, grading probe). What is
read must be what transformers' own classes read: the same configuration values, the same tokenizer."""

import json
import subprocess
import sys

from tinypaged.model import loader


def test_the_plain_config_has_the_values_of_transformers_own_class(tmp_path):
    from transformers import AutoConfig

    folder = loader.smollm2_folder()
    ours, theirs = loader.load_config(folder), AutoConfig.from_pretrained(folder)
    assert type(ours).__name__ == "PreTrainedConfig" and ours.model_type == theirs.model_type == "llama"
    for key in loader.CONFIG_KEYS + ("max_position_embeddings", "eos_token_id", "bos_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    # a config.json that leaves a value to its class's default is read by the class, which knows it
    data = json.loads((folder / "config.json").read_text())
    del data["rms_norm_eps"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    fallback = loader.load_config(tmp_path)
    assert type(fallback).__name__ == "LlamaConfig" and fallback.rms_norm_eps == AutoConfig.from_pretrained(
        tmp_path).rms_norm_eps


def test_the_tokenizer_is_the_one_autotokenizer_picks():
    from transformers import AutoTokenizer

    ours, theirs = loader.load_tokenizer("smollm2-135m"), AutoTokenizer.from_pretrained(loader.smollm2_folder())
    assert type(ours) is type(theirs)
    text = "Once upon a time, <|im_end|> héllo  world\n\tthe KV cache"
    ids = theirs(text).input_ids
    assert ours(text).input_ids == ids and ours.decode(ids) == theirs.decode(ids)
    chat = [{"role": "user", "content": "What is a KV cache?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.all_special_ids == theirs.all_special_ids and ours.eos_token_id == theirs.eos_token_id


def greedy_in_a_fresh_process(llm_args: str, prompt: str, max_tokens: int):
    """``LLM(llm_args)``'s greedy tokens for ``prompt`` in a new process, and which heavy modules it imported."""
    code = ("import sys\n"
            "from tinypaged import LLM, SamplingParams\n"
            f"llm = LLM({llm_args})\n"
            f"out = llm.generate([{prompt}], SamplingParams(temperature=0, max_tokens={max_tokens}))\n"
            "print(out[0].outputs[0].token_ids)\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.tensor', 'transformers.activations',\n"
            "      'transformers.models.llama.configuration_llama') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokens, heavy = proc.stdout.strip().splitlines()[-2:]
    return json.loads(tokens), heavy


def test_a_process_that_serves_smollm2_never_imports_the_model_stack():
    tokens, heavy = greedy_in_a_fresh_process("'smollm2-135m', dtype='float32', device='cpu', max_num_seqs=2, "
                                              "max_model_len=64", "'Once upon a time'", 4)
    assert tokens == [28, 260, 2240, 282]  # the greedy tokens the full load gives
    assert heavy == "[]", heavy


# -- "tiny": transformers' initialisation, saved once -------------------------------------------------------------
def _tiny_the_old_way(seed):
    """What ``LLM("tiny")`` built before the cache: transformers' model, then ``CausalLM`` filled from it."""
    import torch

    from tinypaged.model.llama import CausalLM

    hf = loader.tiny_hf_model(seed)
    ours = CausalLM(hf.config)
    ours.load_state_dict(hf.state_dict(), strict=False)
    return ours.state_dict(), torch.get_rng_state()


def _same(a, b):
    import torch

    (sa, ra), (sb, rb) = a, b
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa) and torch.equal(ra, rb)


def _tiny_now(seed):
    import torch

    return loader._load_tiny(seed).state_dict(), torch.get_rng_state()


def test_tiny_from_the_cache_is_what_transformers_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYPAGED_CACHE", str(tmp_path))
    old = _tiny_the_old_way(0)
    assert loader.tiny_folder(0) is not None  # made now: the cache was empty
    assert type(loader.load_config(loader.tiny_folder(0))).__name__ == "PreTrainedConfig"  # read without LlamaConfig
    assert _same(_tiny_now(0), old)  # the same weights, and torch's generator left in the same place
    assert _same(_tiny_now(0), old)  # (twice: read from the folder, not rebuilt)
    assert not _same(_tiny_now(3), old) and _same(_tiny_now(3), _tiny_the_old_way(3))  # a seed has its own folder
    assert len(list(tmp_path.glob("tiny-seed*-*/model.safetensors"))) == 2


def test_tiny_without_a_usable_cache_is_built_in_memory(tmp_path, monkeypatch):
    old = _tiny_the_old_way(0)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TINYPAGED_CACHE", str(tmp_path / "a-file" / "cache"))  # cannot be made
    assert loader.tiny_folder(0) is None and _same(_tiny_now(0), old)
    monkeypatch.setenv("TINYPAGED_CACHE", str(tmp_path / "cache"))
    folder = loader.tiny_folder(0)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")  # damaged: built in memory instead
    assert _same(_tiny_now(0), old)


def test_a_process_that_runs_tiny_from_the_cache_never_imports_the_model_stack():
    loader.tiny_folder(0)  # the cache the process below reads (prepare makes it)
    tokens, heavy = greedy_in_a_fresh_process("'tiny', dtype='float64', device='cpu'",
                                              "{'prompt_token_ids': [5, 6, 7]}", 6)
    assert heavy == "[]", heavy
    import torch

    hf = loader.tiny_hf_model(seed=0).double()
    ref = hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 3:].tolist()
    assert tokens == ref  # transformers' own greedy tokens
