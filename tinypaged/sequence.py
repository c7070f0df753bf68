"""A Sequence: one stream of tokens the engine is producing (a request with n samples has n)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from tinypaged.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed / swapped back in
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swapping its blocks to CPU memory
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a sequence finished (vLLM's names; ``str()`` gives the plain string vLLM's outputs carry).

    STOP: EOS, a stop token id or a stop string (``stop_reason`` says which: the token id, the string,
    or None for EOS). LENGTH: ``max_tokens`` or ``max_model_len``. ABORT: the request was aborted.
    ERROR: the engine could not go on with this request alone (its sampling failed, say); the
    others in its batch carry on (vLLM v1's ``FinishReason.ERROR``).
    """

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class SequenceTimes:
    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


_seq_ids = itertools.count()


class Sequence:
    """Token ids, progress and KV placement of one sequence.

    ``num_computed_tokens`` counts tokens whose keys and values are in the cache. The tokens from
    there to the end still have to run through the model (the whole prompt at first, one token
    per decode step, everything again after a recompute preemption).

    The scheduler owns progress (``num_computed_tokens``, appended tokens, status); where the
    keys and values live is the KV-cache manager's business (``kv.block_ids(seq)``), not the
    sequence's.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        arrival_time: float = 0.0,
        generator: torch.Generator | None = None,
        extra_keys=None,
        pending_forks: int = 0,
        priority: int = 0,
    ):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit of the latest admission
        self.extra_keys = extra_keys  # mixed into prefix hashes (vLLM: cache_salt, LoRA id, ...)
        self.pending_forks = pending_forks  # n > 1 with parallel_sampling="fork": children still to fork
        self.finish_reason: FinishReason | None = None  # set by the scheduler when it finishes the sequence
        self.stop_reason: int | str | None = None  # vLLM's: the stop token id, the stop string, or None
        self.cumulative_logprob = 0.0
        self.text = ""  # written only by the Detokenizer; final once the sequence has finished
        self.stop_search_from = 0  # Detokenizer: settled characters of text already searched for stop strings
        self.times = SequenceTimes(arrival=arrival_time)
        self.priority = priority  # vLLM's: scheduling_policy="priority" runs lower values first, ties by arrival
        self.num_preemptions = 0

    # -- tokens --------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """One new token to feed, whose predecessor is cached: a decode step. Anything else is prefill."""
        return bool(self.output_token_ids) and self.num_uncomputed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def max_total_tokens(self, max_model_len: int) -> int:
        """The longest this sequence can get: prompt + max_tokens, capped by max_model_len."""
        cap = max_model_len if self.params.max_tokens is None else len(self.prompt_token_ids) + self.params.max_tokens
        return min(cap, max_model_len)

    def append_token(self, token: int, logprob: float, now: float) -> None:
        self.output_token_ids.append(token)
        self.cumulative_logprob += logprob
        self.times.token_times.append(now)
        if self.times.first_token is None:
            self.times.first_token = now

    def fork(self, index: int, generator: torch.Generator | None) -> "Sequence":
        """A child with the same tokens and progress (its KV blocks are shared by the block manager)."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.params, index, self.times.arrival, generator,
                         self.extra_keys, priority=self.priority)
        child.output_token_ids = list(self.output_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        child.times.first_scheduled = self.times.first_scheduled
        child.stop_search_from = self.stop_search_from
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
