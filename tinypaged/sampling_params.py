"""SamplingParams: how to pick the next token, and when to stop (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    temperature 0 means greedy. ``top_k`` of -1 (or 0) and ``top_p`` of 1.0 switch those filters off.
    ``stop`` strings end generation and are cut from the text; ``stop_token_ids`` and the model's
    end-of-sequence token end it too (unless ``ignore_eos``). ``n`` samples share the prompt's KV
    blocks (``parallel_sampling="fork"``, the paper's copy-on-write) or run as n requests that share
    the prompt through the prefix cache (``"fanout"``, vLLM v1). ``seed`` makes one request reproducible whatever else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    _stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            problems.append(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
            self.stop = None
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple, set)):
            problems.append(f"stop_token_ids must be a list of integers, got {type(self.stop_token_ids).__name__}")
            self.stop_token_ids = None
        self._stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify(problems)

    def _verify(self, problems: list[str]) -> None:
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            problems.append(f"n must be an integer >= 1, got {self.n!r}")
        if not is_num(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            problems.append(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not is_int(self.seed):
            problems.append(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            problems.append(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            problems.append(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        elif is_int(self.max_tokens) and self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens must be in [0, max_tokens], got {self.min_tokens} > max_tokens={self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            problems.append("stop must hold non-empty strings")
        if any(not is_int(t) for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must hold integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            problems.append(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if problems:
            raise ValueError("Invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list


@dataclass
class BeamSearchParams:
    """Beam search settings (as vLLM's ``LLM.beam_search``)."""

    beam_width: int = 2
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
