"""From sampled tokens to finished outputs: the stop decision and the RequestOutput of a request.

The ``OutputProcessor`` combines the two stop authorities in vLLM's order: the token rules
(``sampler.check_stop``: EOS and stop token ids, then length) and the Detokenizer's stop strings.
A stop token beats a stop string in the same token; a stop string beats a length finish, so
``finish_reason`` is STOP with ``stop_reason`` the string. Whatever ends a sequence, its text is
final when ``stop_check`` returns, so building an output never re-decides how it ended.
"""

from __future__ import annotations

from tinypaged.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinypaged.sampling.sampler import check_stop
from tinypaged.sequence import FinishReason


class OutputProcessor:
    def __init__(self, detokenizer, eos_token_ids, max_model_len: int):
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids  # the model's, joined by the tokenizer's when it loads
        self.max_model_len = max_model_len

    def stop_check(self, seq) -> tuple[FinishReason, int | str | None] | None:
        """``(finish_reason, stop_reason)`` if ``seq`` is done after its latest token, else None (the
        scheduler's ``update_from_output`` calls this and finishes the sequence)."""
        verdict = check_stop(seq, self.eos_token_ids, self.max_model_len)
        if verdict is None or verdict[0] is FinishReason.LENGTH:
            stop = self.detokenizer.find_stop_string(seq)
            if stop is not None:
                return FinishReason.STOP, stop
        if verdict is not None:
            self.detokenizer.finish(seq)
        return verdict

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
