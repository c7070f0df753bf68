"""Choosing tokens and deciding when to stop: greedy, temperature, top-k, top-p, per-sequence seeds,
``min_tokens``, stop tokens and stop strings (vLLM's semantics, in one place).

* Until a sequence has ``min_tokens`` outputs, EOS and its ``stop_token_ids`` get -inf logits, so they
  cannot be chosen (vLLM's min-tokens logits processor), and no stop check runs.
* A stop string is searched only in text produced after ``min_tokens`` was reached (plus a look-back of
  ``len(stop) - 1`` characters, so a stop string that straddles the boundary is found), as vLLM does.
"""

from __future__ import annotations

import torch


def suppress_early_stops(logits: torch.Tensor, seqs, eos_token_ids) -> torch.Tensor:
    """-inf on EOS and stop token ids for every sequence still short of its ``min_tokens``."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if len(seq.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            if banned:
                logits[row, banned] = float("-inf")
    return logits


def sample(logits: torch.Tensor, seqs, engine_generator: torch.Generator,
           eos_token_ids=()) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [N, vocab]; returns token ids and their log-probabilities."""
    logits = suppress_early_stops(logits.float().cpu(), seqs, eos_token_ids)
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = []
    for row, seq in zip(logits, seqs):
        p = seq.params
        if p.greedy:
            tokens.append(int(row.argmax()))
            continue
        row = row / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # drop a token once the mass before it already reaches top_p (the first always stays)
            drop = probs.cumsum(-1) - probs >= p.top_p
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = torch.softmax(row, dim=-1)
        gen = seq.generator or engine_generator
        tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
    chosen = [float(logprobs[i, t]) for i, t in enumerate(tokens)]
    return tokens, chosen


def check_stop(seq, eos_token_ids, max_model_len: int, detokenize) -> tuple[str, int | str | None] | None:
    """After a token was appended: ``(finish_reason, stop_reason)`` if ``seq`` is done, else None.

    Cuts ``seq.text`` at a stop string. ``seq.stop_search_from`` remembers how much text was
    already searched (or skipped while under ``min_tokens``).
    """
    p = seq.params
    n_out = len(seq.output_token_ids)
    token = seq.output_token_ids[-1]
    if n_out >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            return "stop", None
        if token in p.stop_token_ids:
            return "stop", token
    if p.stop_strings:
        text = detokenize(seq.output_token_ids)
        if n_out >= p.min_tokens:  # text of the tokens before min_tokens is never searched
            hits = []
            for s in p.stop_strings:
                at = text.find(s, max(0, seq.stop_search_from - len(s) + 1))
                if at >= 0:
                    hits.append((at, s))
            if hits:
                at, s = min(hits)
                seq.text = text[:at]
                return "stop", s
        seq.stop_search_from = len(text)
    if (p.max_tokens is not None and n_out >= p.max_tokens) or len(seq) >= max_model_len:
        return "length", None
    return None
