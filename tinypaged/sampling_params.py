"""SamplingParams: how to pick the next token, and when to stop (vLLM's names and meanings)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# vLLM's threshold (vllm/sampling_params.py and vllm/v1/sample/sampler.py): a temperature below it is greedy.
# Dividing logits by a smaller one overflows float32 (1e-300 becomes 0.0), so sampling could only fail.
SAMPLING_EPS = 1e-5
# torch.Generator.manual_seed takes seeds in this range (a seed outside it raises an overflow error).
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1
# The largest count or token id a request may carry: a signed 64-bit integer (what torch's int64 tensors and the
# engine core's MessagePack messages hold; a larger Python int would overflow deep inside, after work began).
INT_MAX = 2**63 - 1
# float32's smallest positive value (a subnormal): a top_p below it rounds to 0 in the sampler's float32
# probabilities, so it is refused as outside (0, 1] (vLLM requires 0 < top_p <= 1).
FLOAT32_TINIEST = 2.0**-149


def is_int(x) -> bool:
    """An integer, and not a bool (True is an int in Python, but never a count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """An int or a float, and not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    temperature 0 means greedy; so does any temperature below ``SAMPLING_EPS`` (1e-5), as in vLLM.
    ``top_k`` of -1 (or 0), ``top_p`` of 1.0 and ``min_p`` of 0 switch those filters off; ``min_p`` keeps the tokens
    whose probability is at least ``min_p`` times the likeliest one's (vLLM's, applied after the temperature and
    before top-k and top-p); ``allowed_token_ids`` restricts every pick to those ids (greedy too), as vLLM's.
    ``stop`` strings end generation and are cut from the text; ``stop_token_ids`` and the model's
    end-of-sequence token end it too (unless ``ignore_eos``). ``n`` samples share the prompt's KV
    blocks (``parallel_sampling="fork"``, the paper's copy-on-write) or run as n requests that share
    the prompt through the prefix cache (``"fanout"``, vLLM v1). ``seed`` makes one request reproducible
    whatever else is in the batch; sample ``i`` of ``n`` uses seed ``seed + i``, so all of them must be in
    torch's seed range. Every field is checked here, so a bad request is refused before any work, and
    checked again when a request is made from it (``clone``): a field changed after construction is
    caught then, before any work, and the request keeps its own copy.
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
    min_p: float = 0.0
    allowed_token_ids: list[int] | None = None
    # vLLM's ``bad_words`` as token ids (the server tokenizes each word, with and without a leading space, as
    # vLLM's ``update_from_tokenizer``): the last id of a sequence is banned whenever the output ends with the rest
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's text options: keep the matched stop string at the end of the text; drop special tokens from it
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
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
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, (list, tuple, set)):
            problems.append(f"allowed_token_ids must be a list of integers, got "
                            f"{type(self.allowed_token_ids).__name__}")
            self.allowed_token_ids = None
        elif self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self._stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify(problems)

    def _verify(self, problems: list[str]) -> None:
        big = [f"{name} must be at most 2**63 - 1 (a 64-bit integer), got {getattr(self, name)}"
               for name in ("n", "top_k", "max_tokens", "min_tokens")
               if is_int(getattr(self, name)) and getattr(self, name) > INT_MAX]
        if any(is_int(t) and t > INT_MAX for t in self.stop_token_ids):
            big.append("stop_token_ids must hold token ids at most 2**63 - 1 (64-bit integers), got "
                       f"{[t for t in self.stop_token_ids if is_int(t) and t > INT_MAX][:3]}")
        if big:  # named first: the checks below would compare or add such numbers
            raise ValueError("Invalid SamplingParams: " + "; ".join(big + problems))
        if not is_int(self.n) or self.n < 1:
            problems.append(f"n must be an integer >= 1, got {self.n!r}")
        if not is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be a finite number >= 0 (0, or below 1e-5, means greedy), "
                            f"got {self.temperature!r}")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        elif self.top_p < FLOAT32_TINIEST:
            problems.append(f"top_p must be a number in (0, 1] that float32 can hold (at least 2**-149, about "
                            f"1.4e-45; it rounds to 0 below), got {self.top_p!r}")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            problems.append(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            problems.append(f"seed must be an integer in [-2**63, 2**64 - 1] (torch's seed range) or None, "
                            f"got {self.seed!r}")
        elif self.seed is not None and is_int(self.n) and self.seed + self.n - 1 > SEED_MAX:
            problems.append(f"seed + n - 1 must be <= 2**64 - 1: sample i uses seed + i, got seed={self.seed} "
                            f"with n={self.n}")
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
        elif any(t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must hold token ids >= 0, got {self.stop_token_ids!r}")
        if self.bad_words_token_ids is not None and (
                not isinstance(self.bad_words_token_ids, (list, tuple))
                or any(not isinstance(w, (list, tuple)) or not w or any(not is_int(t) or not 0 <= t <= INT_MAX
                                                                          for t in w)
                       for w in self.bad_words_token_ids)):
            problems.append("bad_words_token_ids must be a list of non-empty lists of token ids")
        if self.allowed_token_ids is not None:  # vLLM's rule: a non-empty list of ids (the vocabulary: the engine's)
            if not self.allowed_token_ids:
                problems.append("allowed_token_ids must not be empty (null allows every token)")
            elif any(not is_int(t) or not 0 <= t <= INT_MAX for t in self.allowed_token_ids):
                problems.append(f"allowed_token_ids must hold token ids in [0, 2**63 - 1], got "
                                f"{self.allowed_token_ids[:5]!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be True or False, got {getattr(self, name)!r}")
        if problems:
            raise ValueError("Invalid SamplingParams: " + "; ".join(problems))

    def clone(self) -> "SamplingParams":
        """A checked copy (vLLM's ``clone``): every field is normalized and checked again, so a field
        set after construction (``sp.n = 0``, ``sp.stop = "x"``) is refused or taken into account here."""
        return dataclasses.replace(self)

    @property
    def greedy(self) -> bool:
        """Pick the most likely token: temperature 0, or one too small to divide by (vLLM's rule)."""
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list


@dataclass
class BeamSearchParams:
    """Beam search settings (as vLLM's ``LLM.beam_search``), checked like ``SamplingParams``."""

    beam_width: int = 2
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        problems = []
        if not is_int(self.beam_width) or self.beam_width < 1:
            problems.append(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            problems.append(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            problems.append(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if problems:
            raise ValueError("Invalid BeamSearchParams: " + "; ".join(problems))

    def clone(self) -> "BeamSearchParams":
        """A checked copy (a field set after construction is checked here, before any work)."""
        return dataclasses.replace(self)
