"""Serving checks: the learner's pieces, plugged into tinypaged's engine, serve SmolLM2; the greedy tokens must
be transformers' tokens for the same prompts.

The implementation under test is a dict of ``LLM`` keyword arguments (the engine's plug-in points:
``kv_cache_manager=``, ``scheduler_cls=``, ``scheduling_policy=``, ``attention_backend=``) built by a given cell of the
notebook from the learner's classes and functions. The expected tokens come from
``transformers``' ``generate`` on the same weights (``hf_greedy``), computed in whichever process judges,
so the grader never takes the kernel's word for them. A check may also assert facts about the run that
show the stage's mechanism was exercised (prefix-cache hits, preemptions, ...): those steps expect ``True``.
"""

from __future__ import annotations

import functools
import inspect
import os
import types

from tinypaged.course.checks import Case, register
from tinypaged.sched.static import StaticScheduler

MODEL = "smollm2-135m"
CALLED = "the engine called every plug-in of your notebook"
PROBE_ENV = "TINYPAGED_PROBE"  # set in the grader's checks' process, which prints nothing for the learner


def _owner_module(value) -> str:
    owner = value if isinstance(value, (type, types.FunctionType, types.MethodType)) else type(value)
    return getattr(owner, "__module__", "") or ""


def check_plugins(impl, adapters: tuple[str, ...] = ()) -> None:
    """The plug-ins must be the notebook's own: an empty dict (the engine would fall back to its own parts)
    or a plug-in defined in the package earns nothing. ``adapters``: keys whose plug-in is the package's
    seam around the learner's pieces (stage 7: ``RadixKVManager`` around their tree, ``CacheAwareOrder``
    around their order); they must be present, and the check's preflight proves the pieces inside are theirs."""
    if not isinstance(impl, dict):
        raise TypeError("pass the engine's plug-ins as a dict of LLM keyword arguments")
    if not impl:
        raise ValueError("plugins names no plug-in: the engine would serve with its own parts, not yours")
    missing = [key for key in adapters if key not in impl]
    if missing:
        raise ValueError(f"plugins needs {', '.join(missing)} (the given cell builds it around your code)")
    for key, value in impl.items():
        if key in adapters:
            continue
        mod = _owner_module(value)
        if mod.startswith("tinypaged"):
            raise ValueError(f"plug-in {key} is the package's own ({mod}.{getattr(value, '__qualname__', '')}), "
                             "not built in your notebook")


class _Counted:
    """``obj`` as the engine sees it in a serving check: each call to one of its public methods (a function its
    class defines) adds one to ``counts[key]``; every other attribute, read or written, is ``obj``'s own. ``obj``
    itself is left as it is (composition)."""

    def __init__(self, obj, key: str, counts: dict):
        object.__setattr__(self, "_counted", (obj, key, counts))

    def __getattr__(self, name):
        obj, key, counts = self._counted
        value = getattr(obj, name)
        if name.startswith("_") or not isinstance(inspect.getattr_static(type(obj), name, None), types.FunctionType):
            return value

        @functools.wraps(value)
        def call(*a, **k):
            counts[key] += 1
            return value(*a, **k)

        return call

    def __setattr__(self, name, value):
        setattr(self._counted[0], name, value)

    def __repr__(self):
        return repr(self._counted[0])


def _counting(obj, key: str, counts: dict):
    """``obj`` (an instance) counting the calls to its public methods into ``counts[key]``: a ``_Counted`` under
    the name of ``obj``'s class, so the engine's messages name the learner's class as before."""
    cls = type(obj)
    named = type(cls.__name__, (_Counted,), {"__qualname__": cls.__qualname__})
    return named(obj, key, counts)


def counted_plugins(impl: dict) -> tuple[dict, dict]:
    """The same plug-ins, each counting the calls the engine makes into it: (plug-ins, counts)."""
    counts = {key: 0 for key in impl}
    out = {}
    for key, value in impl.items():
        if isinstance(value, type) and key == "kv_cache_manager":
            out[key] = lambda spec, _c=value, _k=key: _counting(_c(spec), _k, counts)
        elif isinstance(value, type) and not hasattr(value, "form_step"):  # a Scheduler subclass stays a class
            out[key] = _counting(value(), key, counts)
        elif isinstance(value, types.FunctionType) and not (hasattr(value, "decode") or hasattr(value, "write")):
            @functools.wraps(value)
            def fn(*a, _f=value, _k=key, **k):
                counts[_k] += 1
                return _f(*a, **k)

            out[key] = fn
        elif any(hasattr(value, m) for m in ("decode", "write", "plan", "waiting_order")):
            out[key] = _counting(value, key, counts)  # an attention backend, a writer, a step, an order
        else:
            out[key] = value
    return out, counts


def show_payoff(prompts, outs, max_tokens: int, counts: dict) -> None:
    """What the learner sees under the serving cell: their engine's text beside transformers', and how
    many calls went through their code."""
    from tinypaged.model.loader import load_tokenizer

    tok = load_tokenizer(MODEL)
    want = hf_greedy(tuple(prompts), max_tokens)
    for p, o, ref in zip(prompts, outs, want):
        mine = list(o.outputs[0].token_ids)
        same = "same tokens" if mine == list(ref) else "DIFFERENT tokens"
        print(f"{p!r}\n  your engine : {tok.decode(mine)!r}\n  transformers: {tok.decode(list(ref))!r}  ({same})")
    print("calls through your code: " + ", ".join(f"{k} {n}" for k, n in counts.items()))


@functools.lru_cache(maxsize=None)
def _hf_model():
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from tinypaged.model.loader import load_tokenizer, smollm2_folder

    transformers.utils.logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: run every step, suppress nothing
    return hf, load_tokenizer(MODEL)


@functools.lru_cache(maxsize=None)
def hf_greedy(prompts: tuple[str, ...], max_tokens: int) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy continuation of each prompt (all ``max_tokens`` steps: EOS does not stop it)."""
    import torch

    hf, tok = _hf_model()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p).input_ids
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            out.append(tuple(gen[0, len(ids):].tolist()))
    return tuple(out)


class OneAtATime(StaticScheduler):
    """Course-only scheduling for the serving checks of stages 1-3 (``engine_kwargs``): static batching with batches
    of one request, admitted in arrival order. Both built-in policies run stage 4's graded ``schedule_step`` (static
    batching for its admission), which the grader's edition of an earlier stage stubs; this one does not. Greedy
    tokens do not depend on the schedule, so transformers' tokens remain the expectation."""

    def form_batch(self) -> None:
        if self.waiting and self.arrived(self.waiting[0]):
            self.admit(self.waiting[0])
        self.batch_size = len(self.running)


def serving_check(stage: str, name: str, prompts: tuple[str, ...], max_tokens: int, engine_kwargs: dict,
                  preflight=None, facts=(), uses: tuple[str, ...] = (), forbidden=None, points: int = 2,
                  adapters: tuple[str, ...] = ()):
    """Register check ``name``: ``LLM(MODEL, **engine_kwargs, **impl)`` must reproduce transformers' greedy
    tokens for ``prompts``.

    ``preflight(impl)`` runs first and cheaply (an unfinished piece raises NotImplementedError before the
    model loads). ``facts`` are ``(description, fn(llm, outputs) -> bool)`` pairs that must hold.
    ``adapters``: plug-in keys that may be the package's seams (see :func:`check_plugins`); the preflight
    must then refuse them unless the learner's pieces are inside.
    """
    if adapters and preflight is None:
        raise ValueError(f"serving check {name}: adapters {adapters} need a preflight that checks what is inside")
    label = f"SmolLM2, {len(prompts)} prompt(s) x {max_tokens} greedy tokens"

    def run(impl, t):
        from tinypaged import LLM, SamplingParams

        check_plugins(impl, adapters)
        if preflight is not None:
            preflight(impl)
        plugins, counts = counted_plugins(impl)
        llm = LLM(MODEL, **engine_kwargs, **plugins)
        outs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        for p, o in zip(prompts, outs):
            t(f"greedy tokens for {p!r}", list(o.outputs[0].token_ids))
        for desc, fact in facts:
            t(desc, bool(fact(llm, outs)))
        t(CALLED, all(n > 0 for n in counts.values()))
        if os.environ.get(PROBE_ENV) != "1":
            show_payoff(prompts, outs, max_tokens, counts)

    def expected(hidden):
        tokens = hf_greedy(tuple(prompts), max_tokens)
        steps = [[f"greedy tokens for {p!r}", list(tk)] for p, tk in zip(prompts, tokens)]
        steps += [[desc, True] for desc, _ in facts]
        steps.append([CALLED, True])
        return [{"steps": steps}]

    def cases(hidden):
        return [Case(label, run, "your pieces changed what the model computes: run the checks above first")]

    def stage_references():  # everything the stage's other checks forbid: the engine must run the learner's pieces
        from tinypaged.course.checks import checks_for_stage

        return [o for c in checks_for_stage(stage) if c.expected is None for o in c.forbidden_objects()]

    cases.__name__ = f"cases_{name}"
    register(stage, name, points=points, expected=expected, trace=False, uses=uses, name=name,
             forbidden=forbidden or stage_references)(cases)
