"""Text: every sequence's output text and its stop strings (vLLM v1's detokenizer, decoding in full).

The ``Detokenizer`` is the only writer of ``Sequence.text`` and ``Sequence.stop_search_from``.

* A stop string is searched only in text produced after ``min_tokens`` was reached, plus a look-back
  of ``len(stop) - 1`` characters so a stop string straddling two tokens is found (vLLM's rule).
* Byte-level tokenizers (SmolLM2's) spend several tokens on one emoji or CJK character; until its last
  byte arrives the decoded text ends in U+FFFD. That tail is not settled: stop strings are searched
  only in settled text (so ``stop="\ufffd"`` never fires on a character still arriving, as vLLM holds
  such a tail back too, yet still finds a real U+FFFD that later tokens left in place), the search
  start never moves past it, and a stream never sends it, so a stop string made of such characters
  is found once they are complete.
* Once a sequence has finished, ``seq.text`` is final: cut before the stop string that fired (after
  it with ``include_stop_str_in_output``, as vLLM), or the text of all its output tokens.
* ``skip_special_tokens`` (default True, as vLLM) drops special tokens from the text; False keeps them
  (``decode`` is then called with ``skip_special_tokens=False``).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder prints for a character whose bytes have not all arrived


def settled_length(text: str) -> int:
    """Characters of ``text`` that later tokens can no longer change (a half-decoded tail can)."""
    return len(text.rstrip(REPLACEMENT))


class Detokenizer:
    """Owns sequence text and stop strings. ``decode(token_ids) -> str`` is the tokenizer's decode
    (it may return "" for a model without a tokenizer, where stop strings then never fire)."""

    def __init__(self, decode):
        self.decode = decode

    def text_of(self, seq) -> str:
        """The decoded text of ``seq``'s output tokens under its ``skip_special_tokens``."""
        if seq.params.skip_special_tokens:
            return self.decode(seq.output_token_ids)
        return self.decode(seq.output_token_ids, skip_special_tokens=False)

    def find_stop_string(self, seq) -> str | None:
        """After a token was appended: the stop string that ends ``seq`` (``seq.text`` is then cut
        before it, or after it with ``include_stop_str_in_output``), or None. Decodes only sequences that have stop strings."""
        p = seq.params
        if not p.stop_strings:
            return None
        text = self.text_of(seq)
        settled = settled_length(text)
        if len(seq.output_token_ids) >= p.min_tokens:  # text of the tokens before min_tokens is never searched
            hits = []
            for s in p.stop_strings:
                at = text.find(s, max(0, seq.stop_search_from - len(s) + 1), settled)
                if at >= 0:
                    hits.append((at, s))
            if hits:
                at, s = min(hits)
                seq.text = text[:at + len(s)] if p.include_stop_str_in_output else text[:at]
                return s
        seq.stop_search_from = settled
        return None

    def finish(self, seq) -> None:
        """``seq`` finished by a token rule (EOS, stop token, length): its text is all of its output."""
        seq.text = self.text_of(seq)

    def stream_text(self, seq) -> tuple[str, int]:
        """``(text so far, characters of it a stream may send)``. A finished sequence's text is all
        settled. A running one holds back a half-decoded tail and, when it has stop strings, the last
        ``len(longest stop) - 1`` settled characters, which a stop string may still claim."""
        if seq.is_finished:
            return seq.text, len(seq.text)
        text = self.text_of(seq)
        settled = settled_length(text)
        stops = seq.params.stop_strings
        if stops:
            settled -= max(map(len, stops)) - 1
        return text, max(settled, 0)
