"""The model runner owns the device: the KV tensors, memory profiling, and one forward per step.

Per step it flattens the scheduled tokens, asks the KV manager where each new token's keys and
values go (``slot_mapping``) and where every sequence's context lives (block tables or context
slots), builds the attention context, runs the model and returns the logits of the sequences that
sample. ``check_slots`` enforces the KV manager's contract before anything is written.
"""

from __future__ import annotations

import logging
import os

import torch

from tinypaged.attention.backends import DecodeBatch, ForwardContext, paged_context_slots
from tinypaged.kv.block_pool import blocks_needed
from tinypaged.interfaces import InvariantError, KVCacheSpec
from tinypaged.kv.sizing import KVLayout, max_concurrency, size_kv_cache, sizing_knob
from tinypaged.worker.kv_cache import KVCacheTensors, kv_bytes_per_token
from tinypaged.model.llama import head_dim_of

logger = logging.getLogger("tinypaged")


def memory_snapshot(device) -> tuple[int, int, int, int] | None:
    """(free, total, torch allocated, torch reserved) bytes on a CUDA ``device``, None elsewhere. Taken
    before the weights load: GPU sizing (``profile_free_gpu_bytes``) counts only what this engine adds
    after it, and vLLM refuses to start when less is free than the share it was given."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return free, total, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


class ModelRunner:
    def __init__(self, model, device, backend, check_invariants: bool = False):
        self.model = model
        self.device = device
        self.backend = backend
        self.check_invariants = check_invariants  # the costlier cross-sequence check (on for plug-ins)
        self.kv = self.tensors = None
        self.capacity = 0
        hf = model.config
        self.dtype = next(model.parameters()).dtype
        self.kv_shape = (hf.num_hidden_layers, hf.num_key_value_heads, head_dim_of(hf))
        self.bytes_per_token = kv_bytes_per_token(*self.kv_shape, self.dtype)

    def attach(self, kv_manager, kv_tensors) -> None:
        """The KV cache, once it is sized (profiling runs before it exists)."""
        self.kv, self.tensors, self.capacity = kv_manager, kv_tensors, kv_tensors.num_slots

    # -- where the context lives -----------------------------------------------------------
    def block_tables(self, seqs, context_len: int) -> torch.Tensor:
        width = max(1, blocks_needed(context_len, self.kv.block_size))
        rows = []
        for s in seqs:
            ids = self.kv.block_ids(s)[:width]
            rows.append(ids + [0] * (width - len(ids)))
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def context_slots(self, seqs, context_len: int) -> torch.Tensor:
        """[len(seqs), context_len] slot of every key position (the manager's fast path if it has one)."""
        if hasattr(self.kv, "context_slots"):
            return self.kv.context_slots(seqs, context_len).to(self.device)
        if hasattr(self.kv, "block_ids"):
            return paged_context_slots(self.block_tables(seqs, context_len), context_len, self.kv.block_size)
        rows = [self.kv.slot_mapping(s, 0, context_len) for s in seqs]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    # -- one step ----------------------------------------------------------------------------
    def prepare(self, scheduled):
        input_ids, positions, slots = [], [], []
        decode_rows, decode_seqs, prefills = [], [], []
        logits_rows, sampling = [], []
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            row0 = len(input_ids)
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(self.kv.slot_mapping(seq, start, start + n))
            if not item.is_prefill:
                decode_rows.append(row0)
                decode_seqs.append(seq)
            else:
                prefills.append((row0, row0 + n, seq, start))
            if start + n == len(seq):  # the chunk reaches the end: this sequence samples now
                logits_rows.append(row0 + n - 1)
                sampling.append(seq)
        dev = self.device
        ctx = ForwardContext(self.tensors.keys, self.tensors.values,
                             torch.tensor(slots, dtype=torch.long, device=dev), self.backend)
        if decode_seqs:
            lens = [s.num_computed_tokens + 1 for s in decode_seqs]
            ctx.decode = DecodeBatch(torch.tensor(decode_rows, device=dev), torch.tensor(lens, device=dev),
                                     self.kv.block_size)
            if self.backend.uses_block_tables:
                ctx.decode.block_tables = self.block_tables(decode_seqs, max(lens))
            else:
                ctx.decode.context_slots = self.context_slots(decode_seqs, max(lens))
        for row0, row1, seq, start in prefills:
            ctx.prefills.append((row0, row1, self.context_slots([seq], start + row1 - row0)[0], start))
        self.check_slots(ctx, scheduled)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, ctx, logits_rows, sampling

    def check_slots(self, ctx: ForwardContext, scheduled) -> None:
        """The KV manager's contract, checked before the forward writes anything: every new token gets
        its own slot inside the cache, and (for plug-ins) no slot another sequence has cached."""
        writes = ctx.slot_mapping
        if writes.numel() == 0:
            return
        if int(writes.min()) < 0 or int(writes.max()) >= self.capacity:
            raise InvariantError(f"the KV manager mapped a token to slot {int(writes.min()) if int(writes.min()) < 0 else int(writes.max())}, "
                                 f"outside the cache's {self.capacity} slots")
        if torch.unique(writes).numel() != writes.numel():
            raise InvariantError("the KV manager gave two new tokens of this step the same slot "
                                 "(a block handed out twice?)")
        if not self.check_invariants:
            return
        readers = [it.seq for it in scheduled if it.seq.num_computed_tokens]
        cached = [self.context_slots([s], s.num_computed_tokens)[0].to(writes.device) for s in readers]
        if cached:
            cached = torch.cat(cached)
            clash = torch.isin(writes, cached)
            if bool(clash.any()) and not _same_step_sharing(writes, cached, scheduled, readers):
                raise InvariantError(f"this step would overwrite slot {int(writes[clash][0])}, which holds "
                                     f"another token's cached keys (a block handed out twice, or a shared "
                                     f"block written without copy-on-write)")

    def execute(self, scheduled):
        """Forward the scheduled tokens; returns (logits of sampling sequences [N, vocab], those sequences)."""
        ids, pos, ctx, rows, sampling = self.prepare(scheduled)
        logits = self.model(ids, pos, ctx, logits_indices=torch.tensor(rows, dtype=torch.long, device=self.device))
        return (logits, sampling) if rows else (None, [])

    # -- sizing the KV cache -----------------------------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        """What one token's keys and values take in this model (``tinypaged.kv.sizing``)."""
        return KVLayout(*self.kv_shape, torch.empty((), dtype=self.dtype).element_size())

    def check_memory(self, c, kv_bytes: int, swap_bytes: int) -> None:
        """Refuse, before allocating, a KV cache (or swap space) larger than the memory there is."""
        knob, name = sizing_knob(c, self.device.type == "cuda")
        host = available_host_bytes()
        device_free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else host
        if device_free is not None and kv_bytes > device_free:
            where = "on the GPU" if self.device.type == "cuda" else "in this machine's memory (MemAvailable)"
            raise ValueError(f"{knob} asks for a KV cache of {_gib(kv_bytes)}, but only {_gib(device_free)} is "
                             f"free {where}: lower {name}")
        if swap_bytes and host is not None and swap_bytes + (kv_bytes if self.device.type == "cpu" else 0) > host:
            raise ValueError(f"swap_space={c.swap_space} GiB asks for {_gib(swap_bytes)} of CPU memory beside the KV "
                             f"cache, but only {_gib(host)} is available (MemAvailable): lower swap_space")

    def profile_free_gpu_bytes(self, c, mem_at_start) -> int:
        """vLLM v1's sizing: requested = total x gpu_memory_utilization; KV = requested - (weights +
        activation peak of a max-size forward + memory torch does not track)."""
        # as vLLM: what this engine adds since start-up counts; memory others (or earlier engines in
        # this process) already held only lowers what is free
        free_start, total, allocated_start, reserved_start = mem_at_start
        requested = int(total * c.gpu_memory_utilization)
        if free_start < requested:
            raise ValueError(
                f"Free memory on the device at start-up ({free_start / 2**30:.2f} of {total / 2**30:.2f} GiB) is "
                f"less than the requested share gpu_memory_utilization={c.gpu_memory_utilization} "
                f"({requested / 2**30:.2f} GiB); lower gpu_memory_utilization or free memory used by other processes.")
        peak = self.profile_peak_bytes(c.max_num_batched_tokens, c.max_model_len, c.max_num_seqs) - allocated_start
        free_now, _ = torch.cuda.mem_get_info(self.device)
        grown = free_start - free_now  # what this process added on the device since start-up
        non_torch = max(0, grown - (torch.cuda.memory_reserved(self.device) - reserved_start))
        available = requested - peak - non_torch
        if available <= 0:
            raise ValueError(
                f"No memory is left for the KV cache: weights and activations peak at {peak / 2**30:.2f} GiB "
                f"(+{non_torch / 2**30:.2f} GiB outside torch) of the {requested / 2**30:.2f} GiB allowed; raise "
                f"gpu_memory_utilization or lower max_num_batched_tokens.")
        return available

    def allocate_kv_cache(self, c, mem_at_start=None) -> tuple[KVCacheTensors, KVCacheSpec]:
        """Size the cache (vLLM's knobs), allocate its tensors, and describe it for a KV manager."""
        size = size_kv_cache(c, self.kv_layout, self.device.type == "cuda",
                             lambda: self.profile_free_gpu_bytes(c, mem_at_start))
        num_blocks, block_size = size.num_blocks, size.block_size
        paged = c.kv_cache == "paged"
        cpu_blocks = 0
        if c.preemption_mode == "swap":
            cpu_blocks = int(c.swap_space * 2**30) // (self.bytes_per_token * c.block_size)
        self.check_memory(c, num_blocks * block_size * self.bytes_per_token,
                          cpu_blocks * c.block_size * self.bytes_per_token)
        tensors = KVCacheTensors(self.kv_shape[0], num_blocks * block_size, *self.kv_shape[1:], self.dtype,
                                 self.device, block_size=block_size, num_cpu_blocks=cpu_blocks)
        spec = KVCacheSpec(num_blocks, block_size, c.max_model_len, c.enable_prefix_caching, c.reservation_policy,
                           cpu_blocks, tensors.copy_block)
        if paged:
            logger.info("KV cache (paged): %d blocks of %d tokens, %d bytes per block = %d tokens; maximum "
                        "concurrency for %d-token requests: %.2fx", num_blocks, c.block_size,
                        self.bytes_per_token * c.block_size, num_blocks * c.block_size, c.max_model_len,
                        max_concurrency(num_blocks, c.block_size, c.max_model_len))
        else:
            logger.info("KV cache (contiguous, policy %s): %d tokens, %d bytes per token; maximum concurrency "
                        "for %d-token requests: %.2fx", c.reservation_policy, num_blocks, self.bytes_per_token,
                        c.max_model_len, max_concurrency(num_blocks, 1, c.max_model_len))
        return tensors, spec

    # -- memory profiling (CUDA) ------------------------------------------------------------
    def profile_peak_bytes(self, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> int:
        """Peak memory torch holds during one forward of ``max_num_batched_tokens`` tokens (prompts of at
        most ``max_model_len``), the scratch KV cache excluded: vLLM's profiling run. It goes
        through ``prepare`` with a throw-away contiguous cache, like any step."""
        from tinypaged.kv.contiguous import ContiguousKVManager
        from tinypaged.sampling_params import SamplingParams
        from tinypaged.sched.output import ScheduledSeq
        from tinypaged.sequence import Sequence

        n = max_num_batched_tokens
        sizes = [min(max_model_len, n - start) for start in range(0, n, max_model_len)]  # prompts <= max_model_len
        slots = n + len(sizes)  # "oracle" reserves prompt + 1 token each
        scratch = KVCacheTensors(self.kv_shape[0], slots, *self.kv_shape[1:], self.dtype, self.device)
        kv = ContiguousKVManager(slots, "oracle", max_model_len)
        batch = []
        for size in sizes:
            seq = Sequence("profile", [0] * size, SamplingParams(max_tokens=1))
            kv.allocate_slots(seq, size)
            batch.append(ScheduledSeq(seq, size))
        saved = self.kv, self.tensors, self.capacity, self.check_invariants
        self.kv, self.tensors, self.capacity, self.check_invariants = kv, scratch, slots, False
        try:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            ids, pos, ctx, rows, _ = self.prepare(batch)
            self.model(ids, pos, ctx, logits_indices=torch.arange(min(n, max_num_seqs), device=self.device))
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - scratch.keys.numel() * 2 * scratch.keys.element_size()
        finally:
            self.kv, self.tensors, self.capacity, self.check_invariants = saved
            del scratch
            torch.cuda.empty_cache()
        return peak


def available_host_bytes() -> int | None:
    """Memory the machine can still give this process (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _same_step_sharing(writes, cached, scheduled, readers) -> bool:
    """Whether every written slot that some sequence counts as cached is a prefix shared within this step:
    the writer writes the very token, at the very position, that the reader expects there (prefix caching
    hands a request the pages another one is prefilling now). That is sound because each layer writes all
    of the step's keys before any query reads them."""
    w_tok, w_pos = [], []
    for it in scheduled:
        start = it.seq.num_computed_tokens
        w_tok += it.seq.token_ids[start:start + it.num_tokens]
        w_pos += range(start, start + it.num_tokens)
    r_tok = [t for s in readers for t in s.token_ids[: s.num_computed_tokens]]
    r_pos = [p for s in readers for p in range(s.num_computed_tokens)]
    dev = writes.device
    w_tok, w_pos = torch.tensor(w_tok, device=dev), torch.tensor(w_pos, device=dev)
    r_tok, r_pos = torch.tensor(r_tok, device=dev), torch.tensor(r_pos, device=dev)
    hit = torch.isin(cached, writes)
    order = torch.argsort(writes)
    idx = order[torch.searchsorted(writes[order], cached[hit])]
    return bool(((w_tok[idx] == r_tok[hit]) & (w_pos[idx] == r_pos[hit])).all())
