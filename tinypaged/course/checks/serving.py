"""Serving checks: the learner's pieces, plugged into tinypaged's engine, serve SmolLM2; the greedy tokens must
be transformers' tokens for the same prompts.

The implementation under test is a dict of ``LLM`` keyword arguments (the engine's plug-in points:
``kv_cache_manager=``, ``scheduling_policy=``, ``attention_backend=``) built by a given cell of the
notebook from the learner's classes and functions. The expected tokens come from
``transformers``' ``generate`` on the same weights (``hf_greedy``), computed in whichever process judges,
so the grader never takes the kernel's word for them. A check may also assert facts about the run that
show the stage's mechanism was exercised (prefix-cache hits, preemptions, ...): those steps expect ``True``.
"""

from __future__ import annotations

import functools

from tinypaged.course.checks import Case, register

MODEL = "smollm2-135m"


@functools.lru_cache(maxsize=None)
def _hf_model():
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from tinypaged.model_loader import load_tokenizer, smollm2_folder

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


def serving_check(stage: str, name: str, prompts: tuple[str, ...], max_tokens: int, engine_kwargs: dict,
                  preflight=None, facts=(), uses: tuple[str, ...] = (), forbidden=None, points: int = 2):
    """Register check ``name``: ``LLM(MODEL, **engine_kwargs, **impl)`` must reproduce transformers' greedy
    tokens for ``prompts``.

    ``preflight(impl)`` runs first and cheaply (an unfinished piece raises NotImplementedError before the
    model loads). ``facts`` are ``(description, fn(llm, outputs) -> bool)`` pairs that must hold.
    """
    label = f"SmolLM2, {len(prompts)} prompt(s) x {max_tokens} greedy tokens"

    def run(impl, t):
        from tinypaged import LLM, SamplingParams

        if not isinstance(impl, dict):
            raise TypeError("pass the engine's plug-ins as a dict of LLM keyword arguments")
        if preflight is not None:
            preflight(impl)
        llm = LLM(MODEL, **engine_kwargs, **impl)
        outs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        for p, o in zip(prompts, outs):
            t(f"greedy tokens for {p!r}", list(o.outputs[0].token_ids))
        for desc, fact in facts:
            t(desc, bool(fact(llm, outs)))

    def expected(hidden):
        tokens = hf_greedy(tuple(prompts), max_tokens)
        steps = [[f"greedy tokens for {p!r}", list(tk)] for p, tk in zip(prompts, tokens)]
        steps += [[desc, True] for desc, _ in facts]
        return [{"steps": steps}]

    def cases(hidden):
        return [Case(label, run, "your pieces changed what the model computes: run the checks above first")]

    def stage_references():  # everything the stage's other checks forbid: the engine must run the learner's pieces
        from tinypaged.course.checks import checks_for_stage

        return [o for c in checks_for_stage(stage) if c.expected is None for o in c.forbidden_objects()]

    cases.__name__ = f"cases_{name}"
    register(stage, name, points=points, expected=expected, trace=False, uses=uses, name=name,
             forbidden=forbidden or stage_references)(cases)
