"""The engine's seams, written down: a KV cache manager, a scheduling policy and its order, an attention backend.

Each is a ``typing.Protocol``: any object with these methods plugs in, so a learner's allocator,
scheduler or kernel can drive the real engine (``LLM(kv_cache_manager=..., scheduler_cls=...,
scheduling_policy=..., attention_backend=...)``). The engine checks the required methods when it is built
(``require``) and checks the rules below while it runs (``tinypaged.sched.scheduler.check_schedule`` and
``ModelRunner.check_slots``), so a broken plug-in fails loudly with the rule it broke instead of
producing wrong text later.

Who owns what (as in vLLM v1):

* the **KV cache manager** owns placement: block tables, reference counts, the prefix-cache index
  (or, for the contiguous stage, one region per sequence). Nobody else writes them.
* the **scheduler** owns request progress: the queues, ``num_computed_tokens``, appending sampled
  tokens, finishing and freeing (``Scheduler.update_from_output``).
* the **model runner** owns the device: the KV tensors, memory profiling, the forward pass.
* the **sampler** owns token choice and stop checks (``tinypaged.sampling.sampler``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable


@dataclass(frozen=True)
class KVCacheSpec:
    """What a KV cache manager is built from (the engine sizes the cache, then calls ``factory(spec)``)."""

    num_blocks: int  # paged: blocks in the pool; contiguous: capacity in tokens (blocks of 1 token)
    block_size: int
    max_model_len: int
    enable_prefix_caching: bool = False
    reservation_policy: str = "max"  # contiguous only
    num_cpu_blocks: int = 0  # swap space (preemption_mode="swap", vLLM v0)
    copy_block: Callable[[int, int], None] | None = None  # watches each copy-on-write copy as it is decided (src, dst)
    enable_kv_cache_events: bool = False  # record the prefix cache's changes (take_events), vLLM's knob

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


@runtime_checkable
class KVCacheManager(Protocol):
    """Decides where every sequence's keys and values live. It never touches KV data itself.

    Contract:

    * ``allocate_slots(seq, num_new_tokens, computed_blocks=())`` makes room for positions
      ``seq.num_computed_tokens + len(computed_blocks) * block_size`` up to ``+ num_new_tokens``
      and returns True, or returns False and changes nothing. It never changes ``seq``.
    * ``slot_mapping(seq, start, end)`` gives the slot of each position in ``[start, end)``; every
      slot is in ``[0, capacity_tokens)``. A slot a sequence has written stays its own (or shared
      read-only) until ``free(seq)``: no step may write a slot that another sequence has cached.
    * ``free(seq)`` releases everything ``seq`` holds; freeing twice is harmless.
    * ``usage`` is the fraction of the cache in use, computed in O(1) (vLLM: 1 - free / total).
    * ``get_computed_blocks(seq)`` returns the cached blocks holding the start of ``seq``'s tokens
      (prefix caching; ``[]`` when off). Never more than ``len(seq) - 1`` tokens' worth.
    * ``max_tokens_needed(seq)`` is the most the manager may ever hold for ``seq`` (used to reject a
      request that can never fit); ``capacity_tokens`` and ``block_size`` describe the cache.

    Optional: ``block_ids(seq)`` (paged managers; needed by block-table attention backends),
    ``fork(parent, child)`` (n > 1 with ``parallel_sampling="fork"``, beam search),
    ``context_slots(seqs, context_len)`` (a faster batched ``slot_mapping``), ``stats()``.
    """

    block_size: int
    capacity_tokens: int

    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks=()) -> bool: ...
    def slot_mapping(self, seq, start: int, end: int) -> list[int]: ...
    def free(self, seq) -> None: ...
    def get_computed_blocks(self, seq) -> list: ...
    def max_tokens_needed(self, seq) -> int: ...

    @property
    def usage(self) -> float: ...


@runtime_checkable
class SchedulingPolicy(Protocol):
    """Decides the next step's batch, and nothing else: ``plan(running, waiting, budget, max_num_seqs, kv)``
    (``scheduler_cls``; ``tinypaged.sched.policies.PlanPolicy`` wraps a plain function shaped like
    ``schedule_step``). It gets the scheduler's requests (``request_id``, ``num_new_tokens``, ``num_seqs``), running
    ones first in the order's ranking, and a ``kv`` with ``allocate(req, n) -> bool`` and ``free(req)``
    (the scheduler's plan adapter, ``tinypaged.sched.step_adapter.StepKV``, acting on the real cache); it returns a
    plan whose ``scheduled`` lists ``(request, num_tokens)`` and ``preempted`` the requests, both as the objects it
    was given (ids are refused: the n samples of one request share an id). It is never handed the scheduler.

    The engine then checks (``check_schedule``): each scheduled sequence is running and appears once; it gets
    between 1 and its uncomputed tokens; the step's tokens fit ``max_num_batched_tokens``; no more than
    ``max_num_seqs`` sequences run. A scheduler that forms steps another way is a ``Scheduler`` subclass
    overriding ``form_step`` (static batching: ``tinypaged.sched.static.StaticScheduler``).
    """

    def plan(self, running, waiting, budget: int, max_num_seqs: int, kv): ...


@runtime_checkable
class WaitingOrder(Protocol):
    """The order ``scheduling_policy`` names (fcfs, priority, lpm; ``tinypaged.sched.policies.FcfsOrder``,
    ``PriorityOrder``, ``tinypaged.sched.radix_policy.CacheAwareOrder``): ``waiting_order(scheduler)`` returns the
    waiting sequences in the order the step reads them (the arrived ones ranked, those still to arrive after them;
    it reads the scheduler and changes nothing); ``rank_running(requests)`` returns the running requests in the
    order they take the budget (the last is the step's first victim)."""

    def waiting_order(self, scheduler): ...
    def rank_running(self, running: list) -> list: ...


@runtime_checkable
class AttentionBackend(Protocol):
    """Writes this step's keys and values into the cache and attends for decode queries.

    * ``write(key_cache, value_cache, key, value, slot_mapping)``: one layer; caches are
      ``[num_slots, kv_heads, head_dim]``; slot -1 is padding and skipped.
    * ``decode(query, key_cache, value_cache, ctx) -> out``: one query per sequence,
      ``query [B, heads, head_dim]``; ``ctx`` holds ``block_tables`` ``[B, max_blocks]`` (int32),
      ``context_slots`` ``[B, max_len]``, ``context_lens`` ``[B]``, ``block_size`` and ``scale``.
    * ``uses_block_tables``: True if ``decode`` reads ``ctx.block_tables`` (paged caches only).

    Prefill chunks use the reference attention (``attention.attend_gathered``), unless the backend has
    an optional ``prefill(query, keys, values, first_pos, scale)`` (the fast path's ``SDPABackend``).
    """

    name: str
    uses_block_tables: bool

    def write(self, key_cache, value_cache, key, value, slot_mapping) -> None: ...
    def decode(self, query, key_cache, value_cache, ctx): ...


KV_REQUIRED = ("allocate_slots", "slot_mapping", "free", "get_computed_blocks", "max_tokens_needed", "usage",
               "block_size", "capacity_tokens")
POLICY_REQUIRED = ("plan",)
ORDER_REQUIRED = ("waiting_order", "rank_running")
BACKEND_REQUIRED = ("write", "decode", "uses_block_tables")


def require(obj, names, what: str) -> None:
    """Fail at construction, naming every missing method, instead of deep inside a step."""
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise TypeError(f"{what} {type(obj).__name__} lacks required member(s) {', '.join(missing)} "
                        f"(see tinypaged.interfaces for the contract)")


class InvariantError(AssertionError):
    """A plug-in (or the engine) broke one of the rules above; the message names the rule."""
