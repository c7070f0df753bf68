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


def test_a_process_that_serves_smollm2_never_imports_the_model_stack():
    code = ("import sys\n"
            "from tinypaged import LLM, SamplingParams\n"
            "llm = LLM('smollm2-135m', dtype='float32', device='cpu', max_num_seqs=2, max_model_len=64)\n"
            "out = llm.generate(['Once upon a time'], SamplingParams(temperature=0, max_tokens=4))\n"
            "print(out[0].outputs[0].token_ids)\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.tensor', 'transformers.activations',\n"
            "      'transformers.models.llama.configuration_llama') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokens, heavy = proc.stdout.strip().splitlines()[-2:]
    assert json.loads(tokens) == [28, 260, 2240, 282]  # the greedy tokens the full load gives
    assert heavy == "[]", heavy
