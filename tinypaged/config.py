"""Engine configuration: vLLM's knob names, checked once at construction with messages that name the knob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEFAULT_KV_BYTES = 512 * 2**20  # on a CPU, like vLLM's CPU backend, the KV space is a fixed size
CPU_DEFAULT_MAX_MODEL_LEN = 2048  # a CPU-friendly cap on the model's own context (8192 for SmolLM2)


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # stage 1 / stage 2: how the KV cache is laid out
    kv_cache: str = "paged"  # "contiguous" (stage 1) or "paged" (stage 2+)
    reservation_policy: str = "max"  # stage 1 only: "max", "pow2" or "oracle"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_tokens: int | None = None  # capacity in tokens (either layout), handy in lessons
    # stage 3
    enable_prefix_caching: bool = False
    parallel_sampling: str = "fork"  # n > 1: "fork" (paper, vLLM v0: copy-on-write) or "fanout" (vLLM v1)
    # stage 4
    scheduler: str = "continuous"  # or "static"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    swap_space: float = 0.25  # GiB of CPU memory for swapped-out blocks (preemption_mode="swap")
    # stage 5
    attention_backend: Any = "torch"  # "torch", "triton", a paged decode function, or an AttentionBackend
    # plug-in points (tinypaged.interfaces): a learner's own pieces drive the engine
    kv_cache_manager: Any = None  # a factory(spec: KVCacheSpec) -> KVCacheManager; None: kv_cache's own
    scheduling_policy: Any = None  # a schedule_step-like function or a SchedulingPolicy; None: `scheduler`
    check_invariants: bool | None = None  # the costlier per-step checks; None: on when a plug-in is given
    history_size: int = 4096  # steps kept in LLMEngine.history (a bounded deque); 0 keeps none

    def __post_init__(self) -> None:
        self.verify()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def verify(self) -> None:
        def bad(msg):
            raise ValueError(msg)

        if self.dtype not in DTYPES:
            bad(f"dtype={self.dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            bad(f"device={self.device!r}: use 'auto', 'cpu' or 'cuda'")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            bad(f"device={self.device!r} but CUDA is not available; use device='cpu'")
        if self.kv_cache not in ("contiguous", "paged"):
            bad(f"kv_cache={self.kv_cache!r}: use 'contiguous' (stage 1) or 'paged' (stage 2)")
        if self.reservation_policy not in ("max", "pow2", "oracle"):
            bad(f"reservation_policy={self.reservation_policy!r}: use 'max', 'pow2' or 'oracle'")
        if self.block_size < 1:
            bad(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            bad(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.scheduler not in ("continuous", "static"):
            bad(f"scheduler={self.scheduler!r}: use 'continuous' or 'static'")
        if self.preemption_mode not in ("recompute", "swap"):
            bad(f"preemption_mode={self.preemption_mode!r}: use 'recompute' or 'swap'")
        if self.preemption_mode == "swap" and self.kv_cache != "paged":
            bad("preemption_mode='swap' moves blocks, so it needs kv_cache='paged'")
        if isinstance(self.attention_backend, str) and self.attention_backend not in ("torch", "triton"):
            bad(f"attention_backend={self.attention_backend!r}: use 'torch', 'triton', a paged decode function "
                f"or an AttentionBackend object")
        if self.attention_backend == "triton" and self.kv_cache != "paged":
            bad("attention_backend='triton' reads block tables, so it needs kv_cache='paged'")
        if self.parallel_sampling not in ("fork", "fanout"):
            bad(f"parallel_sampling={self.parallel_sampling!r}: use 'fork' (paper / vLLM v0) or 'fanout' (vLLM v1)")
        if isinstance(self.scheduling_policy, str):
            bad(f"scheduling_policy={self.scheduling_policy!r}: pass a function or policy object; choose the "
                f"built-in ones with scheduler='continuous' or 'static'")
        if self.history_size < 0:
            bad(f"history_size must be >= 0, got {self.history_size}")
        if self.enable_prefix_caching and self.kv_cache != "paged":
            bad("enable_prefix_caching shares blocks, so it needs kv_cache='paged'")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            bad(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs one token of the step budget. "
                f"Raise max_num_batched_tokens or lower max_num_seqs."
            )

    @property
    def has_plugins(self) -> bool:
        return (self.kv_cache_manager is not None or self.scheduling_policy is not None
                or not isinstance(self.attention_backend, str))

    def finalize(self, model_max_len: int) -> None:
        """Fill the defaults that depend on the model, then check the knobs that relate to it."""
        if self.max_model_len is None:
            self.max_model_len = min(model_max_len, CPU_DEFAULT_MAX_MODEL_LEN)
        elif self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} is longer than the model's context "
                f"({model_max_len} positions); lower max_model_len."
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(self.max_model_len, 2048, self.max_num_seqs) \
                if not self.enable_chunked_prefill or self.scheduler == "static" else max(2048, self.max_num_seqs)
        if (not self.enable_chunked_prefill or self.scheduler == "static") \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) and prompts cannot be split without chunked prefill: raise "
                f"max_num_batched_tokens, lower max_model_len, or set enable_chunked_prefill=True "
                f"(with scheduler='continuous')."
            )
