"""Hostile requests: every bad input is a clear error before any work, and nothing else is lost.

Each test here reproduced a failure of the engine before the input processor / detokenizer split:
a silent miss, a batch lost mid-call, a hang, a misleading InvariantError, a silently wrong run or a
raw error from deep inside. The probes run on the "tiny" model (SmolLM2's tokenizer).
"""

import functools
import math
import threading

import pytest
import torch

import tinypaged.engine.core as llm_engine_module
from tinypaged import LLM, SamplingParams
from tinypaged.engine.detokenizer import REPLACEMENT
from tinypaged.sampling.sampler import sample_generator
from tinypaged.sampling.sampler import check_stop
from tinypaged.sequence import FinishReason, Sequence

pytestmark = pytest.mark.usefixtures("shared_weights")

P = {"prompt_token_ids": [11, 402, 9, 77, 1234, 5, 6]}
SHORT = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def tiny(**kw):
    kw = {"dtype": "float64", "device": "cpu", "block_size": 4, "max_model_len": 96,
          "num_gpu_blocks_override": 128, **kw}
    return LLM("tiny", **kw)


def untouched(llm, steps_before):
    """Nothing was queued and no step ran."""
    engine = llm.llm_engine
    return not engine.has_unfinished_requests() and not engine.requests and \
        engine.get_metrics()["num_steps"] == steps_before


def steps(llm):
    return llm.get_metrics()["num_steps"]


# -- silent miss: stop strings made of multi-byte characters ------------------------------------------
TEXT = "Hi 😀 there 你好吗 ok"  # byte-level BPE: the emoji and each CJK character take two tokens


@pytest.fixture
def forced_tokens(monkeypatch):
    """Replace sampling by the token ids of TEXT, one per step, so the text is known exactly."""
    ids = tiny().get_tokenizer().encode(TEXT)

    def forced(logits, seqs, generator, eos):
        return [ids[len(s.output_token_ids)] for s in seqs], [0.0] * len(seqs), {}

    monkeypatch.setattr(llm_engine_module, "sample", forced)
    return ids


@pytest.mark.parametrize("stop, before", [("😀", "Hi "), ("你好", "Hi 😀 there "), ("好吗", "Hi 😀 there 你")])
def test_multibyte_stop_strings_are_found_and_streamed_right(forced_tokens, stop, before):
    llm = tiny()
    tok = llm.get_tokenizer()
    assert REPLACEMENT in tok.decode(forced_tokens[:2])  # the emoji is half-decoded after its first token
    params = SamplingParams(max_tokens=len(forced_tokens), ignore_eos=True, stop=[stop])
    out = llm.generate(P, params)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (before, "stop", stop)
    pieces = list(llm.generate_stream(P, params))
    assert "".join(p.text for p in pieces) == before
    assert not any(REPLACEMENT in p.text for p in pieces)
    assert pieces[-1].finished and pieces[-1].stop_reason == stop


def test_stream_without_stop_strings_never_sends_half_characters(forced_tokens):
    llm = tiny()
    pieces = list(llm.generate_stream(P, SamplingParams(max_tokens=len(forced_tokens), ignore_eos=True)))
    assert "".join(p.text for p in pieces) == TEXT
    assert not any(REPLACEMENT in p.text for p in pieces)


def test_finish_reason_is_an_enum_inside_and_vllms_string_outside():
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=2, stop_token_ids=[7]))
    seq.output_token_ids = [7]
    assert check_stop(seq, set(), 96) == (FinishReason.STOP, 7)
    seq.output_token_ids = [3, 4]
    assert check_stop(seq, set(), 96) == (FinishReason.LENGTH, None)
    out = tiny().generate(P, SHORT)[0].outputs[0]
    assert type(out.finish_reason) is str and out.finish_reason == "length"


# -- the whole batch lost mid-call ----------------------------------------------------------------------
def test_out_of_vocabulary_stop_id_is_refused_before_any_work():
    llm = tiny()
    vocab = llm.llm_engine.vocab_size
    before = steps(llm)
    for bad in (vocab, vocab + 5):
        with pytest.raises(ValueError, match=rf"Request \d+: stop_token_ids \[{bad}\] are outside the vocabulary"):
            llm.generate([P, P], [SHORT, SamplingParams(stop_token_ids=[bad], min_tokens=2, max_tokens=4)])
        assert untouched(llm, before)
    with pytest.raises(ValueError, match=r"stop_token_ids must hold token ids >= 0"):  # refused by SamplingParams
        SamplingParams(stop_token_ids=[-1], min_tokens=2, max_tokens=4)
    assert len(llm.generate([P, P], SHORT)) == 2  # and the engine keeps working


def test_sample_seeds_near_the_top_of_the_range_do_not_overflow():
    top = sample_generator(2**64 - 1, 1)  # seed + index wraps into torch's 64-bit range
    assert torch.equal(torch.rand(3, generator=top), torch.rand(3, generator=sample_generator(0, 0)))
    assert sample_generator(None, 3) is None
    for mode in ("fork", "fanout"):
        llm = tiny(parallel_sampling=mode)
        out = llm.generate(P, SamplingParams(n=3, seed=2**63 - 1, max_tokens=3))[0]
        assert [len(o.token_ids) for o in out.outputs] == [3, 3, 3]


# -- hang: arrival times that never come ------------------------------------------------------------------
@pytest.mark.parametrize("times, words", [
    ([0.0, math.inf], r"arrival_times\[1\] must be a finite number of seconds >= 0"),
    ([math.nan, 0.0], r"arrival_times\[0\] must be a finite number"),
    ([0.0, -1.0], r"arrival_times\[1\] must be a finite number of seconds >= 0"),
    ([0.0, True], r"arrival_times\[1\]"),
    ([0.0, "1"], r"arrival_times\[1\]"),
    (5, "arrival_times must be a list of seconds"),
    ("01", "arrival_times must be a list of seconds"),
    ([0.0], "Got 1 arrival_times for 2 prompts"),
])
def test_bad_arrival_times_are_refused(times, words):
    llm = tiny()
    before = steps(llm)
    raised = []

    def call():  # in a thread, so a request that would never arrive fails the test instead of hanging it
        try:
            llm.generate([P, P], SHORT, arrival_times=times)
        except (TypeError, ValueError) as e:
            raised.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "generate() is waiting for a request that never arrives"
    assert len(raised) == 1
    with pytest.raises(type(raised[0]), match=words):
        raise raised[0]
    assert untouched(llm, before)


def test_arrival_times_accept_numpy_arrays():
    np = pytest.importorskip("numpy")
    assert len(tiny().generate([P, P], SHORT, arrival_times=np.array([0.0, 0.01]))) == 2


# -- misleading: a second call while one is running ---------------------------------------------------------
BUSY = "this LLM is already generating"


def test_generate_inside_on_step_is_refused_and_the_outer_call_finishes():
    llm = tiny()
    expected = llm.generate(P, SHORT)[0].outputs[0].token_ids
    errors = []

    def on_step(step):
        try:
            llm.generate(P, SHORT)
        except RuntimeError as e:
            errors.append(str(e))

    out = llm.generate(P, SHORT, on_step=on_step)
    assert out[0].outputs[0].token_ids == expected
    assert errors and all(BUSY in e for e in errors)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_second_call_while_a_stream_is_open_is_refused_and_the_stream_keeps_working():
    llm = tiny()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate(P, params)[0].outputs[0]
    stream = llm.generate_stream(P, params)
    pieces = [next(stream)]
    with pytest.raises(RuntimeError, match=BUSY):
        llm.generate(P, SHORT)
    with pytest.raises(RuntimeError, match=BUSY):
        next(llm.generate_stream(P, SHORT))
    pieces += list(stream)
    assert [t for p in pieces for t in p.token_ids] == expected.token_ids
    assert "".join(p.text for p in pieces) == expected.text
    assert len(llm.generate(P, SHORT)) == 1  # the exhausted stream let go of the LLM


def test_a_closed_stream_lets_go_of_the_llm():
    llm = tiny()
    stream = llm.generate_stream(P, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(P, SHORT)) == 1


def test_two_threads_on_one_llm_get_a_clear_error_not_an_invariant_error():
    llm = tiny()
    expected = llm.generate(P, SHORT)[0].outputs[0].token_ids
    running, tried = threading.Event(), threading.Event()
    results, errors = [], []

    def first():
        def on_step(step):
            running.set()
            tried.wait(60)
        results.append(llm.generate(P, SHORT, on_step=on_step))

    t = threading.Thread(target=first)
    t.start()
    assert running.wait(60)
    try:
        llm.generate(P, SHORT)
    except Exception as e:  # noqa: BLE001 - the type is what this test checks
        errors.append(e)
    finally:
        tried.set()
    t.join(60)
    assert len(errors) == 1 and type(errors[0]) is RuntimeError and BUSY in str(errors[0])
    assert results[0][0].outputs[0].token_ids == expected


# -- silently wrong -----------------------------------------------------------------------------------------
def test_none_inside_a_params_list_is_refused_naming_its_index():
    llm = tiny()
    before = steps(llm)
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got NoneType"):
        llm.generate([P, P], [SHORT, None])
    assert untouched(llm, before)


def test_request_ids_are_checked_before_anything_is_queued():
    llm = tiny()
    engine = llm.llm_engine
    a = engine.make_request("dup", P, SHORT)
    b = engine.make_request("dup", P, SHORT)
    with pytest.raises(ValueError, match="'dup' is already in use"):
        engine.enqueue([a, b])
    assert not engine.requests and not engine.has_unfinished_requests()
    # an id the LLM's counter would use next, queued through the engine: generate picks free ids
    taken = str(llm._counter)
    engine.add_request(taken, P, SHORT)
    outs = llm.generate([P, P], SHORT)
    assert len(outs) == 2 and len({o.request_id for o in outs}) == 2 and taken not in {o.request_id for o in outs}
    assert not engine.has_unfinished_requests()


# -- raw errors from deep inside ------------------------------------------------------------------------------
def test_abort_request_names_the_problem_with_non_string_ids():
    llm = tiny()
    engine = llm.llm_engine
    engine.add_request("keep", P, SHORT)
    for bad in (5, ["keep", 5], None):
        with pytest.raises(TypeError, match="request ids are strings"):
            engine.abort_request(bad)
    assert "keep" in engine.requests  # nothing was aborted by the bad call
    engine.abort_request("keep")
    assert not engine.has_unfinished_requests()


def test_on_step_must_be_callable_before_any_work():
    llm = tiny()
    before = steps(llm)
    with pytest.raises(TypeError, match="on_step must be a function"):
        llm.generate(P, SHORT, on_step=5)
    assert untouched(llm, before)


@pytest.mark.parametrize("prompt, error, words", [
    ({"prompt": None}, TypeError, r"Request \d+: 'prompt' must be a string, got NoneType"),
    ({"prompt": 5, "prompt_token_ids": [1, 2]}, TypeError, r"Request \d+: 'prompt' must be a string or None"),
    ("\ud800", ValueError, r"Request \d+: the prompt is not valid Unicode text: '\\ud800' at character 0 is a lone surrogate"),
    ({"prompt": "ok \udfff"}, ValueError, r"Request \d+: 'prompt' is not valid Unicode text.*character 3"),
    (None, TypeError, "prompts must be a string"),
    (b"bytes", TypeError, "prompts must be a string"),
])
def test_bad_prompts_are_refused_naming_the_request(prompt, error, words):
    llm = tiny()
    before = steps(llm)
    with pytest.raises(error, match=words):
        llm.generate(prompt if prompt is None or isinstance(prompt, bytes) else [P, prompt], SHORT)
    assert untouched(llm, before)


def test_no_prompts_give_no_outputs_as_in_vllm():
    llm = tiny()
    assert llm.generate([]) == []
    assert list(llm.generate_stream([])) == []
    assert len(llm.generate(P, SHORT)) == 1
