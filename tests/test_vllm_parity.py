"""The real vLLM as a second oracle: same tokens, same batches, same prefix hits, same preemptions.

vLLM's CPU build (``.venv-vllm``, made by ``scripts/vllm_env.sh``) runs the same SmolLM2 fp32 weights
(the converted folder) in a subprocess (``tinypaged.lab.vllm_side``); every vLLM figure here is vLLM's
own counter (its stat-logger records), never ours. One subprocess serves the whole module.

Like with like, where the two differ by design:

* **block size 32.** vLLM's CPU attention takes only multiples of 32, so tinypaged runs at 32 here too
  (its default, like vLLM's GPU default, is 16).
* **the null block.** vLLM v1's ``BlockPool`` keeps block 0 aside as a placeholder ("null block") that
  no request ever gets, so ``num_gpu_blocks_override=B + 1`` gives vLLM the ``B`` usable blocks that
  ``num_gpu_blocks_override=B`` gives tinypaged. The test checks that too: vLLM with ``B`` runs fewer.
* **n > 1.** vLLM v1 fans a request out into n child requests that share the prompt through the prefix
  cache; tinypaged's default ``parallel_sampling="fork"`` (the paper's copy-on-write) shares it by
  reference counts and never looks the cache up, so the hit counts compare with ``"fanout"`` only.
* **one engine per configuration.** Starting a vLLM engine costs tens of seconds on a CPU, so the
  experiments that share a configuration share an engine (the fan-out runs after the chat, on its cache).
* **eager vs compiled.** vLLM compiles its graph by default (minutes on a CPU); the counts do not
  depend on it, so these engines run with ``enforce_eager=True``.

Prompts for greedy equality are the lessons' own SmolLM2 generations (``tinypaged.course.lesson_prompts``,
fp32), whose top-two logit gap never falls under 0.05 (``tests/test_logit_gap.py``): float noise between
two correct engines cannot flip them, so a difference is a bug.
"""

import functools

import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.course import lesson_prompts as lp
from tinypaged.lab import vllm_side

if not vllm_side.available():
    pytest.skip("vLLM environment missing (.venv-vllm): run `bash scripts/vllm_env.sh` for the vLLM parity tests",
                allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_thread", "shared_weights")

BS = vllm_side.CPU_BLOCK_SIZE
EAGER = dict(enforce_eager=True, max_num_batched_tokens=256)
GREEDY = [g for g in lp.GENERATIONS if g.model == "smollm2-135m" and g.dtype == "float32"]
# requests batched vs KV blocks: 8 requests of 40 prompt + 8 output tokens = 2 blocks of 32 each
BLOCK_WORK = [[300 + 37 * i + j for j in range(40)] for i in range(8)]
BLOCK_BUDGETS = (4, 8)
NULL_BLOCK_CHECK = 8  # vLLM with exactly this many blocks (no extra one) runs fewer requests at once
# prefix caching: one 80-token system prompt, 4 users, then a second turn resending each conversation with
# the engine's own reply (hits depend on lengths only, so the synthetic prompts need no logit-gap guard)
SYSTEM = [1000 + 7 * j for j in range(80)]
TURN1 = [SYSTEM + [2000 + 50 * c + k for k in range(10)] for c in range(4)]
REPLY = 7  # 90 + 7 tokens: the KV holds 96 (the last token is never computed) = 3 full blocks, reply included
# preemption: 6 requests of 20 prompt tokens that grow to 84 (3 blocks each) in 8 usable blocks
PREEMPT_WORK = [[500 + 29 * i + j for j in range(20)] for i in range(6)]
PREEMPT_BLOCKS, PREEMPT_OUT = 8, 64
FANOUT_PROMPT = [3000 + j for j in range(70)]  # 2 full blocks + 6 tokens


def tp_llm(**kw):
    return LLM("smollm2-135m", device="cpu", dtype="float32", seed=0, block_size=BS, **kw)


def tp_run(llm, prompts, max_tokens, ignore_eos=True, n=1):
    steps = []
    params = [SamplingParams(temperature=1.0 if n > 1 else 0.0, max_tokens=m, ignore_eos=ignore_eos, n=n, seed=0)
              for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, on_step=steps.append)
    return outs, steps


def experiments():
    tok = lp.load_tokenizer()
    exps = {}
    # 1. greedy tokens on the lessons' SmolLM2 prompts
    for g in GREEDY:
        exps[f"greedy-{g.name}"] = dict(engine=dict(num_gpu_blocks_override=64, max_model_len=512, max_num_seqs=32, **EAGER),
                                        requests=[vllm_side.request(p, m, ignore_eos=not g.stop_at_eos)
                                                  for p, m in zip(g.prompts(tok), g.max_tokens)])
    # 2. the same KV budget in usable blocks (vLLM: + its null block), and vLLM without the extra block
    for b, extra in [(b, 1) for b in BLOCK_BUDGETS] + [(NULL_BLOCK_CHECK, 0)]:
        exps[f"blocks-{b}+{extra}"] = dict(
            engine=dict(num_gpu_blocks_override=b + extra, max_model_len=64, max_num_seqs=8, **EAGER),
            requests=[vllm_side.request(p, 8) for p in BLOCK_WORK])
    # 3. prefix caching: two waves on one engine (the cache persists between them)
    cache = dict(num_gpu_blocks_override=64, max_model_len=256, max_num_seqs=8, enable_prefix_caching=True, **EAGER)
    exps["prefix-turn1"] = dict(engine=cache, requests=[vllm_side.request(p, REPLY) for p in TURN1])
    turn1 = list(exps).index("prefix-turn1")
    exps["prefix-turn2"] = dict(engine=cache, requests=[vllm_side.request(p, REPLY) for p in
                                                        turn2(lambda c: [vllm_side.reply(turn1, c)])])
    # 4. n = 4 fans out into 4 requests sharing the prompt's full blocks (the same engine: the prompt
    # shares nothing with the chat's, so only its own children can hit)
    exps["fanout"] = dict(engine=cache, requests=[vllm_side.request(FANOUT_PROMPT, 4, n=4, seed=0)])
    # 5. a trace that forces preemptions (recompute, v1's only mode)
    exps["preempt"] = dict(engine=dict(num_gpu_blocks_override=PREEMPT_BLOCKS + 1, max_model_len=96, max_num_seqs=6,
                                       **EAGER),
                           requests=[vllm_side.request(p, PREEMPT_OUT) for p in PREEMPT_WORK])
    return exps


def turn2(replies):
    """Each conversation resent with its first reply and a new user message. ``replies``: the token ids,
    or a function of the conversation giving a place for them (vLLM fills in its own replies)."""
    return [p + (replies(c) if callable(replies) else replies[c]) + [2500 + 50 * c + k for k in range(10)]
            for c, p in enumerate(TURN1)]


BETWEEN: list = []  # the experiment numbers vllm_side.run's ``between`` was called with


@pytest.fixture(scope="module")
def vllm():
    exps = experiments()
    return dict(zip(exps, vllm_side.run(list(exps.values()), between=BETWEEN.append)))


def test_between_runs_after_each_experiment_in_turn(vllm):
    """The benchmarks alternate their timed passes with vLLM's through ``between``: called once per experiment, in
    order, after that experiment (its results are back: the experiments all ran)."""
    assert BETWEEN == list(range(len(vllm)))


@functools.lru_cache(maxsize=None)
def greedy_tokens(name):
    g = next(g for g in GREEDY if g.name == name)
    llm = tp_llm(num_gpu_blocks_override=64, max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256)
    outs, _ = tp_run(llm, g.prompts(lp.load_tokenizer()), g.max_tokens, ignore_eos=not g.stop_at_eos)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", [g.name for g in GREEDY])
def test_greedy_tokens_equal_vllms(vllm, name):
    ours, theirs = greedy_tokens(name), vllm[f"greedy-{name}"]["tokens"]
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert len(ours) == len(theirs) and not differ, f"{name}: prompts {differ} differ from vLLM's tokens"


@pytest.mark.parametrize("blocks", BLOCK_BUDGETS)
def test_same_requests_at_once_for_the_same_blocks(vllm, blocks):
    llm = tp_llm(num_gpu_blocks_override=blocks, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=256)
    _, steps = tp_run(llm, BLOCK_WORK, [8] * len(BLOCK_WORK))
    ours = [len(st.scheduled) for st in steps]
    v = vllm[f"blocks-{blocks}+1"]
    assert v["num_blocks"] == blocks + 1
    assert max(ours) == v["max_batch"] == min(8, blocks // 2)
    assert ours == [s["batch"] for s in v["steps"]], "the batches differ step by step"


def test_vllm_keeps_one_block_aside(vllm):
    """Without the extra block vLLM has one usable block fewer: the null block is real."""
    assert vllm[f"blocks-{NULL_BLOCK_CHECK}+0"]["max_batch"] == (NULL_BLOCK_CHECK - 1) // 2


def test_same_prefix_cache_hits(vllm):
    llm = tp_llm(num_gpu_blocks_override=63, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
                 enable_prefix_caching=True)
    first, _ = tp_run(llm, TURN1, [REPLY] * 4)
    replies = [list(o.outputs[0].token_ids) for o in first]  # each engine resends its own replies: the hits
    second, _ = tp_run(llm, turn2(replies), [REPLY] * 4)
    ours = [o.metrics.num_cached_tokens for o in first + second]  # vLLM: RequestOutput.num_cached_tokens
    theirs = vllm["prefix-turn1"]["num_cached_tokens"] + vllm["prefix-turn2"]["num_cached_tokens"]
    assert ours == theirs
    # turn 1 shares the system prompt's 2 full blocks; turn 2 also the block the reply filled
    assert max(theirs[:4]) == 64 and max(theirs[4:]) == 96
    hits = llm.get_metrics()["prefix_cache_hits"]
    assert hits == vllm["prefix-turn1"]["prefix_cache_hits"] + vllm["prefix-turn2"]["prefix_cache_hits"]


def test_same_preemptions(vllm):
    llm = tp_llm(num_gpu_blocks_override=PREEMPT_BLOCKS, max_model_len=96, max_num_seqs=6, max_num_batched_tokens=256)
    outs, steps = tp_run(llm, PREEMPT_WORK, [PREEMPT_OUT] * len(PREEMPT_WORK))
    v = vllm["preempt"]
    assert v["num_preemptions"] > 0, "the trace must force preemptions"
    assert llm.get_metrics()["num_preemptions"] == v["num_preemptions"]
    assert len(steps) == v["num_steps"]
    assert [len(o.outputs[0].token_ids) for o in outs] == [len(t) for t in v["tokens"]] == [PREEMPT_OUT] * 6


def test_fanout_shares_the_prompt_like_vllm(vllm):
    llm = tp_llm(num_gpu_blocks_override=63, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
                 enable_prefix_caching=True, parallel_sampling="fanout")
    tp_run(llm, [FANOUT_PROMPT], [4], n=4)
    v = vllm["fanout"]
    assert llm.get_metrics()["prefix_cache_hits"] == v["prefix_cache_hits"] > 0
