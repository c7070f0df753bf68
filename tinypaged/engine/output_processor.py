"""After the step: text, stop strings and the RequestOutput of a request (vLLM v1's ``OutputProcessor``).

The scheduler applies the token rules alone (``sampler.check_stop``: EOS and stop token ids, then length) while it
appends the step's tokens. Then the ``OutputProcessor`` brings each sample's text up to date (the ``Detokenizer``,
a few tokens decoded per step) and searches its stop strings; a sample a stop string ends is handed back, and the
engine finishes it in the scheduler (vLLM v1: the front end aborts the request in the engine core). The order is
vLLM's and is written once, in ``settle``, which the offline engine and the server's ``CoreClient`` both run: a stop
token beats a stop string in the same token; a stop string beats a length finish, so ``finish_reason`` is STOP with
``stop_reason`` the string. Whatever ends a sample, its text is final once ``settle`` returns, so building an output
never re-decides how it ended.
"""

from __future__ import annotations

from tinypaged.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinypaged.sequence import FinishReason


def settle(detokenizer, sample, token_finish) -> str | None:
    """One sample after its new token, given the token rules' verdict on it (``token_finish``: the finish reason
    they gave it, a ``FinishReason`` or its string, or None while it runs): the stop string that ends it, or None.
    Its text is final when it has finished (by the token rules or by the returned string)."""
    if token_finish is None or token_finish == FinishReason.LENGTH:
        stop = detokenizer.find_stop_string(sample)  # cuts the text at the stop string
        if stop is not None:
            return stop
    if token_finish is not None:
        detokenizer.finish(sample)
    return None


class OutputProcessor:
    """``detokenizer``: the ``Detokenizer`` that makes each sample's text and searches its stop strings; None
    when the front end owns text (the engine core process, ``entrypoints/engine_core.py``: the server's
    ``CoreClient`` detokenizes and searches stop strings, as vLLM v1's ``OutputProcessor`` in the API server).
    Without one, nothing is decoded here: every ``text`` stays empty and only the token rules end a sample."""

    def __init__(self, detokenizer=None):
        self.detokenizer = detokenizer

    def process(self, seqs) -> list[tuple]:
        """After the scheduler appended each sequence's token (and finished those a token rule ends): text and
        stop strings. Returns ``(seq, stop string)`` for each sequence a stop string ends (the engine finishes it
        in the scheduler); the text of every finished one is final. A running sequence without stop strings is
        not decoded here: its text is made when it finishes, or step by step when someone streams it."""
        if self.detokenizer is None:  # the front end owns text and stop strings
            return []
        return [(seq, stop) for seq in seqs if (stop := settle(self.detokenizer, seq, seq.finish_reason)) is not None]

    def finish(self, seq) -> None:
        """``seq`` ends by other means than its tokens (an abort, a failure): its text is made final."""
        if self.detokenizer is not None:
            self.detokenizer.finish(seq)

    @staticmethod
    def request_output(req) -> RequestOutput:
        """The finished request's RequestOutput (samples in index order) with its metrics."""
        seqs = sorted(req.seqs, key=lambda s: s.index)
        outs = [CompletionOutput(s.index, s.text, list(s.output_token_ids), s.cumulative_logprob,
                                 None if s.finish_reason is None else str(s.finish_reason), s.stop_reason)
                for s in seqs]
        s0 = req.seqs[0]
        metrics = RequestMetrics(s0.times.arrival, s0.times.first_scheduled, s0.times.first_token,
                                 max(s.times.finished or 0.0 for s in req.seqs),
                                 sum(len(s.output_token_ids) for s in req.seqs), s0.num_cached_tokens,
                                 sum(s.num_preemptions for s in req.seqs))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True, metrics, req.error)
