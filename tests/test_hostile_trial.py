"""The engine-side findings of the hostile-input run (issue #32): one bad request never takes others
down, every bad input is a clear error naming the field or knob before any work, and nothing is
silently wrong. Each test reproduced its finding on the code before the fix (the old behaviour is
in the test's comment). They run on the "tiny" model as the probes did:
``LLM("tiny", device="cpu", max_model_len=256, num_gpu_blocks_override=256)``.
"""

import functools
import math

import pytest
import torch

import tinypaged.engine.core as llm_engine_module
from tinypaged import LLM, SamplingParams
from tinypaged.engine.detokenizer import REPLACEMENT
from tinypaged.entrypoints.engine_loop import EngineLoop
from tinypaged.engine.input_processor import InputProcessor
from tinypaged.interfaces import InvariantError
from tinypaged.sampling_params import BeamSearchParams

pytestmark = pytest.mark.usefixtures("shared_weights", "one_thread")


def P(ids):
    return {"prompt_token_ids": ids}


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def tiny(**kw):
    return LLM("tiny", device="cpu", max_model_len=256, num_gpu_blocks_override=256, **kw)


def steps(llm) -> int:
    return llm.get_metrics()["num_steps"]


def untouched(llm, steps_before) -> bool:
    """Nothing queued, no block held, no step run."""
    engine = llm.llm_engine
    return not engine.has_unfinished_requests() and not engine.requests and engine.kv.usage == 0 and \
        steps(llm) == steps_before


def solo(llm, prompt, params=GREEDY) -> list[int]:
    return llm.generate(prompt, params)[0].outputs[0].token_ids


def whole_vocab(llm, **kw) -> SamplingParams:
    return SamplingParams(stop_token_ids=list(range(llm.llm_engine.vocab_size)), min_tokens=3, max_tokens=5, **kw)


# -- lost work: a request nothing can be sampled for ------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_stop_token_ids_covering_the_vocabulary_with_min_tokens_are_refused_before_work(temperature):
    # before: accepted; torch.multinomial raised mid-step (temperature 0: argmax of all -inf chose a banned id)
    llm = tiny()
    before = steps(llm)
    with pytest.raises(ValueError, match=r"Request \d+: stop_token_ids.*cover the whole vocabulary.*min_tokens=3"):
        llm.generate([P([1, 2, 3]), P([4, 5])], [GREEDY, whole_vocab(llm, temperature=temperature)])
    assert untouched(llm, before)
    vocab = llm.llm_engine.vocab_size
    eos = sorted(llm.llm_engine.eos_token_ids)
    rest = [t for t in range(vocab) if t not in eos]  # with EOS (banned until min_tokens too): the whole vocabulary
    with pytest.raises(ValueError, match="stop_token_ids and EOS cover the whole vocabulary"):
        llm.generate(P([1, 2, 3]), SamplingParams(stop_token_ids=rest, min_tokens=2, max_tokens=4))
    out = llm.generate(P([1, 2, 3]), SamplingParams(stop_token_ids=rest, min_tokens=2, max_tokens=4, ignore_eos=True))
    assert out[0].outputs[0].token_ids[:2] == [eos[0]] * 2  # only EOS is left to sample, and it is sampled


@pytest.mark.parametrize("mode", ["fork", "fanout"])
def test_a_request_whose_sampling_fails_fails_alone(monkeypatch, mode):
    # before: the step raised (torch.multinomial: invalid distribution) and generate lost every request
    llm = tiny(parallel_sampling=mode)
    expected = [solo(llm, P([1, 2, 3])), solo(llm, P([7, 8]))]
    monkeypatch.setattr(InputProcessor, "_check_min_tokens", lambda *args: None)  # as if validation missed it
    outs = llm.generate([P([1, 2, 3]), P([4, 5]), P([7, 8])], [GREEDY, whole_vocab(llm, n=2), GREEDY])
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == expected
    failed = outs[1]
    assert [(c.finish_reason, c.token_ids) for c in failed.outputs] == [("error", []), ("error", [])]
    assert "no token can be sampled" in failed.error and outs[0].error is None
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests and engine.kv.usage == 0
    pieces = list(llm.generate_stream([P([4, 5]), P([1, 2, 3])], [whole_vocab(llm), GREEDY]))
    ends = {p.request_id: p.finish_reason for p in pieces if p.finished}
    assert sorted(ends.values()) == ["error", "length"]  # the failed stream ends too, with its reason
    assert [t for p in pieces if ends[p.request_id] == "length" for t in p.token_ids] == expected[0]


def test_a_failing_request_ends_only_its_own_stream_in_the_server_loop(monkeypatch):
    # before: engine_loop failed every in-flight request when the step raised (4 of 4 innocent streams)
    llm = tiny()
    expected = solo(llm, P([1, 2, 3]))
    monkeypatch.setattr(InputProcessor, "_check_min_tokens", lambda *args: None)
    engine = llm.llm_engine
    loop = EngineLoop(engine, engine.detokenizer.stream_text).start()
    events = {"good": [], "bad": []}
    try:
        done = [loop.submit(rid, prompt, sp, events[rid].append).request_id
                for rid, prompt, sp in (("good", P([1, 2, 3]), GREEDY), ("bad", P([4, 5]), whole_vocab(llm)))]
        assert done == ["good", "bad"]
        assert loop.drain(timeout=60)
    finally:
        loop.stop()
    good, bad = events["good"], events["bad"]
    assert [t for e in good for t in e.token_ids] == expected and good[-1].finish_reason == "length"
    assert all(e.error is None for e in good)
    assert bad[-1].finished and bad[-1].finish_reason == "error" and "no token can be sampled" in bad[-1].error


# -- lost work: abort_request from on_step or between stream pieces ---------------------------------------
def test_abort_from_on_step_returns_the_aborted_request_and_the_rest():
    # before: RuntimeError "requests ['1'] left every queue unfinished (a plug-in dropped them?)", outputs lost
    llm = tiny()
    expected = solo(llm, P([7, 8]))
    victim, calls = str(llm._counter), []  # the id the next generate gives its first prompt

    def abort_at_the_third_step(step):
        calls.append(step)
        if len(calls) == 3:
            llm.llm_engine.abort_request(victim)

    outs = llm.generate([P([1, 2, 3]), P([7, 8])], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                                    GREEDY], on_step=abort_at_the_third_step)
    aborted, other = outs[0].outputs[0], outs[1].outputs[0]
    assert outs[0].request_id == victim
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 3
    assert aborted.text == llm.get_tokenizer().decode(aborted.token_ids, skip_special_tokens=True)
    assert aborted.token_ids == solo(llm, P([1, 2, 3]))[:3]
    assert other.token_ids == expected and other.finish_reason == "length"
    assert llm.llm_engine.kv.usage == 0 and not llm.llm_engine.requests


def test_aborting_the_only_request_from_on_step_ends_the_call():
    llm = tiny()
    rid = str(llm._counter)
    outs = llm.generate(P([1, 2, 3]), SamplingParams(max_tokens=30, ignore_eos=True),
                        on_step=lambda step: llm.llm_engine.abort_request(rid))
    assert outs[0].outputs[0].finish_reason == "abort" and len(outs[0].outputs[0].token_ids) == 1


def test_abort_between_stream_pieces_ends_that_stream_with_abort():
    # before: the stream raised "left every queue unfinished" and the other request's pieces were lost
    llm = tiny()
    expected = solo(llm, P([7, 8]))
    stream = llm.generate_stream([P([1, 2, 3]), P([7, 8])],
                                 [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), GREEDY])
    first = next(stream)
    llm.llm_engine.abort_request(first.request_id)
    pieces = [first] + list(stream)
    mine = [p for p in pieces if p.request_id == first.request_id]
    others = [p for p in pieces if p.request_id != first.request_id]
    assert mine[-1].finished and mine[-1].finish_reason == "abort" and sum(p.finished for p in mine) == 1
    assert [t for p in others for t in p.token_ids] == expected and others[-1].finish_reason == "length"
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.kv.usage == 0


# -- lost work: beam search queued a prompt before refusing the next ---------------------------------------
def test_beam_search_checks_every_prompt_before_queuing_any():
    # before: the ValueError left prompt 1 queued: the next beam_search refused ("idle engine") and the
    # next generate silently computed the leftover
    llm = tiny()
    before = steps(llm)
    with pytest.raises(ValueError, match=r"beam-1: token ids \[1000000\] are outside the vocabulary"):
        llm.beam_search([P([1, 2, 3, 4, 5]), P([10**6])], BeamSearchParams(beam_width=2, max_tokens=3))
    assert untouched(llm, before)
    out = llm.beam_search([P([1, 2, 3, 4, 5])], BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(out[0].sequences) == 2


def test_beam_search_with_sampling_params_names_the_type_it_takes():
    # before: AttributeError: 'SamplingParams' object has no attribute 'beam_width'
    llm = tiny()
    with pytest.raises(TypeError, match="beam_search takes a BeamSearchParams.*got SamplingParams"):
        llm.beam_search(P([1]), SamplingParams())
    params = BeamSearchParams()
    params.beam_width = 0  # changed after construction: checked again
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        llm.beam_search(P([1]), params)


# -- lost work: SamplingParams changed after construction ---------------------------------------------------
@pytest.mark.parametrize("field, value, words", [
    ("temperature", math.nan, "temperature must be a finite number"),
    ("n", 0, "n must be an integer >= 1"),
    ("max_tokens", -1, "max_tokens must be an integer >= 1"),
    ("stop", 5, "stop must be a string or a list"),
    ("top_p", 0.0, "top_p must be a number in"),
])
def test_sampling_params_changed_after_construction_are_checked_at_generate(field, value, words):
    # before: a raw torch error mid-step (nan), a lost batch (n=0), one token (max_tokens=-1)
    llm = tiny()
    before = steps(llm)
    sp = SamplingParams(max_tokens=4)
    setattr(sp, field, value)
    with pytest.raises(ValueError, match=rf"Request \d+: Invalid SamplingParams: {words}"):
        llm.generate([P([1, 2, 3]), P([4, 5])], [GREEDY, sp])
    assert untouched(llm, before)


def test_a_stop_string_set_after_construction_is_used():
    # before: ignored (the normalized stop list was made once, at construction)
    llm = tiny()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = llm.generate(P([1, 2, 3]), params)[0].outputs[0].text
    stop = text.strip()[-2:]
    assert stop.strip() and REPLACEMENT not in stop
    params.stop = stop  # a string, normalized at generate as at construction
    out = llm.generate(P([1, 2, 3]), params)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop) and out.text == text[:text.find(stop)]


def test_a_request_keeps_the_params_it_was_checked_with():
    llm = tiny()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    def meddle(step):
        params.max_tokens = -1  # mid-call: the requests already queued keep their own checked copy

    outs = llm.generate([P([1, 2, 3]), P([4, 5])], params, on_step=meddle)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]


# -- raw errors: chat messages -------------------------------------------------------------------------------
@pytest.mark.parametrize("messages, error, words", [
    ("hi", TypeError, "messages must be a list.*got str"),
    (None, TypeError, "messages must be a list.*got NoneType"),
    ([{"role": "user"}], ValueError, r"messages\[0\] has no 'content'"),
    ([{"content": "hi"}], ValueError, r"messages\[0\] has no 'role'"),
    ([{"role": "user", "content": 5}], TypeError, r"messages\[0\]\['content'\] must be a string, got int"),
    ([{"role": "user", "content": "hi"}, "hello"], TypeError, r"messages\[1\] must be a dict"),
    ([[{"role": "user", "content": "hi"}], [{"role": "user", "content": None}]], TypeError,
     r"messages\[1\]\[0\]\['content'\] must be a string, got NoneType"),
    ([[{"role": "user", "content": "hi"}], "hello"], TypeError, r"messages\[1\] must be a list of messages"),
])
def test_bad_chat_messages_name_the_message_and_field(messages, error, words):
    # before: AttributeError / TypeError / jinja2 UndefinedError from inside the chat template
    llm = tiny()
    before = steps(llm)
    with pytest.raises(error, match=words):
        llm.chat(messages, GREEDY)
    assert untouched(llm, before)


# -- raw errors: cache sizing and the attention backend ------------------------------------------------------
def test_a_kv_cache_smaller_than_one_block_names_the_knob_that_sized_it():
    # before: "raise kv_cache_memory_bytes (or gpu_memory_utilization)", a knob that was not set
    with pytest.raises(ValueError, match=r"kv_cache_tokens=1 gives a KV cache of 1 tokens, less than one block of "
                                         r"block_size=16 tokens.*raise kv_cache_tokens or lower block_size"):
        LLM("tiny", device="cpu", max_model_len=256, kv_cache_tokens=1)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=100 gives a KV cache of 0 tokens.*raise "
                                         r"kv_cache_memory_bytes"):
        LLM("tiny", device="cpu", max_model_len=256, kv_cache_memory_bytes=100)
    one_block = LLM("tiny", device="cpu", max_model_len=256, kv_cache_tokens=16)  # the advice works
    assert one_block.llm_engine.kv.num_blocks == 1


def test_a_kv_cache_larger_than_memory_is_refused_before_allocating(monkeypatch):
    # before: the allocator's own error (or the machine swapping) from torch.zeros
    def refuse(*args, **kwargs):
        raise AssertionError("the KV cache was allocated before its size was checked")

    import tinypaged.worker.model_runner as model_runner
    monkeypatch.setattr(model_runner, "KVCacheTensors", refuse)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=1000000000000000 asks for a KV cache of .* GiB, "
                                         r"but only .* GiB is free .*: lower kv_cache_memory_bytes"):
        LLM("tiny", device="cpu", max_model_len=256, kv_cache_memory_bytes=10**15)
    with pytest.raises(ValueError, match=r"swap_space=1000000(\.0)? GiB asks for .* lower swap_space"):
        LLM("tiny", device="cpu", max_model_len=256, num_gpu_blocks_override=64, preemption_mode="swap",
            swap_space=10**6)


class _TwoArgDecode:
    name, uses_block_tables = "two-arg", False

    def write(self, key_cache, value_cache, key, value, slot_mapping):
        pass

    def decode(self, query, ctx):
        return query


@pytest.mark.parametrize("backend, words", [
    (lambda q: q, r"attention_backend=<function .*> must be .* a paged decode function called as fn\(query, "
                  r"k_cache, v_cache, block_tables, context_lens, scale\)"),
    (5, "attention_backend=5 must be"),
    (_TwoArgDecode(), r"attention_backend _TwoArgDecode.decode cannot be called as decode\(query, key_cache, "
                      r"value_cache, batch, scale\)"),
])
def test_an_attention_backend_with_the_wrong_signature_is_refused_at_construction(monkeypatch, backend, words):
    # before: accepted; the first decode step raised a raw TypeError
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the configuration was checked")

    monkeypatch.setattr(llm_engine_module, "load_model", refuse)
    with pytest.raises(TypeError, match=words):
        LLM("tiny", device="cpu", max_model_len=256, num_gpu_blocks_override=64, attention_backend=backend)


# -- silently wrong ---------------------------------------------------------------------------------------------
def test_an_attention_backend_returning_the_wrong_shape_is_an_error_naming_it():
    # before: a [B, 1, D] result was broadcast over every head and the engine generated garbage
    llm = LLM("tiny", device="cpu", max_model_len=256, num_gpu_blocks_override=64,
              attention_backend=lambda q, k, v, tables, lens, scale: q[:, :1] * 0)
    with pytest.raises(InvariantError, match=r"attention_backend '<lambda>': decode returned \(2, 1, \d+\), but the "
                                             r"output must have the query's shape \(2, \d+, \d+\)"):
        llm.generate([P([1, 2, 3]), P([4, 5])], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.kv.usage == 0


TEXT = "Hi 😀 there ok"  # byte-level BPE: the emoji takes two tokens


@pytest.fixture
def forced(monkeypatch):
    """Sampling replaced by a fixed token list (set ``forced.ids``), one token per step."""
    class Forced:
        ids: list[int] = []

    def sample(logits, seqs, generator, eos):
        return [Forced.ids[len(s.output_token_ids)] for s in seqs], [0.0] * len(seqs), {}

    monkeypatch.setattr(llm_engine_module, "sample", sample)
    return Forced


def test_a_replacement_character_stop_never_fires_on_a_half_decoded_character(forced):
    # before: stop="\ufffd" fired after the emoji's first token: text "Hi ", finish "stop"
    llm = tiny()
    tok = llm.get_tokenizer()
    forced.ids = tok.encode(TEXT)
    half = next(k for k in range(1, len(forced.ids)) if tok.decode(forced.ids[:k]).endswith(REPLACEMENT))
    params = SamplingParams(max_tokens=len(forced.ids), ignore_eos=True, stop=REPLACEMENT)
    out = llm.generate(P([1, 2, 3]), params)[0].outputs[0]
    assert (out.text, out.finish_reason) == (TEXT, "length")
    assert "".join(p.text for p in llm.generate_stream(P([1, 2, 3]), params)) == TEXT
    # a real U+FFFD (the emoji's second token never comes) is settled once the next token arrives: found
    forced.ids = forced.ids[:half] + forced.ids[half + 1:]
    out = llm.generate(P([1, 2, 3]), params)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", REPLACEMENT, TEXT[:TEXT.index("😀")])

