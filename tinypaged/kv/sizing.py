"""How big the KV cache is: vLLM's sizing knobs turned into whole blocks, in one place (stage 6).

vLLM v1 does this in ``v1/core/kv_cache_utils.py``: the bytes left for the KV cache become blocks
(``kv_blocks``), and the start-up log states the result as a *maximum concurrency*, how many requests of
``max_model_len`` tokens the blocks hold at once (``max_concurrency``). Those two functions are the
lesson's (stage 6's assignment). ``size_kv_cache`` resolves the knobs, the first one set deciding:

1. ``kv_cache_tokens`` (course-only): that many token slots;
2. ``num_gpu_blocks_override``: that many blocks of ``block_size``;
3. ``kv_cache_memory_bytes``: that many bytes;
4. else, on a GPU, what ``gpu_memory_utilization`` leaves after the profiling run (the caller measures it),
   and on a CPU ``CPU_DEFAULT_KV_BYTES`` (like vLLM's CPU backend, a fixed size).

The model runner sizes the real cache with it, and the serving simulator (``tinypaged.lab.simulator``),
which has no model and so no bytes per token, sizes its cache with it from the token knobs.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from tinypaged.config import CPU_DEFAULT_KV_BYTES


def kv_blocks(kv_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
              block_size: int) -> int:
    """How many blocks ``kv_bytes`` of KV memory hold: a token's keys and values in every layer take
    2 x layers x kv_heads x head_dim x bytes, a block holds ``block_size`` tokens, only whole blocks count."""
    bytes_per_block = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * block_size
    return kv_bytes // bytes_per_block


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """vLLM's "maximum concurrency for ``max_model_len`` tokens per request": a full-length request holds
    ceil(max_model_len / block_size) blocks (its last one may be part empty), and ``num_blocks`` holds that
    many blocks this many times. Its whole part is how many such requests run at once."""
    blocks_per_request = -(-max_model_len // block_size)
    return num_blocks / blocks_per_request


class KVLayout(NamedTuple):
    """What one token's keys and values take in a model: ``kv_blocks(kv_bytes, *layout, block_size)``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


class KVSize(NamedTuple):
    """The KV cache the knobs give: ``num_blocks`` blocks of ``block_size`` slots (1 for a contiguous cache);
    ``tokens``, the slots before rounding down to whole blocks; ``knob`` (``name=value``) and ``name``, the
    knob that decided it, for messages."""

    num_blocks: int
    block_size: int
    tokens: int
    knob: str
    name: str


def sizing_knob(c, on_gpu: bool) -> tuple[str, str]:
    """(the knob that sizes the KV cache as ``name=value``, its name), for error messages."""
    for knob in ("kv_cache_tokens", "num_gpu_blocks_override", "kv_cache_memory_bytes"):
        if getattr(c, knob) is not None:
            return f"{knob}={getattr(c, knob)}", knob
    if on_gpu:
        return f"gpu_memory_utilization={c.gpu_memory_utilization}", "gpu_memory_utilization"
    return f"the CPU default of {CPU_DEFAULT_KV_BYTES} bytes", "kv_cache_memory_bytes"


def size_kv_cache(c, layout: KVLayout | None = None, on_gpu: bool = False,
                  gpu_budget: Callable[[], int] | None = None) -> KVSize:
    """Resolve the sizing knobs of the finalized ``EngineConfig`` ``c`` to whole blocks (the module's list).
    ``layout`` is the model's (needed for a size in bytes); on a GPU with no knob set, ``gpu_budget()`` gives
    the bytes that profiling leaves. A cache of less than one block is refused, naming the knob."""
    knob, name = sizing_knob(c, on_gpu)
    block_size = c.block_size if c.kv_layout == "paged" else 1
    if c.kv_cache_tokens is not None or c.num_gpu_blocks_override is not None:
        tokens = c.kv_cache_tokens if c.kv_cache_tokens is not None else c.num_gpu_blocks_override * c.block_size
        num_blocks = tokens // block_size
    else:
        if layout is None:
            raise ValueError(f"{knob} sizes the KV cache in bytes, but without a model there are no bytes per "
                             f"token to divide by: give the size in tokens with kv_cache_tokens= "
                             f"(or num_gpu_blocks_override=)")
        if c.kv_cache_memory_bytes is not None:
            kv_bytes = c.kv_cache_memory_bytes
        elif on_gpu:
            kv_bytes = gpu_budget()
        else:
            kv_bytes = CPU_DEFAULT_KV_BYTES
        tokens = kv_blocks(kv_bytes, *layout, 1)
        num_blocks = kv_blocks(kv_bytes, *layout, block_size)
    if num_blocks < 1:
        per_block = f" ({layout.bytes_per_token * c.block_size} bytes)" if layout is not None else ""
        raise ValueError(f"{knob} gives a KV cache of {tokens} tokens, less than one block of block_size="
                         f"{c.block_size} tokens{per_block}: raise {name} or lower block_size")
    return KVSize(num_blocks, block_size, tokens, knob, name)
