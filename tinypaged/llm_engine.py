"""The engine: requests in, one scheduled step at a time, outputs out.

    add_request() -> [waiting] -> step(): schedule -> run the model -> sample -> update progress -> outputs

``step()`` is public so notebooks and tools can watch the engine work one iteration at a time.
The engine only wires the parts together; each piece of state has one owner (see
``tinypaged.interfaces`` and docs/ARCHITECTURE.md): the KV manager owns placement, the scheduler
owns progress, the runner owns the device, the sampler owns token choice and stop checks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tinypaged.attention import make_backend
from tinypaged.block_manager import BlockManager
from tinypaged.config import EngineConfig
from tinypaged.contiguous import ContiguousKVManager
from tinypaged.interfaces import KV_REQUIRED, POLICY_REQUIRED, require
from tinypaged.model_loader import eos_token_ids, load_model, load_tokenizer
from tinypaged.model_runner import ModelRunner
from tinypaged.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinypaged.sampler import check_stop, sample
from tinypaged.sampling_params import SamplingParams
from tinypaged.scheduler import ScheduledSeq, Scheduler, make_policy
from tinypaged.sequence import Sequence

logger = logging.getLogger("tinypaged")


def configure_logging() -> None:
    """Like vLLM: INFO lines on stderr (stdout stays for the user's own output). Done once, when the
    first engine is built, so importing tinypaged changes no logging set-up."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s tinypaged: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


@dataclass
class StepResult:
    """What one ``step()`` did: the batch it ran, the tokens it produced, what finished or was preempted."""

    step: int
    scheduled: list[ScheduledSeq]
    new_tokens: dict[int, int]  # seq_id -> token sampled this step
    preempted: list[Sequence]
    finished: list[RequestOutput]
    sampled: list[Sequence] = field(default_factory=list)  # sequences that got a token, as new_tokens

    def trace(self) -> str:
        """One line per step, stable across machines (ids and counts only)."""
        parts = [f"{s.seq.request_id}:{s.kind[0]}{s.num_tokens}" for s in self.scheduled]
        line = f"step {self.step:3d} | " + " ".join(parts)
        if self.preempted:
            line += " | preempted " + ",".join(s.request_id for s in self.preempted)
        if self.finished:
            line += " | finished " + ",".join(r.request_id for r in self.finished)
        return line


class LLMEngine:
    def __init__(self, config: EngineConfig):
        configure_logging()
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        # vLLM refuses to start when the device has less free memory than the share it was given
        self._mem_at_start = None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self._mem_at_start = (free, total, torch.cuda.memory_allocated(self.device),
                                  torch.cuda.memory_reserved(self.device))
        self.model = load_model(config.model, self.dtype, self.device, config.seed)
        hf = self.model.config
        config.finalize(hf.max_position_embeddings)
        self.vocab_size = hf.vocab_size
        self._tokenizer = None
        self.eos_token_ids = eos_token_ids(config.model)
        self.generator = torch.Generator().manual_seed(config.seed)
        checking = config.has_plugins if config.check_invariants is None else config.check_invariants
        backend = make_backend(config.attention_backend, config.block_size)
        self.runner = ModelRunner(self.model, self.device, backend, checking)
        self.bytes_per_token = self.runner.bytes_per_token
        self.kv, self.kv_tensors = self._build_kv_cache()
        self.runner.attach(self.kv, self.kv_tensors)
        policy = make_policy(config)
        require(policy, POLICY_REQUIRED, "scheduling_policy")
        self.scheduler = Scheduler(config, self.kv, policy, clock=self.clock, swapper=self.kv_tensors)
        self.requests: dict[str, Request] = {}
        self._t0 = time.perf_counter()
        self.counters = {"num_steps": 0, "num_generated_tokens": 0, "num_prefill_tokens": 0,
                         "num_requests_finished": 0, "num_requests_aborted": 0, "num_busy_slot_steps": 0,
                         "num_idle_slot_steps": 0}
        self.history: deque[dict] = deque(maxlen=config.history_size)

    # -- construction ----------------------------------------------------------------------
    def _build_kv_cache(self):
        """The runner sizes and allocates the cache; the KV manager (built-in or a plug-in) manages it."""
        c = self.config
        tensors, spec = self.runner.allocate_kv_cache(c, self._mem_at_start)
        factory = c.kv_cache_manager or (BlockManager.from_spec if c.kv_cache == "paged" else ContiguousKVManager.from_spec)
        kv = factory(spec)
        require(kv, KV_REQUIRED, "kv_cache_manager")
        if self.runner.backend.uses_block_tables:
            require(kv, ("block_ids",), f"kv_cache_manager (attention_backend {self.runner.backend.name!r} reads block tables)")
        return kv, tensors

    # -- tokenizer -------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.model)
            if self._tokenizer is None:
                raise ValueError(f"Model {self.config.model!r} ships no tokenizer: pass prompts as "
                                 f"{{'prompt_token_ids': [...]}} and read token_ids from the outputs")
            self.eos_token_ids |= eos_token_ids(self.config.model, self._tokenizer)
        return self._tokenizer

    def detokenize(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` (empty for a model without a tokenizer)."""
        try:
            tok = self.tokenizer
        except ValueError:
            return ""
        return tok.decode(token_ids, skip_special_tokens=True)

    def clock(self) -> float:
        return time.perf_counter() - self._t0

    def reset_clock(self) -> None:
        self._t0 = time.perf_counter()

    # -- requests --------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                     arrival_time: float | None = None) -> Request:
        """Tokenize and validate one request without queueing it (generate() checks all first)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Request {request_id}: sampling_params must be a SamplingParams, got {type(params).__name__}")
        salt = None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), _token_ids(request_id, prompt["prompt_token_ids"])
            salt = prompt.get("cache_salt")
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            salt = prompt.get("cache_salt")
        else:
            raise ValueError(f"Request {request_id}: a prompt is a string or a dict with 'prompt' or "
                            f"'prompt_token_ids', got {type(prompt).__name__}")
        c = self.config
        if not ids:
            raise ValueError(f"Request {request_id}: the prompt is empty")
        if len(ids) > c.max_model_len:
            raise ValueError(f"Request {request_id}: the prompt ({len(ids)} tokens) is longer than "
                             f"max_model_len ({c.max_model_len})")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Request {request_id}: token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})")
        fork = params.n > 1 and c.parallel_sampling == "fork"
        if fork and not hasattr(self.kv, "fork"):
            raise NotImplementedError(f"Request {request_id}: n={params.n} with parallel_sampling='fork' shares "
                                      f"KV blocks, which needs a KV manager with fork() (kv_cache='paged'); "
                                      f"or use parallel_sampling='fanout'")
        if fork and params.n > c.max_num_seqs:
            raise ValueError(f"Request {request_id}: n={params.n} forked samples can never run together under "
                             f"max_num_seqs={c.max_num_seqs}; raise max_num_seqs or use parallel_sampling='fanout'")
        req = Request(request_id, text, ids, params)
        arrival = self.clock() if arrival_time is None else arrival_time
        # fork: one sequence now, n - 1 children at its first sample; fanout (vLLM v1): n independent
        # sequences whose seeds are seed + index, sharing the prompt only through the prefix cache
        for k in range(1 if fork or params.n == 1 else params.n):
            gen = torch.Generator().manual_seed(params.seed + k) if params.seed is not None else None
            req.seqs.append(Sequence(request_id, ids, params, k, arrival, gen, salt))
        req.seqs[0].pending_forks = params.n - 1 if fork else 0
        need = self.kv.max_tokens_needed(req.seqs[0])
        if need > self.kv.capacity_tokens:
            raise ValueError(
                f"Request {request_id} can never fit in the KV cache: it needs up to {need} tokens "
                f"(prompt {len(ids)} + max_tokens {params.max_tokens}, as the KV manager reserves them) "
                f"but the cache holds {self.kv.capacity_tokens}. Lower max_tokens or max_model_len, or give "
                f"the cache more memory (kv_cache_memory_bytes / gpu_memory_utilization).")
        return req

    def enqueue(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"Request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue one request; a bad one raises and nothing already running is affected."""
        self.enqueue(self.make_request(request_id, prompt, params, arrival_time))

    def abort_request(self, request_ids) -> None:
        """Stop requests wherever they are (vLLM's ``LLMEngine.abort_request``): their blocks are freed
        and they leave every queue; unknown or finished ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.abort(req.seqs)
                self.counters["num_requests_aborted"] += 1

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one iteration -----------------------------------------------------------------------
    def step(self, select_tokens=None) -> StepResult:
        """Schedule, run the model, sample, update progress. ``select_tokens(seqs, logits)`` replaces
        sampling for callers that choose tokens themselves (beam search); it then owns their progress."""
        sched = self.scheduler
        out = sched.schedule()
        result = StepResult(self.counters["num_steps"], out.scheduled, {}, out.preempted, [])
        if not out.scheduled:
            return result
        logits, sampling = self.runner.execute(out.scheduled)
        sched.advance(out)
        self.counters["num_prefill_tokens"] += sum(s.num_tokens for s in out.scheduled if s.kind == "prefill")
        if sampling and select_tokens is not None:
            select_tokens(sampling, logits)
        elif sampling:
            rows, seqs = self._expand_forks(sampling)
            tokens, logprobs = sample(logits[rows], seqs, self.generator, self.eos_token_ids)
            done = sched.update_from_output(seqs, tokens, logprobs, self.clock(), self._stop_check)
            self.counters["num_generated_tokens"] += len(seqs)
            result.new_tokens = {seq.seq_id: tok for seq, tok in zip(seqs, tokens)}
            result.sampled = seqs
            for seq in done:
                req = self.requests.get(seq.request_id)  # gone if a sibling sample just finished it
                if req is not None and req.finished:
                    result.finished.append(self._request_output(req))
                    self.counters["num_requests_finished"] += 1
        self.counters["num_steps"] += 1
        self._record(out, result)
        return result

    def _stop_check(self, seq: Sequence):
        return check_stop(seq, self.eos_token_ids, self.config.max_model_len, self.detokenize)

    def _expand_forks(self, sampling):
        """parallel_sampling="fork" (paper, v0): a request with n > 1 forks at its first sample; the
        children share the prompt's blocks and sample their first token from the same logits row."""
        rows, seqs = [], []
        for i, seq in enumerate(sampling):
            rows.append(i)
            seqs.append(seq)
            if seq.pending_forks:
                req = self.requests[seq.request_id]
                base = req.params.seed
                for k in range(1, seq.pending_forks + 1):
                    gen = torch.Generator().manual_seed(base + k) if base is not None else None
                    child = self.scheduler.fork(seq, k, gen)
                    req.seqs.append(child)
                    rows.append(i)
                    seqs.append(child)
                seq.pending_forks = 0
        return rows, seqs

    def _request_output(self, req: Request) -> RequestOutput:
        outs = []
        for seq in sorted(req.seqs, key=lambda s: s.index):
            if not isinstance(seq.stop_reason, str):  # a stop string already cut seq.text
                seq.text = self.detokenize(seq.output_token_ids)
            outs.append(CompletionOutput(seq.index, seq.text, list(seq.output_token_ids), seq.cumulative_logprob,
                                         seq.finish_reason, seq.stop_reason))
        s0 = req.seqs[0]
        metrics = RequestMetrics(s0.times.arrival, s0.times.first_scheduled, s0.times.first_token,
                                 max(s.times.finished or 0.0 for s in req.seqs),
                                 sum(len(s.output_token_ids) for s in req.seqs), s0.num_cached_tokens,
                                 sum(s.num_preemptions for s in req.seqs))
        self.requests.pop(req.request_id, None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True, metrics)

    # -- accounting: O(batch) per step, never O(cache) ------------------------------------------
    def _record(self, out, result) -> None:
        sched = self.scheduler
        if self.config.scheduling_policy == "static":
            self.counters["num_busy_slot_steps"] += len(out.scheduled)
            self.counters["num_idle_slot_steps"] += out.num_idle_slots
        if self.history.maxlen == 0:
            return
        self.history.append({
            "step": result.step, "time": self.clock(), "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_prefill_tokens": sum(s.num_tokens for s in out.scheduled if s.kind == "prefill"),
            "num_decode_tokens": sum(s.num_tokens for s in out.scheduled if s.kind == "decode"),
            "kv_cache_usage": self.kv.usage,
            "num_preemptions": sched.num_preemptions,
            "running": [s.seq.request_id for s in out.scheduled],
        })

    def kv_waste_tokens(self) -> int:
        """Slots allocated but holding no token state (paged: the unfilled tail of last blocks)."""
        if isinstance(self.kv, ContiguousKVManager):
            st = self.kv.stats()
            return st["kv_reserved_tokens"] - st["kv_token_states"]
        if not hasattr(self.kv, "block_ids"):
            return 0
        fill: dict[int, int] = {}
        bs = self.kv.block_size
        for seq in self.scheduler.running:
            for i, b in enumerate(self.kv.block_ids(seq)):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, seq.num_computed_tokens - i * bs)))
        return len(fill) * bs - sum(fill.values())

    def get_metrics(self) -> dict:
        """Counters, queue sizes and the KV manager's statistics (computed on demand)."""
        m = dict(self.counters)
        m["num_preemptions"] = self.scheduler.num_preemptions
        m["num_running"] = len(self.scheduler.running)
        m["num_waiting"] = len(self.scheduler.waiting) + sum(len(g) for g in self.scheduler.swapped)
        m["kv_cache_usage"] = self.kv.usage
        if hasattr(self.kv, "stats"):
            m.update(self.kv.stats())
        m["kv_waste_tokens"] = self.kv_waste_tokens()
        slots = m["num_busy_slot_steps"] + m["num_idle_slot_steps"]
        m["idle_slot_fraction"] = m["num_idle_slot_steps"] / slots if slots else 0.0
        return m


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
