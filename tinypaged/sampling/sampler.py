"""Choosing tokens and the token rules for stopping: greedy, temperature, min-p, top-k, top-p, allowed token
ids, bad words, per-sequence seeds, ``min_tokens``, EOS, stop token ids and length (vLLM's semantics). Stop
strings are text: the output processor searches them after the step (``tinypaged.engine.output_processor``).

* Until a sequence has ``min_tokens`` outputs, EOS and its ``stop_token_ids`` get -inf logits, so they
  cannot be chosen (vLLM's min-tokens logits processor), and no token stop check fires.
* Each row is sampled on its own: a row that cannot be sampled (NaN logits, every logit -inf, a
  distribution torch refuses) fails alone, with the reason, and the other rows get their tokens.
"""

from __future__ import annotations

import math

import torch

from tinypaged import cpu_native
from tinypaged.sequence import FinishReason


def sample_generator(seed: int | None, index: int) -> torch.Generator | None:
    """The generator of sample ``index`` of a seeded request: seed + index (vLLM v1's child seeds),
    wrapped into torch's 64-bit seed range so a seed near the top cannot overflow mid-batch."""
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed + index) % 2**64)


def suppress_early_stops(logits: torch.Tensor, seqs, eos_token_ids) -> torch.Tensor:
    """-inf on EOS and stop token ids for every sequence still short of its ``min_tokens``, in a copy: the
    caller's logits (the model's output) stay as they were."""
    copied = False
    for row, seq in enumerate(seqs):
        p = seq.params
        if len(seq.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            if banned:
                if not copied:
                    logits, copied = logits.clone(), True
                logits[row, banned] = float("-inf")
    return logits


def allow_only(logits: torch.Tensor, seqs) -> torch.Tensor:
    """-inf on every token outside a sequence's ``allowed_token_ids`` (vLLM's), in a copy. Ids beyond the
    vocabulary allow nothing: a row left with no token fails alone ("every token's logit is -inf")."""
    copied = False
    vocab = logits.shape[-1]
    for row, seq in enumerate(seqs):
        allowed = getattr(seq.params, "allowed_token_ids", None)
        if allowed is not None:
            if not copied:
                logits, copied = logits.clone(), True
            keep = torch.full((vocab,), float("-inf"))
            ids = [t for t in allowed if 0 <= t < vocab]
            keep[ids] = 0.0
            logits[row] += keep
    return logits


def ban_bad_words(logits: torch.Tensor, seqs) -> torch.Tensor:
    """vLLM's bad words: for each banned sequence of ids whose prefix the output ends with, -inf on its last id,
    in a copy (vLLM's ``apply_bad_words``: the output tokens only; ids beyond the vocabulary ban nothing)."""
    copied = False
    vocab = logits.shape[-1]
    for row, seq in enumerate(seqs):
        words = getattr(seq.params, "bad_words_token_ids", None)
        if not words:
            continue
        past = seq.output_token_ids
        for word in words:
            k = len(word) - 1
            if k > len(past) or not 0 <= word[-1] < vocab or (k and list(past[-k:]) != list(word[:k])):
                continue
            if not copied:
                logits, copied = logits.clone(), True
            logits[row, word[-1]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, seqs, engine_generator: torch.Generator,
           eos_token_ids=()) -> tuple[list[int | None], list[float | None], dict[int, str]]:
    """One token per row of ``logits`` [N, vocab]: ``(token ids, their log-probabilities, failures)``.
    ``failures`` maps the index of each row that could not be sampled to the reason; such a row's
    token and log-probability are None, and the other rows are unaffected."""
    logits = ban_bad_words(allow_only(suppress_early_stops(logits.float().cpu(), seqs, eos_token_ids), seqs), seqs)
    # logsumexp answers both checks and gives the log-probabilities: log p(t) = logit(t) - logsumexp(row); a row
    # holding a NaN has a NaN logsumexp, a row whose every logit is -inf has -inf
    any_greedy = any(seq.params.greedy for seq in seqs)
    native = cpu_native.usable(logits) if logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] else None
    if native is not None:  # the C++ operator (float32 on a CPU): logsumexp and argmax in one read of each row
        lse, argmax = native.row_max_lse(logits)
    else:
        lse = torch.logsumexp(logits, dim=-1)
        # torch.max's indices are argmax's (the first of equal maxima), in a third of argmax's time on a CPU
        argmax = logits.max(dim=-1).indices if any_greedy else None
    greedy = argmax.tolist() if any_greedy else None
    row_lse = lse.tolist()  # the checks in Python: one copy out, not an isnan and an isneginf with a copy each
    tokens, failures = [], {}
    for i, seq in enumerate(seqs):
        if math.isnan(row_lse[i]) or row_lse[i] == -math.inf:
            failures[i] = ("the model's logits hold NaN" if math.isnan(row_lse[i]) else
                           "every token's logit is -inf, so no token can be sampled")
        elif seq.params.greedy:
            tokens.append(greedy[i])
            continue
        else:
            try:
                tokens.append(_sample_row(logits[i], seq.params, seq.generator or engine_generator))
                continue
            except RuntimeError as e:  # e.g. torch.multinomial refusing a distribution
                failures[i] = f"sampling failed: {e}"
        tokens.append(None)
    # the picks equal the argmax (every row greedy and none failed: a greedy batch's usual step): reuse its tensor
    picked = argmax if tokens == greedy else torch.tensor([0 if t is None else t for t in tokens], dtype=torch.long)
    logprobs = (logits.gather(1, picked[:, None])[:, 0] - lse).tolist()
    chosen = [None if t is None else lp for t, lp in zip(tokens, logprobs)]
    return tokens, chosen, failures


def _sample_row(row: torch.Tensor, p, generator: torch.Generator) -> int:
    """One token from one row of logits under ``p`` (temperature, min-p, top-k, top-p); greedy rows never come here:
    ``sample`` takes their argmax for all of them at once."""
    row = row / p.temperature
    if p.min_p > 0.0:  # vLLM's order: temperature, min_p, then top-k and top-p
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass before it already reaches top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= p.top_p
        drop[0] = False  # even where top_p rounds to 0 in float32 (SamplingParams refuses such a top_p)
        row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(row, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def check_stop(seq, eos_token_ids, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """After a token was appended: ``(finish_reason, stop_reason)`` if a token rule ends ``seq``, else None.

    Token rules only, as vLLM's ``check_stop``: EOS (stop_reason None) and ``stop_token_ids`` (stop_reason
    the id) once ``min_tokens`` is reached, then ``max_tokens`` / ``max_model_len`` (LENGTH). The scheduler applies
    it (``Scheduler.update_from_output``); stop strings are text, which the output processor searches after the
    step (``tinypaged.engine.output_processor``). Reads ``seq``, never writes it.
    """
    p = seq.params
    n_out = len(seq.output_token_ids)
    token = seq.output_token_ids[-1]
    if n_out >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            return FinishReason.STOP, None
        if token in p.stop_token_ids:
            return FinishReason.STOP, token
    if (p.max_tokens is not None and n_out >= p.max_tokens) or len(seq) >= max_model_len:
        return FinishReason.LENGTH, None
    return None
