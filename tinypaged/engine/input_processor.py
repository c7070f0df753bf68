"""Requests in: validating and building them before anything is queued (vLLM v1's input processor).

``InputProcessor.make_request`` turns one prompt and its SamplingParams into a ``Request`` and its
sequences, or raises naming the request and the problem: the three prompt forms, text that is not
valid Unicode, token ids and stop token ids outside the vocabulary, ``min_tokens`` with every token
banned, the fork policy for n > 1, and requests that could never fit. The request keeps a checked
copy of its SamplingParams (a field changed after construction is checked here too).
``check_batch`` does the same for the shape of one ``generate`` call
(prompts, a params list, arrival times). Nothing here touches a queue, so a bad request anywhere in a
call leaves the engine exactly as it was.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field


from tinypaged.kv.managers import check_fits
from tinypaged.sampling.sampler import sample_generator
from tinypaged.sampling_params import SamplingParams
from tinypaged.sequence import Sequence


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None  # why the engine failed this request (finish_reason "error"), else None
    priority: int = 0  # vLLM's: with scheduling_policy="priority", lower values are scheduled first
    # parallel_sampling="fanout", n > 1 (vLLM v1's ParentRequest): the core's requests, one per sample; else empty
    children: list["Request"] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


class InputProcessor:
    def __init__(self, config, vocab_size: int, kv, encode, clock, eos_token_ids=()):
        self.config = config
        self.vocab_size = vocab_size
        self.kv = kv
        self.encode = encode  # text -> token ids (the tokenizer loads on the first text prompt)
        self.clock = clock
        self.eos_token_ids = eos_token_ids  # the model's EOS ids: the core's set (it grows when the tokenizer loads)

    def make_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                     arrival_time: float | None = None, priority: int = 0) -> Request:
        """Tokenize and validate one request without queueing it."""
        priority = check_priority(priority, self.config.scheduling_policy, f"Request {request_id}: priority")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Request {request_id}: sampling_params must be a SamplingParams, got {type(params).__name__}")
        try:  # checked again: a field may have been changed since construction; the request keeps this copy
            params = params.clone()
        except ValueError as e:
            raise ValueError(f"Request {request_id}: {e}") from None
        text, ids, salt = self._prompt(request_id, prompt)
        c, top = self.config, self.vocab_size - 1
        if not ids:
            raise ValueError(f"Request {request_id}: the prompt is empty")
        if len(ids) > c.max_model_len:
            raise ValueError(f"Request {request_id}: the prompt ({len(ids)} tokens) is longer than "
                             f"max_model_len ({c.max_model_len})")
        bad = [t for t in ids if not 0 <= t <= top]
        if bad:
            raise ValueError(f"Request {request_id}: token ids {bad[:5]} are outside the vocabulary (0..{top})")
        bad = [t for t in params.stop_token_ids if not 0 <= t <= top]
        if bad:
            raise ValueError(f"Request {request_id}: stop_token_ids {bad[:5]} are outside the vocabulary (0..{top})")
        self._check_min_tokens(request_id, params)
        fork = params.n > 1 and c.parallel_sampling == "fork"
        if fork and not hasattr(self.kv, "fork"):
            raise NotImplementedError(f"Request {request_id}: n={params.n} with parallel_sampling='fork' shares "
                                      f"KV blocks, which needs a KV manager with fork() (kv_cache_manager='paged'); "
                                      f"or use parallel_sampling='fanout'")
        if fork and params.n > c.max_num_seqs:
            raise ValueError(f"Request {request_id}: n={params.n} forked samples can never run together under "
                             f"max_num_seqs={c.max_num_seqs}; raise max_num_seqs or use parallel_sampling='fanout'")
        req = Request(request_id, text, ids, params, priority=priority)
        arrival = self.clock() if arrival_time is None else arrival_time
        if params.n > 1 and not fork:  # fanout (vLLM v1): n child requests "k_<id>", seeds seed + k
            for k in range(params.n):
                child = dataclasses.replace(params, n=1, seed=None if params.seed is None else (params.seed + k) % 2**64)
                seq = Sequence(f"{k}_{request_id}", ids, child, k, arrival, sample_generator(params.seed, k), salt, 0,
                               priority)
                req.seqs.append(seq)
                req.children.append(Request(seq.request_id, text, ids, child, [seq], priority=priority))
        else:  # one sequence; fork (paper, v0): its n - 1 children come at its first sample
            req.seqs.append(Sequence(request_id, ids, params, 0, arrival, sample_generator(params.seed, 0), salt,
                                     params.n - 1 if fork else 0, priority))
        check_fits(self.kv, req.seqs[0])
        return req

    def _check_min_tokens(self, request_id: str, params: SamplingParams) -> None:
        """Until ``min_tokens``, the stop token ids and EOS cannot be sampled: some token must remain."""
        if params.min_tokens == 0:
            return
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if sum(0 <= t < self.vocab_size for t in banned) == self.vocab_size:
            eos = "" if params.ignore_eos else " and EOS"
            raise ValueError(f"Request {request_id}: stop_token_ids{eos} cover the whole vocabulary "
                             f"({self.vocab_size} tokens), so no token could be sampled before min_tokens="
                             f"{params.min_tokens}: leave some tokens out of stop_token_ids or set min_tokens=0")

    def _prompt(self, request_id: str, prompt) -> tuple[str | None, list[int], object]:
        """(text, token ids, cache salt) of a string, {"prompt_token_ids": [...]} or {"prompt": "..."}."""
        if isinstance(prompt, str):
            return prompt, self._encode(request_id, prompt, "the prompt"), None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"Request {request_id}: 'prompt' must be a string or None, got {type(text).__name__}")
            return text, _token_ids(request_id, prompt["prompt_token_ids"]), prompt.get("cache_salt")
        if isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise TypeError(f"Request {request_id}: 'prompt' must be a string, got {type(text).__name__} "
                                f"(or pass 'prompt_token_ids')")
            return text, self._encode(request_id, text, "'prompt'"), prompt.get("cache_salt")
        raise ValueError(f"Request {request_id}: a prompt is a string or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def _encode(self, request_id: str, text: str, what: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800") has no UTF-8 form to tokenize
            raise ValueError(f"Request {request_id}: {what} is not valid Unicode text: {text[e.start:e.end]!r} at "
                             f"character {e.start} is a lone surrogate") from None
        return self.encode(text)


def _token_ids(request_id: str, ids) -> list[int]:
    """Prompt token ids must be integers (a float would be silently truncated otherwise)."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"Request {request_id}: prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    wrong = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
    if wrong:
        raise TypeError(f"Request {request_id}: prompt_token_ids must be integers, got {wrong[0]!r} "
                        f"({type(wrong[0]).__name__})")
    return ids


def check_batch(prompts, sampling_params, arrival_times) -> tuple[list, list, list[float]]:
    """The shape of one generate() call: (prompts, one SamplingParams per prompt, arrival offsets in
    seconds from now). Raises naming the argument (and the index) before anything is queued."""
    single = isinstance(prompts, (str, dict))
    if not single and (not isinstance(prompts, SequenceABC) or isinstance(prompts, bytes)):
        raise TypeError(f"prompts must be a string, a dict with 'prompt' or 'prompt_token_ids', or a list of "
                        f"them; got {type(prompts).__name__}")
    prompts = [prompts] if single else list(prompts)
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SequenceABC) and not isinstance(sampling_params, str):
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"Got {len(params)} SamplingParams for {len(prompts)} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__} (pass one "
                                f"SamplingParams per prompt, or a single one for all)")
    elif isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(prompts)
    else:
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}")
    return prompts, params, _arrival_offsets(arrival_times, len(prompts))


def _arrival_offsets(arrival_times, n: int) -> list[float]:
    if arrival_times is None:
        return [0.0] * n
    if hasattr(arrival_times, "tolist"):  # a NumPy array or a tensor
        times = arrival_times.tolist()
    elif isinstance(arrival_times, SequenceABC) and not isinstance(arrival_times, (str, bytes)):
        times = list(arrival_times)
    else:
        times = None
    if not isinstance(times, list):
        raise TypeError(f"arrival_times must be a list of seconds from now (one per prompt), got "
                        f"{type(arrival_times).__name__}")
    if len(times) != n:
        raise ValueError(f"Got {len(times)} arrival_times for {n} prompts")
    for i, t in enumerate(times):
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"arrival_times[{i}] must be a finite number of seconds >= 0 (from now), got {t!r}")
    return [float(t) for t in times]


PRIORITY_MIN, PRIORITY_MAX = -2**63, 2**63 - 1  # a signed 64-bit integer, as the engine core's messages carry it


def check_priority(priority, policy, what: str = "priority") -> int:
    """One request's ``priority`` (vLLM's rule: any value but 0 needs ``scheduling_policy="priority"``; ``policy``
    None skips that rule): an integer (not a bool) in the signed 64-bit range, returned as a plain int. ``what``
    names it in the error."""
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"{what} must be an integer (lower values are scheduled first), got {priority!r}")
    priority = int(priority)
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"{what}={priority} is out of range: use an integer in [-2**63, 2**63 - 1]")
    if priority != 0 and policy is not None and policy != "priority":
        raise ValueError(f"{what}={priority} is not supported: priority scheduling is not enabled "
                         f"(scheduling_policy={policy!r}); start the engine with scheduling_policy='priority', "
                         f"or leave priority at 0")
    return priority


def check_priorities(priority, n: int, policy) -> list[int]:
    """The ``priority`` argument of one generate() call: None (all 0), or a list of one integer per prompt."""
    if priority is None:
        return [0] * n
    if hasattr(priority, "tolist"):  # a NumPy array or a tensor
        priority = priority.tolist()
    if not isinstance(priority, SequenceABC) or isinstance(priority, (str, bytes)):
        raise TypeError(f"priority must be a list of integers, one per prompt, got {type(priority).__name__}")
    if len(priority) != n:
        raise ValueError(f"Got {len(priority)} priority values for {n} prompts")
    return [check_priority(p, policy, f"priority[{i}]") for i, p in enumerate(priority)]


def check_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int) -> None:
    """The server's rule (vLLM's): a request whose max_tokens cannot fit after its prompt is a 400, not a
    silent cap at the context."""
    if max_tokens is not None and max_tokens > max_model_len - num_prompt_tokens:
        raise ValueError(f"max_tokens is too large: {max_tokens}. This model's maximum context length is "
                         f"{max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
                         f"({max_tokens} > {max_model_len} - {num_prompt_tokens})")
