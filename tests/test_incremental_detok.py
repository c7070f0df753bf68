"""Incremental detokenization and the one output processor (issue #47 item 3).

* ``IncrementalDetokenizer`` decodes a small window per token, yet its text equals decoding the whole output at
  once, token by token, for SmolLM2's byte-level tokenizer on emoji, CJK, joined emoji, flags, math letters and
  special tokens, and on random byte tokens that make invalid UTF-8; its settled length is all but a U+FFFD tail.
* The ``Detokenizer``'s stop-string rules (straddling tokens, ``min_tokens``, ``include_stop_str_in_output``, a
  half-arrived character) on a byte tokenizer written here, so they need no model.
* In the engine the scheduler applies the token rules only; the output processor finds stop strings after the step
  and the scheduler finishes that sequence: a stop token beats a stop string in the same token, a stop string beats
  a length finish, blocks are freed at once, ``n > 1`` samples stop alone, and the stream's pieces join to the text.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest

import tinypaged.engine.core as llm_engine_module
from tinypaged import LLM, SamplingParams
from tinypaged.engine.detokenizer import REPLACEMENT, Detokenizer, IncrementalDetokenizer, TextStream
from tinypaged.engine.output_processor import settle
from tinypaged.sequence import FinishReason

TEXTS = [
    "Hello, world! 😀🎉 你好，世界。 Ça va? naïve café — “quotes” … \n\ttabs",
    "日本語のテキストと한국어 and a family 👨‍👩‍👧‍👦, flags 🇫🇷🇩🇪, skin tones 👍🏽",
    "<|im_start|>user\nhi<|im_end|> after the special tokens<|endoftext|>",
    "  leading and trailing spaces  ",
    "\ufffd a real replacement character, then 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝛼𝛽 ∑∫≠ and Ελληνικά, עברית, العربية",
]


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
    from tinypaged.model.loader import load_tokenizer

    tok = load_tokenizer("tiny")  # the tiny model borrows SmolLM2's tokenizer
    if tok is None:
        pytest.skip("SmolLM2's tokenizer is not installed here")
    return tok


def counting_decode(tok, windows: list):
    """The engine's decode (special tokens skipped unless told), recording each window's length."""

    def decode(ids, skip_special_tokens=True):
        windows.append(len(ids))
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    return decode


def assert_follows_full_decoding(tok, ids, skip: bool, windows=None):
    """Fed one token at a time, the text is the full decode of the tokens so far, after every token."""
    windows = [] if windows is None else windows
    st = IncrementalDetokenizer(counting_decode(tok, windows), skip)
    for i, token in enumerate(ids):
        st.update([token])
        full = tok.decode(ids[:i + 1], skip_special_tokens=skip)
        assert st.text == full, (ids[:i + 1], st.text, full)
        assert st.settled == len(full.rstrip(REPLACEMENT))
    return st


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decoding_for_smollm2(text, skip):
    tok = smollm2_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    windows = []
    assert_follows_full_decoding(tok, ids, skip, windows)
    assert max(windows) <= 8, windows  # a few tokens per decode, never the whole output
    assert sum(windows) <= 8 * len(ids)  # linear in the output, where decoding it all each time is quadratic


def test_a_long_output_is_decoded_in_small_windows():
    tok = smollm2_tokenizer()
    ids = tok.encode(" ".join(TEXTS) * 8, add_special_tokens=False)
    windows = []
    st = assert_follows_full_decoding(tok, ids, True, windows) if len(ids) < 400 else None
    if st is None:  # the check after every token is quadratic: feed them, compare at the end
        st = IncrementalDetokenizer(counting_decode(tok, windows), True)
        for token in ids:
            st.update([token])
        assert st.text == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 300 and max(windows) <= 8 and sum(windows) <= 8 * len(ids)


def test_random_byte_tokens_and_chunks_equal_full_decoding():
    """Tokens drawn half from those that are parts of characters: invalid UTF-8, half-arrived characters, real
    U+FFFD left in place; the same text token by token and fed in chunks of any size (a catch-up)."""
    tok = smollm2_tokenizer()
    rng = random.Random(47)
    vocab = len(tok)
    partial = [i for i in range(vocab) if REPLACEMENT in tok.decode([i])]
    assert partial
    for _ in range(60):
        ids = [rng.choice(partial) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        for skip in (True, False):
            assert_follows_full_decoding(tok, ids, skip)
            st, k = IncrementalDetokenizer(counting_decode(tok, []), skip), 0
            while k < len(ids):
                n = rng.randrange(1, 6)
                st.update(ids[k:k + n])
                k += n
            assert st.text == tok.decode(ids, skip_special_tokens=skip)


# -- the Detokenizer's rules, on a byte tokenizer (no model needed) ------------------------------------------------
class ByteTokens:
    """Token i < 256 is byte i; 300 is a special token "<s>". Decoding is UTF-8 with U+FFFD for bad bytes."""

    def decode(self, ids, skip_special_tokens=True):
        out = bytearray()
        for i in ids:
            if i == 300:
                if not skip_special_tokens:
                    out += b"<s>"
            else:
                out.append(i)
        return out.decode("utf-8", errors="replace")


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class Sample:
    """What the Detokenizer reads and writes (a Sequence, or the server's SampleText)."""

    def __init__(self, **params):
        self.params = SamplingParams(**params)
        self.output_token_ids = []
        self.text = ""
        self.stop_search_from = 0
        self.is_finished = False


def run(params: dict, ids: list[int], token_finish_at: int | None = None):
    """Feed ``ids`` one by one through ``settle`` (the engine's and the server's order); returns (the sample, the
    stop string or None, how many tokens it took, the stream's pieces)."""
    detok = Detokenizer(ByteTokens().decode)
    stream = TextStream(detok.stream_text)
    s, pieces = Sample(**params), []
    for k, token in enumerate(ids, 1):
        s.output_token_ids.append(token)
        verdict = FinishReason.LENGTH if k == token_finish_at else None
        stop = settle(detok, s, verdict)
        s.is_finished = stop is not None or verdict is not None
        pieces.append(stream.piece(s))
        assert REPLACEMENT not in pieces[-1] or s.is_finished
        if s.is_finished:
            return s, stop, k, pieces
    return s, None, len(ids), pieces


def test_stop_string_straddling_tokens_is_cut_and_streamed_right():
    s, stop, k, pieces = run({"stop": ["cd"]}, byte_ids("abcdef"))
    assert (stop, s.text, k, "".join(pieces)) == ("cd", "ab", 4, "ab")
    s, stop, k, pieces = run({"stop": ["cd"], "include_stop_str_in_output": True}, byte_ids("abcdef"))
    assert (stop, s.text, k, "".join(pieces)) == ("cd", "abcd", 4, "abcd")


def test_the_earliest_stop_string_wins_and_text_before_min_tokens_is_never_searched():
    s, stop, _, _ = run({"stop": ["de", "bcd"]}, byte_ids("abcdef"))
    assert (stop, s.text) == ("bcd", "a")
    s, stop, k, _ = run({"stop": ["ab"], "min_tokens": 3}, byte_ids("ab ab ab"))
    assert (stop, s.text, k) == ("ab", "ab ", 5)  # the first "ab" came before min_tokens
    s, stop, k, _ = run({"stop": ["bc"], "min_tokens": 3}, byte_ids("abcd"))
    assert (stop, s.text, k) == ("bc", "a", 3)  # straddles the min_tokens boundary: found (vLLM's look-back)


def test_half_arrived_characters_are_neither_searched_nor_streamed():
    text = "Hi 😀 there 你好"
    s, stop, k, pieces = run({"stop": [REPLACEMENT]}, byte_ids(text))
    assert stop is None and "".join(pieces) == text  # no U+FFFD while the emoji's bytes arrive
    s, stop, k, pieces = run({"stop": ["你好"]}, byte_ids(text))
    assert (stop, s.text, "".join(pieces)) == ("你好", "Hi 😀 there ", "Hi 😀 there ")
    bad = byte_ids("x") + [0xFF] + byte_ids("y")  # a real U+FFFD, left in place by the next byte
    s, stop, k, _ = run({"stop": [REPLACEMENT]}, bad)
    assert (stop, s.text, k) == (REPLACEMENT, "x", 3)


def test_a_stop_string_beats_length_and_a_finished_text_is_all_of_it():
    s, stop, k, pieces = run({"stop": ["cd"]}, byte_ids("abcdef"), token_finish_at=4)
    assert (stop, s.text, k) == ("cd", "ab", 4)
    s, stop, k, pieces = run({"stop": ["zz"]}, byte_ids("ab😀"), token_finish_at=4)  # length in mid-emoji
    assert stop is None and s.text == "ab" + REPLACEMENT and "".join(pieces) == s.text


def test_skip_special_tokens():
    ids = [300] + byte_ids("hi") + [300]
    s, _, _, pieces = run({}, ids, token_finish_at=len(ids))
    assert s.text == "hi" == "".join(pieces)
    s, _, _, pieces = run({"skip_special_tokens": False}, ids, token_finish_at=len(ids))
    assert s.text == "<s>hi<s>" == "".join(pieces)


def test_the_scheduler_knows_no_text():
    sched = Path(llm_engine_module.__file__).resolve().parent.parent / "sched"
    for path in sched.glob("*.py"):
        source = path.read_text()
        for word in ("stop_strings", "detokeniz", "Detokenizer", ".text"):
            assert word not in source, (path.name, word)


# -- in the engine ---------------------------------------------------------------------------------------------------
P = {"prompt_token_ids": [11, 402, 9, 77, 1234, 5, 6]}
TEXT = "Hi 😀 there 你好吗 ok"
OTHER = " la la la la la la la la la la la la"


@functools.lru_cache(maxsize=None)
def tiny():
    smollm2_tokenizer()
    return LLM("tiny", dtype="float64", device="cpu", block_size=4, max_model_len=96, num_gpu_blocks_override=128)


@pytest.fixture
def forced(monkeypatch):
    """Sampling replaced: sample 0 gets TEXT's tokens, one per step, sample 1 OTHER's."""
    tok = smollm2_tokenizer()
    ids = {0: tok.encode(TEXT, add_special_tokens=False), 1: tok.encode(OTHER, add_special_tokens=False)}

    def sample(logits, seqs, generator, eos):
        return [ids[s.index][len(s.output_token_ids)] for s in seqs], [0.0] * len(seqs), {}

    monkeypatch.setattr(llm_engine_module, "sample", sample)
    return ids


def first_k_containing(tok, ids, s: str) -> int:
    return next(k for k in range(1, len(ids) + 1) if s in tok.decode(ids[:k]))


@pytest.mark.usefixtures("shared_weights")
def test_in_the_engine_a_stop_string_beats_length_and_frees_the_blocks(forced):
    llm, tok = tiny(), smollm2_tokenizer()
    k = first_k_containing(tok, forced[0], " there")
    params = SamplingParams(max_tokens=k, ignore_eos=True, stop=[" there"])
    out = llm.generate(P, params)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason, len(out.token_ids)) == ("Hi 😀", "stop", " there", k)
    assert llm.llm_engine.kv.usage == 0 and not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(P, SamplingParams(max_tokens=k + 3, ignore_eos=True, stop=[" there"]))[0].outputs[0]
    assert (out.text, out.finish_reason, len(out.token_ids)) == ("Hi 😀", "stop", k)  # stopped, not run on


@pytest.mark.usefixtures("shared_weights")
def test_in_the_engine_a_stop_token_beats_a_stop_string(forced):
    llm, tok = tiny(), smollm2_tokenizer()
    ids = forced[0]
    k = first_k_containing(tok, ids, " there")
    assert ids[k - 1] not in ids[:k - 1]
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[" there"], stop_token_ids=[ids[k - 1]])
    out = llm.generate(P, params)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", ids[k - 1], tok.decode(ids[:k]))


@pytest.mark.usefixtures("shared_weights")
def test_n_samples_stop_alone_and_their_streams_join_to_their_text(forced):
    llm, tok = tiny(), smollm2_tokenizer()
    params = SamplingParams(n=2, max_tokens=10, ignore_eos=True, stop=["你好"], seed=1)
    (out,) = llm.generate(P, params)
    got = [(c.index, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
    assert got == [(0, "Hi 😀 there ", "stop", "你好"), (1, tok.decode(forced[1][:10]), "length", None)]
    pieces = list(llm.generate_stream(P, params))
    for c in out.outputs:
        mine = [p for p in pieces if p.index == c.index]
        assert "".join(p.text for p in mine) == c.text and mine[-1].finished
        assert not any(REPLACEMENT in p.text for p in mine)
    assert llm.llm_engine.kv.usage == 0


@pytest.mark.usefixtures("shared_weights")
def test_the_engine_decodes_windows_not_the_whole_output(forced):
    """A streamed sample with stop strings is decoded a few tokens at a time; one without is decoded once, when it
    finishes."""
    llm = tiny()
    detok = llm.llm_engine.detokenizer
    windows, decode = [], detok.decode
    detok.decode = counting_decode(smollm2_tokenizer(), windows)
    try:
        n = len(forced[0])
        list(llm.generate_stream(P, SamplingParams(max_tokens=n, ignore_eos=True, stop=["zz"])))
        assert len(windows) >= n and max(windows) <= 4
        windows.clear()
        llm.generate(P, SamplingParams(max_tokens=n, ignore_eos=True))
        assert windows == [n]
    finally:
        detok.decode = decode
