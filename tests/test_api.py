"""The user-facing API: SamplingParams, stops, seeds, output order, prompt forms, errors, chat, streaming."""

import functools

import pytest

from tinypaged import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("shared_weights")


@functools.lru_cache(maxsize=None)
def tiny(**kw):
    kw = {"dtype": "float64", "device": "cpu", "block_size": 4, "max_model_len": 96,
          "num_gpu_blocks_override": 128, **kw}
    return LLM("tiny", **kw)


PROMPT = {"prompt_token_ids": [11, 402, 9, 77, 1234, 5, 6]}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def greedy_output():
    return tiny().generate(PROMPT, GREEDY)[0].outputs[0]


@pytest.mark.parametrize("kw, words", [
    (dict(n=0), "n must be"),
    (dict(temperature=-0.5), "temperature must be"),
    (dict(top_p=0.0), "top_p must be"),
    (dict(top_p=1.5), "top_p must be"),
    (dict(top_k=-2), "top_k must be"),
    (dict(max_tokens=0), "max_tokens must be"),
    (dict(max_tokens=2.5), "max_tokens must be"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens must be"),
    (dict(stop=[""]), "stop must"),
])
def test_sampling_params_validation(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_max_tokens_and_length_finish():
    out = greedy_output()
    assert len(out.token_ids) == 16 and out.finish_reason == "length" and out.stop_reason is None


def test_stop_string_cuts_the_text():
    full = greedy_output()
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3
    out = tiny().generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == text[: text.find(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 16


def test_stop_token_ids():
    full = greedy_output()
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = tiny().generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_stops_unless_ignored():
    full = greedy_output()
    llm = LLM("tiny", dtype="float64", device="cpu", max_model_len=96, num_gpu_blocks_override=128)
    llm.llm_engine.eos_token_ids = {full.token_ids[3]}  # pretend the 4th token is end-of-sequence
    first = full.token_ids.index(full.token_ids[3])
    stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert stopped.token_ids == full.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = llm.generate(PROMPT, GREEDY)[0].outputs[0]
    assert ignored.token_ids == full.token_ids and ignored.finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_the_batch():
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = tiny().generate(PROMPT, sp)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [i + 20] * (i + 3)} for i in range(5)]
    noisy = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # draws from the engine's generator
    mixed = tiny(max_num_seqs=3, max_num_batched_tokens=8).generate(
        others[:2] + [PROMPT] + others[2:], [noisy, noisy, sp, noisy, noisy, noisy])
    assert mixed[2].outputs[0].token_ids == alone
    again = tiny().generate(PROMPT, sp)[0].outputs[0].token_ids
    assert again == alone
    other_seed = tiny().generate(PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_results_come_back_in_input_order():
    prompts = [{"prompt_token_ids": [30 + i] * (2 + i)} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in [9, 1, 6, 2, 4]]
    finish_order = []
    outs = tiny().generate(prompts, params, on_step=lambda st: finish_order.extend(o.request_id for o in st.finished))
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 1, 6, 2, 4]
    assert finish_order != [o.request_id for o in outs]  # they finished in another order


def test_prompt_forms_str_and_dict():
    llm = tiny()
    tok = llm.get_tokenizer()
    text = "The quick brown fox"
    ids = tok.encode(text)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a, b, c = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}], sp)
    assert a.prompt == text and a.prompt_token_ids == ids and b.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    single = llm.generate(text, sp)
    assert isinstance(single, list) and single[0].outputs[0].token_ids == a.outputs[0].token_ids
    with pytest.raises(ValueError, match="a prompt is a string or a dict"):
        llm.generate([{"text": text}])


def test_unknown_model_name():
    with pytest.raises(ValueError, match="Unknown model 'gpt-17'"):
        LLM("gpt-17")


def test_prompt_longer_than_max_model_len():
    with pytest.raises(ValueError, match=r"Request \d+: the prompt \(97 tokens\) is longer than max_model_len \(96\)"):
        tiny().generate({"prompt_token_ids": [5] * 97})


def test_mismatched_params_list():
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        tiny().generate([PROMPT] * 3, [GREEDY] * 2)


def test_chat_applies_the_template():
    llm = tiny()
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello!"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.chat(messages, sp)
    assert len(out) == 1 and out[0].prompt == expected
    assert out[0].prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    two = llm.chat([messages, [{"role": "user", "content": "Bye"}]], sp)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out[0].outputs[0].token_ids


def test_request_metrics():
    out = tiny().generate(PROMPT, GREEDY)[0]
    m = out.metrics
    assert m.num_output_tokens == 16 and m.num_preemptions == 0
    assert 0 <= m.time_to_first_token <= m.e2e_latency and m.time_per_output_token >= 0


def test_streaming_deltas_add_up_to_the_final_outputs():
    full = greedy_output()
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    prompts = [PROMPT, {"prompt_token_ids": [40, 41, 42]}]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]), GREEDY]
    llm = tiny()
    final = llm.generate(prompts, params)
    texts, tokens, done = {}, {}, {}
    pieces = list(llm.generate_stream(prompts, params))
    for p in pieces:
        key = int(p.request_id) - int(pieces[0].request_id)
        assert key not in done, "a piece came after the sequence finished"
        texts[key] = texts.get(key, "") + p.text
        tokens.setdefault(key, []).extend(p.token_ids)
        if p.finished:
            done[key] = p.finish_reason
    for i, out in enumerate(final):
        assert texts[i] == out.outputs[0].text
        assert tokens[i] == out.outputs[0].token_ids
        assert done[i] == out.outputs[0].finish_reason
    assert len([p for p in pieces if p.text]) > 2  # text really arrived step by step


def test_arrival_times_delay_admission():
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = tiny().generate([PROMPT, PROMPT], sp, arrival_times=[0.0, 0.3])
    first, late = (o.metrics for o in outs)
    # arrival times are offsets from the call, on the engine's clock
    assert late.arrival_time - first.arrival_time == pytest.approx(0.3)
    assert late.first_scheduled_time >= late.arrival_time
    assert first.first_scheduled_time < late.arrival_time
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="1 arrival_times for 2 prompts"):
        tiny().generate([PROMPT, PROMPT], sp, arrival_times=[0.0])
