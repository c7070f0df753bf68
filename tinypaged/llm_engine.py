"""The engine: requests in, one scheduled step at a time, outputs out.

    add_request() -> [waiting] -> step(): schedule -> run the model -> sample -> check stops -> ...

``step()`` is public so notebooks and tools can watch the engine work one iteration at a time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tinypaged.block_manager import BlockManager
from tinypaged.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from tinypaged.contiguous import ContiguousKVManager
from tinypaged.kv_cache import KVCacheTensors, kv_bytes_per_token
from tinypaged.model import head_dim_of
from tinypaged.model_loader import eos_token_ids, load_model, load_tokenizer
from tinypaged.model_runner import ModelRunner
from tinypaged.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinypaged.sampler import sample
from tinypaged.sampling_params import SamplingParams
from tinypaged.scheduler import ScheduledSeq, Scheduler
from tinypaged.sequence import Sequence, SequenceStatus

logger = logging.getLogger("tinypaged")
if not logger.handlers:  # like vLLM: INFO lines on stderr (stdout stays for the user's own output)
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s tinypaged: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False

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
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.model = load_model(config.model, self.dtype, self.device, config.seed)
        hf = self.model.config
        config.finalize(hf.max_position_embeddings)
        self.vocab_size = hf.vocab_size
        self._tokenizer = None
        self.eos_token_ids = eos_token_ids(config.model)
        self.bytes_per_token = kv_bytes_per_token(hf.num_hidden_layers, hf.num_key_value_heads, head_dim_of(hf), self.dtype)
        self.generator = torch.Generator().manual_seed(config.seed)
        self._build_kv_cache(hf)
        self.runner = ModelRunner(self.model, self.kv, self.kv_tensors, self.device, config.attention_backend)
        self.scheduler = Scheduler(config, self.kv, clock=self.clock, swapper=self.kv_tensors)
        self.requests: dict[str, Request] = {}
        self._t0 = time.perf_counter()
        self.counters = {"num_steps": 0, "num_generated_tokens": 0, "num_prefill_tokens": 0,
                         "num_requests_finished": 0, "num_busy_slot_steps": 0, "num_idle_slot_steps": 0}
        self.history: list[dict] = []

    # -- construction ----------------------------------------------------------------------
    def _kv_capacity_tokens(self) -> int:
        c = self.config
        if c.kv_cache_tokens is not None:
            return c.kv_cache_tokens
        if c.num_gpu_blocks_override is not None:
            return c.num_gpu_blocks_override * c.block_size
        if c.kv_cache_memory_bytes is not None:
            return c.kv_cache_memory_bytes // self.bytes_per_token
        if self.device.type == "cuda":
            return self._profile_free_gpu_bytes() // self.bytes_per_token
        return CPU_DEFAULT_KV_BYTES // self.bytes_per_token

    def _profile_free_gpu_bytes(self) -> int:
        """vLLM's sizing: total x utilization - (weights + activation peak of a max-size forward)."""
        c = self.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n = c.max_num_batched_tokens
        hf = self.model.config
        scratch = KVCacheTensors(hf.num_hidden_layers, n, hf.num_key_value_heads, head_dim_of(hf), self.dtype, self.device)
        from tinypaged.attention import ForwardContext

        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device) % c.max_model_len
        ctx = ForwardContext(scratch.keys, scratch.values, torch.arange(n, device=self.device))
        for start in range(0, n, c.max_model_len):  # prefills of at most max_model_len tokens
            end = min(n, start + c.max_model_len)
            ctx.prefills.append((start, end, torch.arange(start, end, device=self.device), 0))
        self.model(ids, pos, ctx, logits_indices=torch.arange(min(n, c.max_num_seqs), device=self.device))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - scratch.keys.numel() * 2 * scratch.keys.element_size()
        del scratch, ctx
        torch.cuda.empty_cache()
        total = torch.cuda.mem_get_info()[1]
        available = int(total * c.gpu_memory_utilization) - peak
        if available <= 0:
            raise ValueError(
                f"No memory is left for the KV cache: weights and activations peak at {peak / 2**30:.2f} GiB "
                f"of the {total * c.gpu_memory_utilization / 2**30:.2f} GiB allowed; raise gpu_memory_utilization "
                f"or lower max_num_batched_tokens."
            )
        return available

    def _build_kv_cache(self, hf) -> None:
        c = self.config
        tokens = self._kv_capacity_tokens()
        layers, kvh, hd = hf.num_hidden_layers, hf.num_key_value_heads, head_dim_of(hf)
        if c.kv_cache == "contiguous":
            self.kv = ContiguousKVManager(tokens, c.reservation_policy, c.max_model_len)
            self.kv_tensors = KVCacheTensors(layers, tokens, kvh, hd, self.dtype, self.device)
            logger.info("KV cache (contiguous, policy %s): %d tokens, %d bytes per token; maximum concurrency "
                        "for %d-token requests: %.2fx", c.reservation_policy, tokens, self.bytes_per_token,
                        c.max_model_len, tokens / c.max_model_len)
            return
        num_blocks = tokens // c.block_size
        if num_blocks < 1:
            raise ValueError(f"The KV cache holds {tokens} tokens, less than one block of {c.block_size}; "
                             f"raise kv_cache_memory_bytes (or gpu_memory_utilization) or lower block_size")
        cpu_blocks = 0
        if c.preemption_mode == "swap":
            cpu_blocks = int(c.swap_space * 2**30) // (self.bytes_per_token * c.block_size)
        self.kv_tensors = KVCacheTensors(layers, num_blocks * c.block_size, kvh, hd, self.dtype, self.device,
                                         block_size=c.block_size, num_cpu_blocks=cpu_blocks)
        self.kv = BlockManager(num_blocks, c.block_size, c.enable_prefix_caching,
                               copy_block=self.kv_tensors.copy_block, num_cpu_blocks=cpu_blocks)
        logger.info("KV cache (paged): %d blocks of %d tokens, %d bytes per block = %d tokens; maximum "
                    "concurrency for %d-token requests: %.2fx", num_blocks, c.block_size,
                    self.bytes_per_token * c.block_size, num_blocks * c.block_size, c.max_model_len,
                    num_blocks * c.block_size / c.max_model_len)

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
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
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
        if params.n > 1 and c.kv_cache != "paged":
            raise NotImplementedError(f"Request {request_id}: n={params.n} shares KV blocks, which needs kv_cache='paged'")
        req = Request(request_id, text, ids, params)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = Sequence(request_id, ids, params, 0, self.clock() if arrival_time is None else arrival_time, gen)
        need = self.kv.tokens_needed(seq) if c.kv_cache == "contiguous" else seq.max_total_tokens(c.max_model_len)
        if need > self.kv.capacity_tokens:
            raise ValueError(
                f"Request {request_id} can never fit in the KV cache: it needs up to {need} tokens "
                f"(prompt {len(ids)} + max_tokens {params.max_tokens}, as reserved by kv_cache={c.kv_cache!r}) "
                f"but the cache holds {self.kv.capacity_tokens}. Lower max_tokens or max_model_len, or give "
                f"the cache more memory (kv_cache_memory_bytes / gpu_memory_utilization).")
        req.seqs.append(seq)
        return req

    def enqueue(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"Request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.scheduler.add(req.seqs[0])

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue one request; a bad one raises ValueError and nothing already running is affected."""
        self.enqueue(self.make_request(request_id, prompt, params, arrival_time))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one iteration -----------------------------------------------------------------------
    def step(self) -> StepResult:
        out = self.scheduler.schedule()
        step_no = self.counters["num_steps"]
        result = StepResult(step_no, out.scheduled, {}, out.preempted, [])
        if not out.scheduled:
            return result
        logits, sampling = self.runner.execute(out.scheduled)
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            if item.kind == "prefill":
                self.counters["num_prefill_tokens"] += item.num_tokens
        if sampling:
            rows, seqs = self._expand_forks(sampling)
            tokens, logprobs = sample(logits[rows], seqs, self.generator)
            now = self.clock()
            for seq, tok, lp in zip(seqs, tokens, logprobs):
                self._append_token(seq, tok, lp, now)
                result.new_tokens[seq.seq_id] = tok
                result.sampled.append(seq)
            for seq in seqs:
                if seq.is_finished:
                    self.scheduler.finish(seq)
                    req = self.requests.get(seq.request_id)  # gone if a sibling sample just finished it
                    if req is not None and req.finished:
                        result.finished.append(self._request_output(req))
                        self.counters["num_requests_finished"] += 1
        self.counters["num_steps"] += 1
        self._record(out, result)
        return result

    def _expand_forks(self, sampling):
        """A request with n > 1 forks at its first sample: n sequences share the prompt's blocks."""
        rows, seqs = [], []
        for i, seq in enumerate(sampling):
            rows.append(i)
            seqs.append(seq)
            req = self.requests[seq.request_id]
            if req.params.n > 1 and not req.forked:
                req.forked = True
                base = req.params.seed
                if base is not None:
                    seq.generator = torch.Generator().manual_seed(base)
                for k in range(1, req.params.n):
                    gen = torch.Generator().manual_seed(base + k) if base is not None else None
                    child = seq.fork(k, gen)
                    self.kv.fork(seq, child)
                    req.seqs.append(child)
                    self.scheduler.running.append(child)
                    rows.append(i)
                    seqs.append(child)
        return rows, seqs

    def _append_token(self, seq: Sequence, token: int, logprob: float, now: float) -> None:
        p = seq.params
        seq.output_token_ids.append(token)
        seq.cumulative_logprob += logprob
        seq.times.token_times.append(now)
        if seq.times.first_token is None:
            seq.times.first_token = now
        self.counters["num_generated_tokens"] += 1
        n_out = len(seq.output_token_ids)
        reason = None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                reason, seq.stop_reason = "stop", None
            elif token in p.stop_token_ids:
                reason, seq.stop_reason = "stop", token
            elif p.stop_strings:
                text = self.detokenize(seq.output_token_ids)
                hits = [(text.find(s), s) for s in p.stop_strings if s in text]
                if hits:
                    at, s = min(hits)
                    seq.text = text[:at]
                    reason, seq.stop_reason = "stop", s
        if reason is None and ((p.max_tokens is not None and n_out >= p.max_tokens) or len(seq) >= self.config.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            seq.status = SequenceStatus.FINISHED
            seq.times.finished = now

    def _request_output(self, req: Request) -> RequestOutput:
        outs = []
        for seq in sorted(req.seqs, key=lambda s: s.index):
            if seq.stop_reason is None or not isinstance(seq.stop_reason, str):
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

    # -- accounting ------------------------------------------------------------------------
    def _record(self, out, result) -> None:
        sched = self.scheduler
        if self.config.scheduler == "static":  # slots of the static batch that did no work this step
            self.counters["num_busy_slot_steps"] += len(out.scheduled)
            self.counters["num_idle_slot_steps"] += max(sched.static_batch_size - len(out.scheduled), 0)
        self.history.append({
            "step": result.step, "time": self.clock(), "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_prefill_tokens": sum(s.num_tokens for s in out.scheduled if s.kind == "prefill"),
            "num_decode_tokens": sum(s.num_tokens for s in out.scheduled if s.kind == "decode"),
            "kv_cache_usage": self.kv.stats()["kv_cache_usage"],
            "num_preemptions": sched.num_preemptions,
            "running": [s.seq.request_id for s in out.scheduled],
        })

    def kv_waste_tokens(self) -> int:
        """Slots allocated but holding no token state (paged: the unfilled tail of last blocks)."""
        if self.config.kv_cache == "contiguous":
            st = self.kv.stats()
            return st["kv_reserved_tokens"] - st["kv_token_states"]
        fill: dict[int, int] = {}
        bs = self.config.block_size
        for seq in self.scheduler.running:
            for i, b in enumerate(seq.block_table):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, seq.num_computed_tokens - i * bs)))
        return len(fill) * bs - sum(fill.values())

    def get_metrics(self) -> dict:
        m = dict(self.counters)
        m["num_preemptions"] = self.scheduler.num_preemptions
        m["num_running"] = len(self.scheduler.running)
        m["num_waiting"] = len(self.scheduler.waiting)
        m.update(self.kv.stats())
        m["kv_waste_tokens"] = self.kv_waste_tokens()
        slots = m["num_busy_slot_steps"] + m["num_idle_slot_steps"]
        m["idle_slot_fraction"] = m["num_idle_slot_steps"] / slots if slots else 0.0
        return m
