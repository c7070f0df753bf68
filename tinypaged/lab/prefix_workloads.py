"""Stage 7: traffic whose prompts share prefixes, the SGLang paper's workloads in miniature (seeded).

The paper (Zheng et al., 2023, section 6) measures few-shot benchmarks, multi-turn chat, agents and
tree-structured reasoning. Four shapes, as token ids (no data set, no tokenizer):

* ``shared_system_prompt``: many users, one long system prompt, short questions.
* ``few_shot``: a few tasks, each a k-shot prefix; the queries of the tasks arrive interleaved, so a
  scheduler that follows arrival order keeps switching prefixes (cache-aware order groups them).
* ``multi_turn_chat``: each turn's prompt is the previous turn's prompt, *its output*, and a new user
  message: only a cache that keeps output KV reuses the whole history.
* ``tree_of_thought``: one problem, several branches (a different hint each), then a follow-up on each
  branch that carries the branch's output.

A workload is a list of *waves*: a wave is submitted when the one before it has finished, and a request
may name a ``parent`` from an earlier wave whose prompt and output start its own prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TOKEN_RANGE = (100, 4000)  # ordinary vocabulary ids of SmolLM2 (and in range for "tiny")


@dataclass(frozen=True)
class PrefixRequest:
    name: str
    tokens: tuple[int, ...]  # this request's own tokens (after its parent's prompt and output, if any)
    max_tokens: int = 8
    parent: str | None = None


@dataclass(frozen=True)
class PrefixWorkload:
    name: str
    waves: tuple[tuple[PrefixRequest, ...], ...]
    shares: str  # what the requests share, in words

    @property
    def num_requests(self) -> int:
        return sum(len(w) for w in self.waves)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_RANGE) for _ in range(n))


def shared_system_prompt(num_users: int = 8, system_len: int = 100, question_len: tuple[int, int] = (6, 20),
                         max_tokens: int = 8, seed: int = 0) -> PrefixWorkload:
    r = random.Random(seed)
    system = _tokens(r, system_len)
    wave = tuple(PrefixRequest(f"user{u}", system + _tokens(r, r.randint(*question_len)), max_tokens)
                 for u in range(num_users))
    return PrefixWorkload("system prompt", (wave,), f"a {system_len}-token system prompt")


def few_shot(num_tasks: int = 4, shots: int = 4, shot_len: int = 20, queries: int = 4, query_len: int = 10,
             max_tokens: int = 6, seed: int = 1) -> PrefixWorkload:
    r = random.Random(seed)
    prefixes = [sum((_tokens(r, shot_len) for _ in range(shots)), ()) for _ in range(num_tasks)]
    wave = tuple(PrefixRequest(f"task{t}q{q}", prefixes[t] + _tokens(r, query_len), max_tokens)
                 for q in range(queries) for t in range(num_tasks))  # interleaved: t0 t1 t2 t0 t1 ...
    return PrefixWorkload("few-shot", (wave,), f"{num_tasks} tasks, each a {shots}-shot prefix of {shots * shot_len} "
                                               f"tokens; queries interleaved")


def multi_turn_chat(num_chats: int = 3, turns: int = 3, system_len: int = 40, user_len: int = 15,
                    max_tokens: int = 12, seed: int = 2) -> PrefixWorkload:
    r = random.Random(seed)
    system = _tokens(r, system_len)
    waves = [tuple(PrefixRequest(f"chat{c}t0", system + _tokens(r, user_len), max_tokens) for c in range(num_chats))]
    for t in range(1, turns):
        waves.append(tuple(PrefixRequest(f"chat{c}t{t}", _tokens(r, user_len), max_tokens, parent=f"chat{c}t{t - 1}")
                           for c in range(num_chats)))
    return PrefixWorkload("multi-turn chat", tuple(waves), "each turn: the previous turn, its reply, a new message")


def tree_of_thought(num_problems: int = 2, branches: int = 3, problem_len: int = 60, hint_len: int = 5,
                    follow_len: int = 6, max_tokens: int = 10, seed: int = 3) -> PrefixWorkload:
    r = random.Random(seed)
    first, second = [], []
    for p in range(num_problems):
        problem = _tokens(r, problem_len)
        for b in range(branches):
            first.append(PrefixRequest(f"p{p}b{b}", problem + _tokens(r, hint_len), max_tokens))
            second.append(PrefixRequest(f"p{p}b{b}f", _tokens(r, follow_len), max_tokens, parent=f"p{p}b{b}"))
    return PrefixWorkload("tree of thought", (tuple(first), tuple(second)),
                          f"{branches} branches per problem, then a follow-up on each branch's output")


def all_workloads() -> list[PrefixWorkload]:
    return [shared_system_prompt(), few_shot(), multi_turn_chat(), tree_of_thought()]


def run_workload(llm, workload: PrefixWorkload, on_step=None) -> dict[str, object]:
    """Run the waves one after the other on ``llm`` (greedy, every ``max_tokens`` step): name -> RequestOutput."""
    from tinypaged import SamplingParams

    done: dict[str, object] = {}
    for wave in workload.waves:
        prompts, params = [], []
        for req in wave:
            head = []
            if req.parent is not None:
                out = done[req.parent]
                head = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            prompts.append({"prompt_token_ids": head + list(req.tokens)})
            params.append(SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True))
        for req, out in zip(wave, llm.generate(prompts, params, on_step=on_step)):
            done[req.name] = out
    return done
