"""Text: every sample's output text, decoded a few tokens at a time, and its stop strings (vLLM v1's
``IncrementalDetokenizer`` and its stop-string check).

``IncrementalDetokenizer`` keeps one sample's text. It never decodes the whole output again: each new token is
decoded in a small window of the tokens just before it (``prefix_offset`` .. ``read_offset`` .. end, the offsets of
Hugging Face's and vLLM's ``detokenize_incrementally``), and only what the window adds to its context is appended.
Its text equals decoding all the output tokens at once (``tests/test_incremental_detok.py``).

The ``Detokenizer`` keeps one such state per sample (a ``Sequence``, or the server's ``SampleText``: anything with
``params``, ``output_token_ids``, ``text``, ``stop_search_from`` and ``is_finished``); it is the only writer of their
``text`` and ``stop_search_from``. The rules:

* A stop string is searched only in text produced after ``min_tokens`` was reached, plus a look-back
  of ``len(stop) - 1`` characters so a stop string straddling two tokens is found (vLLM's rule).
* Byte-level tokenizers (SmolLM2's) spend several tokens on one emoji or CJK character; until its last
  byte arrives the decoded text ends in U+FFFD. That tail is not settled: stop strings are searched
  only in settled text (so ``stop="\ufffd"`` never fires on a character still arriving, as vLLM holds
  such a tail back too, yet still finds a real U+FFFD that later tokens left in place), the search
  start never moves past it, and a stream never sends it, so a stop string made of such characters
  is found once they are complete.
* Once a sample has finished, its ``text`` is final: cut before the stop string that fired (after
  it with ``include_stop_str_in_output``, as vLLM), or the text of all its output tokens.
* ``skip_special_tokens`` (default True, as vLLM) drops special tokens from the text; False keeps them
  (``decode`` is then called with ``skip_special_tokens=False``).

``TextStream`` is the one place a stream's pieces are cut (``LLM.generate_stream``, the server's ``EngineLoop``
and ``CoreClient``): each piece is the text that became sendable since the sample's previous piece.
"""

from __future__ import annotations

import weakref

REPLACEMENT = "\ufffd"  # what a decoder prints for a character whose bytes have not all arrived


def settled_length(text: str) -> int:
    """Characters of ``text`` that later tokens can no longer change (a half-decoded tail can)."""
    return len(text.rstrip(REPLACEMENT))


class IncrementalDetokenizer:
    """One sample's text, decoded incrementally.

    The text of ``token_ids[:read_offset]`` is ``committed``: it ended on a whole character, so no later token
    changes it. ``update`` decodes the window ``token_ids[prefix_offset:]``, the tokens committed last time (the
    context a tokenizer may need: a SentencePiece word's leading space) and the rest; what the window adds to its
    context's own text, ``decode(token_ids[prefix_offset:read_offset])``, is new text. New text ending in U+FFFD (a
    character whose bytes are still arriving) is a ``tail`` that stays uncommitted, and the window grows until the
    character is whole. A window is a couple of tokens, so a step costs two small decodes, whatever the length.
    """

    def __init__(self, decode, skip_special_tokens: bool = True):
        self.decode = decode  # decode(token_ids[, skip_special_tokens=False]) -> str
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.committed = ""  # the text of token_ids[:read_offset]
        self.tail = ""  # what token_ids[read_offset:] add after it (ends in U+FFFD, or is empty)
        self._context: str | None = ""  # decode(token_ids[prefix_offset:read_offset]); None: not decoded yet

    def _decode(self, token_ids) -> str:
        if not token_ids:
            return ""
        if self.skip_special_tokens:
            return self.decode(token_ids)
        return self.decode(token_ids, skip_special_tokens=False)

    @property
    def text(self) -> str:
        """The text of all the tokens so far (as decoding them at once gives)."""
        return self.committed + self.tail

    @property
    def settled(self) -> int:
        """Characters of ``text`` that later tokens can no longer change: all but a half-decoded tail."""
        return len(self.committed) + settled_length(self.tail)

    def update(self, new_token_ids) -> None:
        """Append ``new_token_ids`` (any number: a step's token, or a whole output at once) and decode them."""
        if not new_token_ids:
            return
        self.token_ids.extend(new_token_ids)
        if self._context is None:
            self._context = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.token_ids[self.prefix_offset:])
        new = window[len(self._context):]
        if new and not new.endswith(REPLACEMENT):
            self.committed += new
            self.tail = ""
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self._context = None  # decoded when the next token comes (a finished sample never needs it)
        else:
            self.tail = new


class Detokenizer:
    """Owns sample text and stop strings. ``decode(token_ids) -> str`` is the tokenizer's decode
    (it may return "" for a model without a tokenizer, where stop strings then never fire)."""

    def __init__(self, decode):
        self.decode = decode
        self._states = weakref.WeakKeyDictionary()  # sample -> its IncrementalDetokenizer (gone with the sample)

    def state(self, sample) -> IncrementalDetokenizer:
        """``sample``'s incremental text, brought up to its latest token (made on first use: a sample whose text
        nobody needs while it runs is decoded once, when it finishes)."""
        st = self._states.get(sample)
        if st is None:
            st = self._states[sample] = IncrementalDetokenizer(self.decode, sample.params.skip_special_tokens)
        ids = sample.output_token_ids
        if len(ids) > len(st.token_ids):
            st.update(ids[len(st.token_ids):])
        return st

    def text_of(self, sample) -> str:
        """The decoded text of ``sample``'s output tokens under its ``skip_special_tokens``."""
        return self.state(sample).text

    def find_stop_string(self, sample) -> str | None:
        """After a token was appended: the stop string that ends ``sample`` (its ``text`` is then cut before
        it, or after it with ``include_stop_str_in_output``), or None. Decodes only samples that have stop strings."""
        p = sample.params
        if not p.stop_strings:
            return None
        st = self.state(sample)
        text, settled = st.text, st.settled
        if len(sample.output_token_ids) >= p.min_tokens:  # text of the tokens before min_tokens is never searched
            hits = []
            for s in p.stop_strings:
                at = text.find(s, max(0, sample.stop_search_from - len(s) + 1), settled)
                if at >= 0:
                    hits.append((at, s))
            if hits:
                at, s = min(hits)
                sample.text = text[:at + len(s)] if p.include_stop_str_in_output else text[:at]
                return s
        sample.stop_search_from = settled
        return None

    def finish(self, sample) -> None:
        """``sample`` finished by a token rule (EOS, stop token, length) or was ended (abort, error): its text is
        all of its output."""
        sample.text = self.text_of(sample)

    def stream_text(self, sample) -> tuple[str, int]:
        """``(text so far, characters of it a stream may send)``. A finished sample's text is all
        settled. A running one holds back a half-decoded tail and, when it has stop strings, the last
        ``len(longest stop) - 1`` settled characters, which a stop string may still claim."""
        if sample.is_finished:
            return sample.text, len(sample.text)
        st = self.state(sample)
        settled = st.settled
        stops = sample.params.stop_strings
        if stops:
            settled -= max(map(len, stops)) - 1
        return st.text, max(settled, 0)


class TextStream:
    """The pieces of a stream, per sample: each ``piece`` is the text that became sendable since the sample's
    previous piece (``text_of(sample) -> (text, sendable)``, ``Detokenizer.stream_text``), all the rest once it has
    finished, so a sample's pieces join to its final text. The one place deltas are cut: ``LLM.generate_stream``,
    the server's ``EngineLoop`` and ``CoreClient`` each keep one."""

    def __init__(self, text_of):
        self.text_of = text_of
        self._sent = weakref.WeakKeyDictionary()  # sample -> characters already sent (gone with the sample)

    def piece(self, sample) -> str:
        text, sendable = self.text_of(sample)
        start = self._sent.get(sample, 0)
        end = max(start, sendable)
        self._sent[sample] = end
        return text[start:end]
