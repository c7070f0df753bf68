"""Stage 3: beam search on the paged KV cache. Beams share blocks by fork and copy-on-write.

This is the paper's mechanism (section 4.4, and vLLM v0's): beams are sequences of one request that
fork and share blocks by reference count. vLLM v1 instead runs ``LLM.beam_search`` outside the engine,
as repeated one-token ``generate`` calls whose beams share blocks through the prefix cache.

Each beam is a running ``Sequence`` in the engine's scheduler. One ``engine.step``:

1. the scheduler gives every live beam room for its next token (a beam whose last block is still
   shared with a sibling gets a private copy first: copy-on-write in ``allocate_slots``);
2. one forward over all beams of all prompts, then, instead of sampling, ``select_tokens`` here:
   log-softmax, and per prompt the best ``K`` (beam, token) candidates by cumulative log-probability;
3. the chosen parents are forked through the scheduler (a parent chosen ``m`` times becomes ``m``
   beams sharing its blocks), the beams nobody chose are finished and freed, and each beam's
   token is appended by the scheduler (``Scheduler.append_tokens``): progress has one owner.

Selection follows Hugging Face's ``generate(num_beams=W, do_sample=False)`` (transformers 5), so the
tests can use it as the oracle:

* ``K = max(2, 1 + number of EOS ids) * W`` candidates; the best ``W`` that do not stop run on;
* a candidate ending in EOS, or reaching ``max_tokens``, becomes a finished hypothesis, but only
  if it ranks among the top ``W`` candidates; its score is
  ``cum_logprob / generated_len ** length_penalty`` (the EOS token counts in the length);
* the ``W`` best finished hypotheses are kept; a prompt stops when its best running beam can no
  longer beat the worst of them (``early_stopping=False``, HF's default), when ``W`` are finished
  (``early_stopping=True``), or at ``max_tokens``.

vLLM's ``LLM.beam_search`` differs in small ways (it always runs ``max_tokens`` steps, keeps every
EOS candidate, and its length penalty divides by the whole length including the prompt). Without
EOS among the candidates (``ignore_eos=True``, or a model that never ranks EOS high) the two agree,
and width 1 is greedy decoding.

Results are vLLM-shaped: one ``BeamSearchOutput`` per prompt whose ``sequences`` (best first)
carry ``tokens`` (prompt + generated, as vLLM), ``text``, ``cum_logprob`` and ``score``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tinypaged.sampling_params import BeamSearchParams, SamplingParams
from tinypaged.sequence import FinishReason, Sequence


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated tokens (vLLM's convention)
    num_prompt_tokens: int
    cum_logprob: float
    score: float  # cum_logprob / len(output_token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"
    text: str = ""  # decoded prompt + output, as vLLM

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # beam_width hypotheses, best score first


@dataclass
class _PromptState:
    """The beams of one prompt: running ones (Sequences holding blocks) and finished hypotheses."""

    seq: Sequence  # the prompt's first sequence (beam 0)
    beams: list[Sequence] = field(default_factory=list)
    scores: torch.Tensor | None = None  # float32 cumulative log-probs of ``beams``, best first
    finished: list[tuple] = field(default_factory=list)  # (score tensor, tokens, cum_logprob, reason)
    improvable: bool = True  # HF's early-stop heuristic: can a running beam still beat the finished?
    done: bool = False


def beam_search(engine, prompts, params: BeamSearchParams, early_stopping: bool | str = False,
                stats: dict | None = None, on_step=None) -> list[BeamSearchOutput]:
    """Beam search over ``prompts`` (strings or {"prompt_token_ids": ...}); one output per prompt.

    ``stats`` (a dict, optional) receives block accounting per step: blocks used with sharing
    (the pool) and without (each beam owning all its blocks), plus copy-on-write copies.
    ``on_step(list of each prompt's live beams)`` is called after every step's allocation.
    Every block is freed before returning, also on error. Every prompt is checked before any is
    queued, so a bad one leaves the engine as it was.
    """
    kv, sched = engine.kv, engine.scheduler
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"beam_search takes a BeamSearchParams (beam_width, max_tokens, ignore_eos, "
                        f"length_penalty), as vLLM's LLM.beam_search does; got {type(params).__name__}")
    params = params.clone()  # checked again: a field may have been changed since construction
    if not hasattr(kv, "fork"):
        raise NotImplementedError("beam search shares KV blocks between beams: use kv_cache_manager='paged'")
    if engine.has_unfinished_requests():
        raise RuntimeError("beam_search runs on an idle engine: finish the queued requests first")
    prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    if len(prompts) * params.beam_width > engine.config.max_num_seqs:
        raise ValueError(f"{len(prompts)} prompts x beam_width {params.beam_width} beams exceed max_num_seqs="
                         f"{engine.config.max_num_seqs}")
    sp = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
    seqs = [engine.make_request(f"beam-{i}", prompt, sp).seqs[0] for i, prompt in enumerate(prompts)]
    states = []
    for seq in seqs:  # all valid: now queue them
        sched.add(seq)  # scheduled like any request (prefix-cache hits included); beam 0
        states.append(_PromptState(seq, beams=[seq], scores=torch.zeros(1, dtype=torch.float32)))
    eos = set() if params.ignore_eos else set(engine.eos_token_ids)
    record = stats if stats is not None else {}
    record.update(steps=[], cow_copies=0)
    cow0 = kv.num_cow_copies
    max_len = engine.config.max_model_len

    def select_tokens(sampling, logits):
        live = [b for st in states if not st.done for b in st.beams]
        used = kv.num_blocks - kv.num_free_blocks
        unshared = sum(len(kv.block_ids(b)) for b in live)  # as if every beam owned its blocks
        record["steps"].append({"blocks_used": used, "blocks_unshared": unshared, "num_beams": len(live)})
        if on_step is not None:
            on_step([list(st.beams) for st in states if not st.done])
        # float32 log-softmax, as transformers does, so rankings agree bit for bit
        logprobs = torch.log_softmax(logits.to(device="cpu", dtype=torch.float32), dim=-1)
        row_of = {s.seq_id: r for r, s in enumerate(sampling)}
        for st in states:
            if not st.done and all(b.seq_id in row_of for b in st.beams):
                rows = logprobs[[row_of[b.seq_id] for b in st.beams]]
                _advance(sched, st, rows, params, eos, early_stopping, max_len)

    try:
        for step in engine.run_until_done(until=lambda: all(st.done for st in states), select_tokens=select_tokens):
            if step.preempted:
                raise RuntimeError(
                    f"beam search ran out of KV blocks ({kv.num_blocks} in all): lower beam_width or max_tokens, "
                    f"or give the cache more blocks (num_gpu_blocks_override)")
    finally:
        sched.abort([b for st in states for b in st.beams + [st.seq]])
        record["cow_copies"] = kv.num_cow_copies - cow0
        steps = record["steps"]
        record["peak_blocks_used"] = max((s["blocks_used"] for s in steps), default=0)
        record["peak_blocks_unshared"] = max((s["blocks_unshared"] for s in steps), default=0)
        record["block_steps_used"] = sum(s["blocks_used"] for s in steps)
        record["block_steps_unshared"] = sum(s["blocks_unshared"] for s in steps)
    tok = engine.tokenizer
    outputs = []
    for st in states:
        hyps = []
        for score, tokens, cum, reason in sorted(st.finished, key=lambda h: -float(h[0])):
            hyps.append(BeamSearchSequence(tokens, len(st.seq.prompt_token_ids), cum, float(score), reason,
                                           tok.decode(tokens)))
        outputs.append(BeamSearchOutput(hyps))
    return outputs


def _advance(sched, st: _PromptState, logprobs: torch.Tensor, params: BeamSearchParams, eos: set,
             early_stopping, max_model_len: int) -> None:
    """One beam step for one prompt: rank candidates, update finished hypotheses, fork and free."""
    width, lp = params.beam_width, params.length_penalty
    vocab = logprobs.shape[1]
    k = min(max(2, 1 + len(eos)) * width, logprobs.numel())
    acc = (logprobs + st.scores[:, None]).reshape(-1)
    top_vals, top_idx = torch.topk(acc, k)
    gen_len = len(st.beams[0].output_token_ids) + 1  # after this step's token
    at_max = gen_len >= params.max_tokens or len(st.beams[0]) + 1 >= max_model_len
    cands = []
    for r in range(k):
        parent, token = divmod(int(top_idx[r]), vocab)
        stops = at_max or token in eos
        cands.append((parent, token, top_vals[r], stops))
    # Finished hypotheses: only candidates ranked in the top `width` may finish (HF).
    full = early_stopping is True and len(st.finished) == width
    if st.improvable and not full:
        new = []
        for parent, token, val, stops in cands[:width]:
            if stops:
                tokens = st.beams[parent].token_ids + [token]
                reason = FinishReason.LENGTH if token not in eos else FinishReason.STOP
                new.append((val / (gen_len ** lp), tokens, float(val), reason))
        if new:
            merged = sorted(st.finished + new, key=lambda h: -float(h[0]))  # stable: older first on ties
            st.finished = merged[:width]
    running = [c for c in cands if not c[3]][:width]
    if running and st.improvable:
        best_len = params.max_tokens if (early_stopping == "never" and lp > 0.0) else gen_len
        best = running[0][2] / (best_len ** lp)
        worst = min(float(h[0]) for h in st.finished) if len(st.finished) == width else -1.0e9
        st.improvable = bool(best > worst)
    done = not running or not st.improvable or (early_stopping is True and len(st.finished) == width)
    chosen = {parent for parent, *_ in running} if not done else set()
    for j, b in enumerate(st.beams):  # free the beams nobody continues (before forking: blocks return)
        if j not in chosen:
            sched.finish(b, FinishReason.LENGTH if at_max else FinishReason.STOP)
    if done:
        st.beams, st.done = [], True
        return
    # Fork before appending: a child must copy its parent's tokens as they were.
    taken, beams = set(), []
    for parent, token, val, _ in running:
        p = st.beams[parent]
        if parent in taken:
            beams.append(sched.fork(p, len(beams)))
        else:
            taken.add(parent)
            beams.append(p)
    # the scheduler owns progress: it appends each beam's token (with its log-probability and time)
    sched.append_tokens(beams, [token for _, token, _, _ in running],
                        [float(logprobs[parent, token]) for parent, token, _, _ in running])
    st.beams = beams
    st.scores = torch.stack([c[2] for c in running])


def analytic_shared_blocks(beams_by_prompt, block_size: int) -> int:
    """Blocks live beams must hold with sharing: one per distinct (prompt, full-block prefix), plus
    each beam's partial last block (private: every beam has just written into it, after copy-on-write)."""
    full, partial = set(), 0
    for p, beams in enumerate(beams_by_prompt):
        for b in beams:
            toks = b.token_ids
            full.update((p, tuple(toks[: (i + 1) * block_size])) for i in range(len(toks) // block_size))
            partial += len(toks) % block_size != 0
    return len(full) + partial
