"""SamplingParams' text options (vLLM's): ``include_stop_str_in_output`` keeps the matched stop string at the end
of the text; ``skip_special_tokens`` (default True) drops special tokens from the text, False keeps them."""

import functools

import pytest

from tinypaged import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("shared_weights")

PROMPT = {"prompt_token_ids": [11, 402, 9, 77, 1234, 5, 6]}


@functools.lru_cache(maxsize=None)
def tiny():
    return LLM("tiny", dtype="float64", device="cpu", block_size=4, max_model_len=96, num_gpu_blocks_override=128)


def greedy(**kw):
    kw = {"temperature": 0, "max_tokens": 16, "ignore_eos": True, **kw}
    return tiny().generate(PROMPT, SamplingParams(**kw))[0].outputs[0]


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "skip_special_tokens"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_text_options_must_be_bools(field, value):
    with pytest.raises(ValueError, match=f"{field} must be True or False"):
        SamplingParams(**{field: value})


def test_defaults_are_vllms():
    sp = SamplingParams()
    assert sp.include_stop_str_in_output is False and sp.skip_special_tokens is True


def test_include_stop_str_in_output_keeps_the_stop_string():
    text = greedy().text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3
    cut = greedy(stop=[stop])
    kept = greedy(stop=[stop], include_stop_str_in_output=True)
    assert cut.text == text[: text.find(stop)]
    assert kept.text == text[: text.find(stop) + len(stop)] and kept.text.endswith(stop)
    assert kept.finish_reason == cut.finish_reason == "stop" and kept.stop_reason == stop
    assert kept.token_ids == cut.token_ids


def test_skip_special_tokens_false_keeps_them():
    tok = tiny().get_tokenizer()
    special = sorted(set(tok.all_special_ids))
    if not special:
        pytest.skip("the tiny tokenizer has no special tokens")
    # the output is forced to be a special token: allowed_token_ids restricts every step
    ids = [special[0]]
    out_skip = greedy(max_tokens=6, allowed_token_ids=ids)
    out_keep = greedy(max_tokens=6, allowed_token_ids=ids, skip_special_tokens=False)
    assert out_skip.token_ids == out_keep.token_ids
    assert out_skip.text == tok.decode(out_skip.token_ids, skip_special_tokens=True)
    assert out_keep.text == tok.decode(out_keep.token_ids, skip_special_tokens=False)
    assert special[0] in out_keep.token_ids  # the forced output really holds a special token
    assert tok.decode([special[0]], skip_special_tokens=False) in out_keep.text
    assert out_keep.text != out_skip.text


def test_stream_adds_up_with_both_options():
    text = greedy().text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    llm = tiny()
    deltas = "".join(piece.text for piece in llm.generate_stream(PROMPT, params))
    assert deltas == greedy(stop=[stop], include_stop_str_in_output=True).text
