"""Turning next-token logits into tokens: greedy, temperature, top-k, top-p, per-sequence seeds."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, seqs, engine_generator: torch.Generator) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [N, vocab]; returns token ids and their log-probabilities."""
    logits = logits.float().cpu()
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
