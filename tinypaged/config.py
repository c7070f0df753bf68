"""Engine configuration: vLLM's knob names, checked once at construction with messages that name the knob."""

from __future__ import annotations

import inspect
import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from tinypaged.sampling_params import SEED_MAX, SEED_MIN

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEFAULT_KV_BYTES = 512 * 2**20  # on a CPU, like vLLM's CPU backend, the KV space is a fixed size
CPU_DEFAULT_MAX_MODEL_LEN = 2048  # a CPU-friendly cap on the model's own context (8192 for SmolLM2)
# One registry per seam: each built-in name and whose design it is. The knobs' checks, serve's flags and their
# help (entrypoints/cli_args.py) are made from these; the factories live in their own layers (kv/managers.py,
# sched/registry.py, attention/selector.py).
SCHEDULERS = {"static": "course-only: static batching, the pre-Orca baseline (stage 4)"}  # scheduler_cls
SCHEDULING_POLICIES = {  # scheduling_policy
    "fcfs": "vLLM v1 (the default): continuous batching, waiting requests in arrival order",
    "priority": "vLLM v1: by request priority (lower first), then arrival; the lowest priority is preempted first",
    "lpm": "SGLang: longest cached prefix first (stage 7)",
}
# scheduling_policy's earlier values in this course -> (the knob, the value) that says it now: passing one is a
# ValueError naming the new spelling (a plug-in given as scheduling_policy is refused the same way: scheduler_cls)
MOVED_POLICIES = {"static": ("scheduler_cls", "static"), "continuous": ("scheduling_policy", "fcfs")}
ATTENTION_BACKENDS = {  # attention_backend
    "torch": "course-only: the reference of lessons 2-3 (gather, then attend)",
    "sdpa": "torch's fused attention kernel (the fast path's default)",
    "triton": "stage 5's Triton kernels (paged decode, as vLLM's Triton backend)",
}
KV_MANAGERS = {  # kv_cache_manager
    "paged": "vLLM (paper 2023, v1): blocks, block tables, prefix caching",
    "contiguous": "course-only: one contiguous region per request (stage 1, before vLLM)",
    "radix": "SGLang: a radix tree of pages (stage 7)",
}
KV_LAYOUTS = ("paged", "contiguous")  # how the KV tensors are laid out (a radix manager's pages are paged)
# knobs that were merged into another: passing one is a TypeError naming its replacement
RENAMED = {"kv_cache": "kv_cache_manager", "scheduler": "scheduler_cls"}
# knobs that are gone, with what to do instead
REMOVED = {"fast_path": "the engine has one forward now (fused projections and oneDNN GEMMs always; C++ operators "
                        "where built); for the lessons' reference attention pass attention_backend='torch'"}

# The knobs that take one of a few strings.
CHOICES = {
    "dtype": tuple(DTYPES),
    "reservation_policy": ("max", "pow2", "oracle"),
    "parallel_sampling": ("fork", "fanout"),
    "preemption_mode": ("recompute", "swap"),
}
# The numeric knobs: knob -> (int or float, the allowed values as a test, the same in words).
# An int knob refuses floats and bools (TypeError); a float knob takes an int too, never a bool, nan or inf.
# numpy numbers are accepted and stored as Python ones.
NUMBERS = {
    "seed": (int, lambda v: SEED_MIN <= v <= SEED_MAX, "an integer in [-2**63, 2**64 - 1] (torch's seed range)"),
    "max_model_len": (int, lambda v: v >= 1, "an integer >= 1 (or None: the model's own, capped on a CPU)"),
    "block_size": (int, lambda v: v >= 1, "an integer >= 1 (tokens per block)"),
    "gpu_memory_utilization": (float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
    "kv_cache_memory_bytes": (int, lambda v: v >= 1, "an integer >= 1 (or None)"),
    "num_gpu_blocks_override": (int, lambda v: v >= 1, "an integer >= 1 (or None)"),
    "kv_cache_tokens": (int, lambda v: v >= 1, "an integer >= 1 (or None)"),
    "max_num_seqs": (int, lambda v: v >= 1, "an integer >= 1"),
    "max_num_batched_tokens": (int, lambda v: v >= 1, "an integer >= 1 (or None: the engine picks it)"),
    "swap_space": (float, lambda v: v >= 0.0, "a number of GiB >= 0"),
    "history_size": (int, lambda v: v >= 0, "an integer >= 0 (0 keeps no history)"),
}
OPTIONAL = {"max_model_len", "kv_cache_memory_bytes", "num_gpu_blocks_override", "kv_cache_tokens",
            "max_num_batched_tokens", "enable_chunked_prefill", "check_invariants"}
BOOLS = ("enable_prefix_caching", "enable_chunked_prefill", "check_invariants", "enforce_eager",
         "enable_kv_cache_events")


@dataclass
class EngineConfig:
    """The engine's knobs (vLLM's names). ``__post_init__`` checks every one and fills two defaults:

    * ``scheduling_policy`` None means ``"fcfs"`` (vLLM's default).
    * ``enable_chunked_prefill`` None means on where the scheduler can split prompts (every one but
      ``scheduler_cls="static"``), as vLLM v1 has it on by default; True together with ``"static"`` is an error.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # stage 1 / stage 2: who manages the KV cache, and so how its tensors are laid out: "paged" (stage 2+, the
    # built-in BlockManager), "contiguous" (stage 1's ContiguousKVManager), or a factory(spec: KVCacheSpec) ->
    # KVCacheManager (a plug-in, tinypaged.interfaces); a factory's layout is its ``layout`` attribute (or its
    # class's), "paged" when it has none. The one knob for the one decision (course-only: vLLM has no such knob).
    kv_cache_manager: Any = "paged"
    reservation_policy: str = "max"  # stage 1 only: "max", "pow2" or "oracle"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_tokens: int | None = None  # capacity in tokens (either layout), handy in lessons
    # stage 3
    enable_prefix_caching: bool = False
    # vLLM's name (its KVEventsConfig): the prefix cache records which blocks it stores and removes; the engine
    # drains them each step for a KV-event publisher (serve --kv-events-config). Needs enable_prefix_caching.
    enable_kv_cache_events: bool = False
    parallel_sampling: str = "fork"  # n > 1: "fork" (paper, vLLM v0: copy-on-write) or "fanout" (vLLM v1)
    # stage 4: scheduling_policy orders the requests, as vLLM's: "fcfs" (continuous batching in arrival order) or
    # "priority" (lower request priority first, ties by arrival; preemption takes the lowest priority), and "lpm"
    # (stage 7, SGLang), or (course-only) an order object (tinypaged.interfaces.WaitingOrder: stage 7's
    # CacheAwareOrder around a learner's order); None: "fcfs". The course's earlier values ("static", "continuous",
    # a plug-in) are refused, naming their spelling now (MOVED_POLICIES).
    scheduling_policy: Any = None
    # vLLM's name for a custom scheduler: "static" (stage 4's static batching), a Scheduler subclass (vLLM's
    # meaning), or a step to plug in: a schedule_step-like function or an object (or class) with plan(...); None:
    # the engine's continuous step. The order is scheduling_policy's, whichever steps run.
    scheduler_cls: Any = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None  # None: on, unless scheduler_cls="static"
    preemption_mode: str = "recompute"  # or "swap"
    swap_space: float = 0.25  # GiB of CPU memory for swapped-out blocks (preemption_mode="swap")
    # stage 5
    # "torch" (the reference of lessons 2-3: gather, then attend_gathered), "sdpa" (torch's fused attention
    # kernel), "triton" (stage 5's kernels), a paged decode function, or an AttentionBackend; None: "sdpa", or
    # "triton" where decode replays CUDA graphs (the name is filled in at construction, so the config says what runs)
    attention_backend: Any = None
    # vLLM's name. False: on a GPU, decode steps replay CUDA graphs captured at start for batch sizes
    # 1..max_num_seqs (tinypaged/worker/cuda_graphs.py; an unset attention_backend becomes "triton"). On a CPU the
    # forward runs eagerly either way (vLLM's CPU backend compiles its graph; here a compiled forward measured
    # slower than the eager one with the C++ operators: docs/RESULTS.md). vLLM v1 today: graphs by default
    # (enforce_eager=False); here True by default so lessons and tests start at once.
    enforce_eager: bool = True
    # plug-in points (tinypaged.interfaces): a learner's own pieces drive the engine
    check_invariants: bool | None = None  # the costlier per-step checks; None: on when a plug-in is given
    history_size: int = 4096  # steps kept in LLMEngine.history (a bounded deque); 0 keeps none

    def __post_init__(self) -> None:
        self.verify()

    @property
    def kv_layout(self) -> str:
        """How the KV tensors are laid out, "paged" or "contiguous": ``kv_cache_manager``'s name, or a factory's
        ``layout`` attribute (a bound ``from_spec``'s class's), "paged" when it declares none."""
        m = self.kv_cache_manager
        if isinstance(m, str):
            return "contiguous" if m == "contiguous" else "paged"
        for owner in (m, getattr(m, "__self__", None)):
            layout = getattr(owner, "layout", None)
            if layout in KV_LAYOUTS:
                return layout
        return "paged"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def verify(self) -> None:
        """Check every knob (types first, then ranges, then knobs that must agree; the module functions
        ``verify_types`` and ``verify_policy`` check one knob or seam each); fill the policy defaults."""
        verify_types(self)
        verify_policy(self)

        def bad(msg):
            raise ValueError(msg)

        if self.device.startswith("cuda") and not torch.cuda.is_available():
            bad(f"device={self.device!r} but CUDA is not available; use device='cpu'")
        if self.preemption_mode == "swap" and self.kv_layout != "paged":
            bad("preemption_mode='swap' moves blocks, so it needs a paged KV manager (kv_cache_manager='paged' or a paged factory)")
        if self.attention_backend is None:
            # enforce_eager=False on a GPU replays decode steps as CUDA graphs, which read block tables (triton)
            graphs = not self.enforce_eager and self.torch_device.type == "cuda" and self.kv_layout == "paged"
            self.attention_backend = "triton" if graphs else "sdpa"
        if isinstance(self.attention_backend, str) and self.attention_backend not in ATTENTION_BACKENDS:
            bad(f"attention_backend={self.attention_backend!r}: use 'torch', 'sdpa', 'triton', a paged decode "
                f"function or an AttentionBackend object")
        if self.attention_backend == "triton" and self.kv_layout != "paged":
            bad("attention_backend='triton' reads block tables, so it needs a paged KV manager (kv_cache_manager='paged' or a paged factory)")
        from tinypaged import triton_mode

        if self.attention_backend == "triton" and not triton_mode.AVAILABLE:
            bad(f"attention_backend='triton': {triton_mode.WHY_UNAVAILABLE}; use attention_backend='torch'")
        if self.enable_prefix_caching and self.kv_layout != "paged":
            bad("enable_prefix_caching shares blocks, so it needs a paged KV manager (kv_cache_manager='paged' or a paged factory)")
        if self.enable_kv_cache_events and not self.enable_prefix_caching:
            bad("enable_kv_cache_events reports the prefix cache's blocks: it needs enable_prefix_caching=True")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            bad(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs one token of the step budget. "
                f"Raise max_num_batched_tokens or lower max_num_seqs."
            )

    @property
    def has_plugins(self) -> bool:
        return (not isinstance(self.kv_cache_manager, str) or not isinstance(self.attention_backend, str)
                or not (self.scheduler_cls is None or isinstance(self.scheduler_cls, str))
                or not (self.scheduling_policy is None or isinstance(self.scheduling_policy, str)))

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
            self.max_num_batched_tokens = max(2048, self.max_num_seqs) if self.enable_chunked_prefill \
                else max(self.max_model_len, 2048, self.max_num_seqs)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) and prompts cannot be split without chunked prefill: raise "
                f"max_num_batched_tokens, lower max_model_len, or set enable_chunked_prefill=True "
                f"(not with scheduler_cls='static')."
            )


# -- the checks of EngineConfig.verify, one knob (or one seam) at a time ------------------------------------
def verify_types(config: EngineConfig) -> None:
    """Each knob on its own: a TypeError for the wrong kind of value, a ValueError for one out of range."""
    if isinstance(config.model, os.PathLike):
        config.model = os.fspath(config.model)
    if not isinstance(config.model, str) or not config.model:
        raise TypeError(f"model must be a model name ('smollm2-135m', 'tiny') or the path of a local folder, "
                        f"got {config.model!r}")
    if isinstance(config.device, torch.device):
        config.device = str(config.device)
    if not isinstance(config.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", config.device):
        error = ValueError if isinstance(config.device, str) else TypeError
        raise error(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {config.device!r}")
    for knob, choices in CHOICES.items():
        value = getattr(config, knob)
        if not isinstance(value, str) or value not in choices:
            error = ValueError if isinstance(value, str) else TypeError
            raise error(f"{knob}={value!r}: use one of {', '.join(map(repr, choices))}")
    for knob, (kind, allowed, words) in NUMBERS.items():
        value = getattr(config, knob)
        if value is None and knob in OPTIONAL:
            continue
        if not isinstance(value, numbers.Integral if kind is int else numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{knob} must be {words}, got {value!r}")
        try:
            number = kind(value)  # numpy numbers too (a sweep's values), kept as plain Python numbers
        except OverflowError:
            number = math.inf
        if (kind is float and not math.isfinite(number)) or not allowed(number):
            raise ValueError(f"{knob} must be {words}, got {value!r}")
        setattr(config, knob, number)
    for knob in BOOLS:
        value = getattr(config, knob)
        if not isinstance(value, bool) and not (value is None and knob in OPTIONAL):
            raise TypeError(f"{knob} must be True or False{' (or None: the default)' if knob in OPTIONAL else ''}"
                            f", got {value!r}")
    factory = config.kv_cache_manager
    if isinstance(factory, str):
        if factory not in KV_MANAGERS:
            raise ValueError(f"kv_cache_manager={factory!r}: use one of {', '.join(map(repr, KV_MANAGERS))}, "
                             f"or a factory called with one KVCacheSpec")
    elif not (callable(factory) and _accepts_arguments(factory, 1)):
        raise TypeError(f"kv_cache_manager must be 'paged', 'contiguous', 'radix' or a factory called with one "
                        f"KVCacheSpec (a function or a class whose __init__ takes the spec, e.g. BlockManager.from_spec), "
                        f"got {factory!r}")
    verify_backend_signature(config)

def verify_backend_signature(config: EngineConfig) -> None:
    """A decode function, or a backend object's methods, must take what the engine passes them."""
    backend = config.attention_backend
    if backend is None or isinstance(backend, (str, type)):
        return  # unset, a name (checked in verify), or a class built by the engine (its methods checked then)
    if hasattr(backend, "decode") or hasattr(backend, "write"):
        calls = {"decode": "decode(query, key_cache, value_cache, batch, scale)",
                 "write": "write(key_cache, value_cache, key, value, slot_mapping)"}
        for name, call in calls.items():
            method = getattr(backend, name, None)
            if callable(method) and not _accepts_arguments(method, 5):
                raise TypeError(f"attention_backend {type(backend).__name__}.{name} cannot be called as "
                                f"{call} (tinypaged.interfaces.AttentionBackend)")
    elif not callable(backend) or not _accepts_arguments(backend, 6):
        raise TypeError(f"attention_backend={backend!r} must be 'torch', 'sdpa', 'triton', an AttentionBackend object, "
                        f"or a paged decode function called as fn(query, k_cache, v_cache, block_tables, "
                        f"context_lens, scale) (paged_attention_decode's signature)")

def verify_policy(config: EngineConfig) -> None:
    """The two scheduling knobs, vLLM's: ``scheduling_policy`` the order, ``scheduler_cls`` the scheduler; then
    chunked prefill where that scheduler can split prompts."""
    p = config.scheduling_policy
    if p is None:
        p = config.scheduling_policy = "fcfs"
    if not ((isinstance(p, str) and p in SCHEDULING_POLICIES) or _is_order(p)):
        raise moved_policy_error(p)
    verify_scheduler_cls(config)
    static = isinstance(config.scheduler_cls, str)
    if config.enable_chunked_prefill is None:
        config.enable_chunked_prefill = not static
    elif config.enable_chunked_prefill and static:
        raise ValueError("enable_chunked_prefill=True contradicts scheduler_cls='static': a static batch "
                         "prefills each prompt whole. Drop enable_chunked_prefill (it defaults to off for "
                         "'static') or drop scheduler_cls (continuous batching, the default).")


def policy_names() -> str:
    """``scheduling_policy``'s names as an error lists them: 'fcfs', 'priority', 'lpm'."""
    return ", ".join(map(repr, SCHEDULING_POLICIES))


def _named(value) -> str:
    return getattr(value, "__name__", None) or f"{type(value).__name__}(...)"


def moved_policy_error(value) -> Exception:
    """The error for a ``scheduling_policy`` that is not one of its names: one of the course's earlier values
    (``MOVED_POLICIES``, or a plug-in: now ``scheduler_cls``) names its spelling now; anything else, the names."""
    why = (f"(as in vLLM, scheduling_policy orders the requests: {policy_names()}; scheduler_cls is the "
           f"scheduler: 'static' or your own)")
    if isinstance(value, str):
        if value in MOVED_POLICIES:
            knob, new = MOVED_POLICIES[value]
            default = ", the default," if knob == "scheduling_policy" and new == "fcfs" else ""
            return ValueError(f"scheduling_policy={value!r} is now {knob}={new!r}{default} {why}")
        return ValueError(f"scheduling_policy={value!r}: use {policy_names()}; a scheduler of your own is "
                          f"scheduler_cls=...")
    if callable(value) or _is_step(value):
        return ValueError(f"scheduling_policy={_named(value)} is now scheduler_cls={_named(value)} {why}")
    return TypeError(f"scheduling_policy must be {policy_names()} (or None: 'fcfs'), or an order object with "
                     f"waiting_order(scheduler) and rank_running(requests), got {value!r}; a scheduler of your own "
                     f"is scheduler_cls=...")


SCHEDULER_FORMS = ("a schedule_step-like function (running, waiting, budget, max_num_seqs, kv), an object (or class) "
                   "with plan(running, waiting, budget, max_num_seqs, kv), or a Scheduler subclass")


def verify_scheduler_cls(config: EngineConfig) -> None:
    """``scheduler_cls``: None, "static", a step (function, or object or class with ``plan``) or a ``Scheduler``
    subclass; with "static", only the fcfs order."""
    cls, p = config.scheduler_cls, config.scheduling_policy
    if cls is None:
        return
    names = ", ".join(map(repr, SCHEDULERS))
    if isinstance(cls, str):
        if cls not in SCHEDULERS:
            raise ValueError(f"scheduler_cls={cls!r}: use {names}, {SCHEDULER_FORMS}")
    elif _is_order(cls) and not _is_step(cls):
        raise ValueError(f"scheduler_cls={_named(cls)} is an order of the requests: it is now "
                         f"scheduling_policy={_named(cls)} (as in vLLM, scheduling_policy orders the requests, "
                         f"scheduler_cls is the scheduler)")
    elif isinstance(cls, type) and not (_is_step(cls) or _is_scheduler_class(cls)):
        raise TypeError(f"scheduler_cls={cls.__name__} is a class without a plan(running, waiting, budget, "
                        f"max_num_seqs, kv) method, and not a Scheduler subclass")
    elif not isinstance(cls, type) and not _is_step(cls) and not (callable(cls) and _accepts_arguments(cls, 5)):
        acts = " (a scheduler that acts on the queues itself is a Scheduler subclass overriding form_step)" \
            if callable(getattr(cls, "schedule", None)) else ""
        raise TypeError(f"scheduler_cls must be {names}, {SCHEDULER_FORMS}; got {cls!r}{acts}")
    if cls == "static" and p != "fcfs":
        raise ValueError(f"scheduling_policy={_shown(p)} orders the requests a "
                         f"step function plans over: scheduler_cls='static' admits in arrival order; use "
                         f"scheduling_policy='fcfs' with it, or a schedule_step-like scheduler_cls")


def _shown(p) -> str:
    return repr(p) if isinstance(p, str) else _named(p)


def _is_step(p) -> bool:
    """A step to plug in (object or class): one with ``plan(running, waiting, budget, max_num_seqs, kv)``."""
    return callable(getattr(p, "plan", None))


def _is_order(p) -> bool:
    """An order object (``tinypaged.interfaces.WaitingOrder``)."""
    return not isinstance(p, type) and callable(getattr(p, "waiting_order", None)) \
        and callable(getattr(p, "rank_running", None))


def _is_scheduler_class(cls) -> bool:
    """A ``Scheduler`` subclass (read by its methods: this layer does not import the scheduler)."""
    return callable(getattr(cls, "form_step", None)) and callable(getattr(cls, "schedule", None))



def _accepts_arguments(fn, n: int) -> bool:
    """Whether ``fn`` can be called with ``n`` positional arguments (``object`` takes none); True where
    Python cannot tell (some built-ins have no signature)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*[None] * n)
    except TypeError:
        return False
    return True
