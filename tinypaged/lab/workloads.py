"""Synthetic request traces with the length statistics the vLLM paper reports (seeded, right-skewed).

The paper's datasets (Section 6.1): ShareGPT averages 161.31 input / 337.99 output tokens,
Alpaca 19.31 / 58.45; both are right-skewed, and sequences are capped at 2048 tokens. We draw
log-normal lengths whose means match those figures (rejecting draws beyond the cap), and Poisson
arrivals. No data set is downloaded: a trace is a list of lengths, not text.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MAX_SEQ_LEN = 2048


@dataclass(frozen=True)
class TraceRequest:
    request_id: int
    prompt_len: int
    output_len: int
    arrival_time: float = 0.0

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class TraceShape:
    """Log-normal parameters. ``draw_mean_*`` are the means before the length cap rejects long
    pairs; they are calibrated (over 20 seeds of 1000 requests) so the *kept* means match the paper."""

    name: str
    draw_mean_input: float
    draw_mean_output: float
    sigma_input: float
    sigma_output: float
    paper_mean_input: float
    paper_mean_output: float


SHAREGPT = TraceShape("sharegpt", 166.5, 363.0, 0.95, 0.85, 161.31, 337.99)
ALPACA = TraceShape("alpaca", 19.31, 59.2, 0.6, 0.8, 19.31, 58.45)
SHAPES = {s.name: s for s in (SHAREGPT, ALPACA)}


def _lognormal_int(rng: random.Random, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma**2 / 2  # E[lognormal] = exp(mu + sigma^2 / 2) = mean
    return max(1, round(rng.lognormvariate(mu, sigma)))


def make_trace(shape: TraceShape | str, num_requests: int, seed: int = 0, rate: float | None = None,
               max_len: int = MAX_SEQ_LEN, scale: float = 1.0) -> list[TraceRequest]:
    """``num_requests`` requests; ``rate`` (requests/s) gives Poisson arrivals, None means all at t=0.

    ``scale`` shrinks lengths (e.g. 0.25 for CPU-sized benchmarks) after drawing, so the shape is kept.
    """
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(num_requests):
        while True:
            p = _lognormal_int(rng, shape.draw_mean_input, shape.sigma_input)
            o = _lognormal_int(rng, shape.draw_mean_output, shape.sigma_output)
            if p + o <= max_len:
                break
        if scale != 1.0:
            p, o = max(1, round(p * scale)), max(1, round(o * scale))
        if rate is not None:
            t += rng.expovariate(rate)
        out.append(TraceRequest(i, p, o, t))
    return out


def sharegpt_like(num_requests: int = 1000, seed: int = 0, **kw) -> list[TraceRequest]:
    return make_trace(SHAREGPT, num_requests, seed, **kw)


def alpaca_like(num_requests: int = 1000, seed: int = 0, **kw) -> list[TraceRequest]:
    return make_trace(ALPACA, num_requests, seed, **kw)


def summarize(trace: list[TraceRequest]) -> dict:
    n = len(trace)
    ins = sorted(r.prompt_len for r in trace)
    outs = sorted(r.output_len for r in trace)
    return {
        "requests": n,
        "mean_input": sum(ins) / n,
        "mean_output": sum(outs) / n,
        "median_input": ins[n // 2],
        "median_output": outs[n // 2],
        "max_total": max(r.total_len for r in trace),
    }


def prompt_token_ids(req: TraceRequest, vocab_size: int, seed: int = 0) -> list[int]:
    """Deterministic stand-in token ids for a trace request (lengths matter here, not words)."""
    rng = random.Random(seed * 1_000_003 + req.request_id)
    return [rng.randrange(3, vocab_size) for _ in range(req.prompt_len)]
