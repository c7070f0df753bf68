"""The engine's plug-in points, driven by small third-party-style implementations defined here.

Each of ``kv_cache_manager``, ``scheduler_cls`` and ``attention_backend`` gets an implementation
written from scratch (no tinypaged internals), which must produce the built-in engine's greedy
tokens; all three together serve SmolLM2 and match transformers. Broken plug-ins must be stopped
by the engine with a message naming the broken rule: at construction (a missing method) or at the
step where the rule breaks.
"""

import functools
import math

import pytest
import torch

from tinypaged import LLM, SamplingParams
from tinypaged.interfaces import InvariantError

pytestmark = pytest.mark.usefixtures("shared_weights", "one_thread")

PROMPTS = [{"prompt_token_ids": list(range(3 + i, 3 + i + n))} for i, n in enumerate((5, 17, 9, 30, 2, 12))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TINY = dict(dtype="float64", device="cpu", block_size=4, max_model_len=64, num_gpu_blocks_override=40,
            max_num_batched_tokens=32, max_num_seqs=4)


# -- third-party-style implementations -------------------------------------------------------------
class StackBlockManager:
    """A learner's paged manager: a stack of free block ids and one table per sequence."""

    def __init__(self, spec):
        self.block_size = spec.block_size
        self.num_blocks = spec.num_blocks
        self.capacity_tokens = spec.num_blocks * spec.block_size
        self.max_model_len = spec.max_model_len
        self.free_ids = list(range(spec.num_blocks - 1, -1, -1))
        self.tables = {}

    @property
    def usage(self):
        return 1 - len(self.free_ids) / self.num_blocks

    def get_computed_blocks(self, seq):
        return []

    def max_tokens_needed(self, seq):
        return seq.max_total_tokens(self.max_model_len)

    def take(self):
        return self.free_ids.pop()

    def allocate_slots(self, seq, num_new_tokens, computed_blocks=()):
        table = self.tables.get(seq.seq_id, [])
        need = math.ceil((seq.num_computed_tokens + num_new_tokens) / self.block_size) - len(table)
        if need > len(self.free_ids):
            return False
        self.tables[seq.seq_id] = table + [self.take() for _ in range(need)]
        return True

    def block_ids(self, seq):
        return list(self.tables.get(seq.seq_id, []))

    def slot_mapping(self, seq, start, end):
        t = self.tables[seq.seq_id]
        return [t[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]

    def free(self, seq):
        self.free_ids.extend(self.tables.pop(seq.seq_id, []))


def fcfs_step(running, waiting, budget, max_num_seqs, kv):
    """A learner's continuous step: decode/prefill the running in order (preempting the newest when
    memory runs out), then admit waiting requests while the budget and max_num_seqs allow. The plan
    lists the request objects it was given (not their ids)."""
    from types import SimpleNamespace

    plan = SimpleNamespace(scheduled=[], preempted=[])
    running = list(running)
    for req in list(running):
        if req not in running or budget == 0:
            continue
        n = min(req.num_new_tokens, budget)
        while not kv.allocate(req, n):
            victim = running.pop()
            kv.free(victim)
            plan.preempted.append(victim)
            if victim is req:
                break
        else:
            plan.scheduled.append((req, n))
            budget -= n
    if plan.preempted:
        return plan
    for req in waiting:
        n = min(req.num_new_tokens, budget)
        if n == 0 or len(running) >= max_num_seqs or not kv.allocate(req, n):
            break
        running.append(req)
        plan.scheduled.append((req, n))
        budget -= n
    return plan


def loop_decode(query, key_cache, value_cache, block_tables, context_lens, scale):
    """A learner's paged decode: per sequence, gather keys through the block table, then softmax."""
    out = torch.empty_like(query)
    bs, kvh = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // kvh
    for i in range(query.shape[0]):
        n = int(context_lens[i])
        blocks = block_tables[i, : math.ceil(n / bs)].long()
        k = key_cache[blocks].reshape(-1, kvh, key_cache.shape[3])[:n]
        v = value_cache[blocks].reshape(-1, kvh, value_cache.shape[3])[:n]
        for h in range(query.shape[1]):
            w = torch.softmax((k[:, h // group] @ query[i, h]) * scale, dim=0)
            out[i, h] = w @ v[:, h // group]
    return out


@functools.lru_cache(maxsize=None)
def reference_tokens():
    return [o.outputs[0].token_ids for o in LLM("tiny", **TINY).generate(PROMPTS, GREEDY)]


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


# -- each plug-in point serves the model ----------------------------------------------------------
def test_kv_cache_manager_plugin_serves_the_engine():
    llm = LLM("tiny", kv_cache_manager=StackBlockManager, **TINY)
    assert isinstance(llm.llm_engine.kv, StackBlockManager)
    assert tokens(llm) == reference_tokens()
    assert llm.llm_engine.kv.usage == 0, "every block came back"


def test_kv_cache_manager_plugin_survives_preemption():
    llm = LLM("tiny", kv_cache_manager=StackBlockManager, **{**TINY, "num_gpu_blocks_override": 12})
    assert tokens(llm) == reference_tokens()
    assert llm.get_metrics()["num_preemptions"] > 0


def test_scheduler_cls_plugin_serves_the_engine():
    llm = LLM("tiny", scheduler_cls=fcfs_step, **{**TINY, "num_gpu_blocks_override": 14})
    assert tokens(llm) == reference_tokens()
    assert llm.get_metrics()["num_preemptions"] > 0, "the workload must make the policy preempt"


def test_scheduler_cls_object_plugin():
    from tinypaged.sched.policies import PlanPolicy, schedule_step

    class Logged(PlanPolicy):  # a plan policy only decides: the scheduler's adapter applies its plan
        steps = 0

        def plan(self, running, waiting, budget, max_num_seqs, kv):
            Logged.steps += 1
            return super().plan(running, waiting, budget, max_num_seqs, kv)

    llm = LLM("tiny", scheduler_cls=Logged(schedule_step), **TINY)
    assert tokens(llm) == reference_tokens() and Logged.steps > 0


def test_attention_backend_plugin_serves_the_engine():
    llm = LLM("tiny", attention_backend=loop_decode, **TINY)
    assert llm.llm_engine.runner.backend.name == "loop_decode"
    assert tokens(llm) == reference_tokens()


def test_all_three_plugins_serve_smollm2_like_transformers():
    from transformers import AutoModelForCausalLM

    from tinypaged.model.loader import smollm2_folder

    llm = LLM("smollm2-135m", dtype="float32", device="cpu", block_size=16, num_gpu_blocks_override=32,
              max_model_len=256, max_num_seqs=4, kv_cache_manager=StackBlockManager,
              scheduler_cls=fcfs_step, attention_backend=loop_decode)
    prompts = ["The capital of France is", "Once upon a time"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt).input_ids
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, prompt


# -- broken plug-ins are stopped, naming the rule ----------------------------------------------------
def test_missing_method_fails_at_construction():
    class NoFree:
        def __init__(self, spec):
            self.inner = StackBlockManager(spec)

        def __getattr__(self, name):
            if name == "free":
                raise AttributeError(name)
            return getattr(self.inner, name)

    with pytest.raises(TypeError, match="lacks required member.*free"):
        LLM("tiny", kv_cache_manager=NoFree, **TINY)
    with pytest.raises(TypeError, match="plan"):
        LLM("tiny", scheduler_cls=type("NoPlan", (), {"plan": None})(), **TINY)
    with pytest.raises(TypeError, match="decode"):
        LLM("tiny", attention_backend=type("WriteOnly", (), {"write": None, "uses_block_tables": True})(), **TINY)


def test_block_handed_out_twice_is_caught():
    class Leaky(StackBlockManager):
        def take(self):
            return self.free_ids[-1]  # forgets to remove the block from the free list

    llm = LLM("tiny", kv_cache_manager=Leaky, **TINY)
    with pytest.raises(InvariantError, match="handed out twice"):
        llm.generate(PROMPTS, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests(), "the interrupted call aborted its requests"


def test_policy_over_max_num_seqs_is_refused_or_caught():
    def greedy_admit(running, waiting, budget, max_num_seqs, kv):
        return fcfs_step(running, waiting, budget, 10**9, kv)

    # a step function acts through the engine's kv, which refuses a waiting request the seats it does not have
    llm = LLM("tiny", scheduler_cls=greedy_admit, **{**TINY, "max_num_seqs": 2})
    running = []
    outs = llm.generate(PROMPTS, GREEDY, on_step=lambda st: running.append(len(llm.llm_engine.scheduler.running)))
    assert max(running) == 2 and [o.outputs[0].token_ids for o in outs] == reference_tokens()

    from tinypaged.sched.output import ScheduledSeq, SchedulerOutput
    from tinypaged.sched.scheduler import Scheduler

    class AdmitAll(Scheduler):  # a scheduler of its own admits through its actions: the engine's check stops it
        def form_step(self):
            out = SchedulerOutput()
            for seq in list(self.waiting):
                if self.allocate(seq, 1):
                    self.admit(seq)
                    out.scheduled.append(ScheduledSeq(seq, 1))
            return out

    with pytest.raises(TypeError, match="Scheduler subclass overriding form_step"):
        LLM("tiny", scheduler_cls=type("Acts", (), {"schedule": lambda self, sched: None})(), **TINY)
    llm = LLM("tiny", scheduler_cls=AdmitAll, **{**TINY, "max_num_seqs": 2})
    with pytest.raises(InvariantError, match="max_num_seqs=2"):
        llm.generate(PROMPTS, GREEDY)


def test_policy_over_the_token_budget_is_caught():
    def whole_prompts(running, waiting, budget, max_num_seqs, kv):
        return fcfs_step(running, waiting, 10**9, max_num_seqs, kv)

    llm = LLM("tiny", scheduler_cls=whole_prompts, **TINY)
    with pytest.raises(InvariantError, match="max_num_batched_tokens=32"):
        llm.generate(PROMPTS, GREEDY)


def test_policy_scheduling_without_allocating_is_caught():
    def no_alloc(running, waiting, budget, max_num_seqs, kv):
        from types import SimpleNamespace

        return SimpleNamespace(scheduled=[(r, 1) for r in list(waiting)[:1]], preempted=[])

    llm = LLM("tiny", scheduler_cls=no_alloc, **TINY)
    with pytest.raises(InvariantError, match="allocate exactly what you schedule"):
        llm.generate(PROMPTS, GREEDY)


def test_policy_returning_ids_is_caught():
    def ids_plan(running, waiting, budget, max_num_seqs, kv):
        plan = fcfs_step(running, waiting, budget, max_num_seqs, kv)
        plan.scheduled = [(r.request_id, n) for r, n in plan.scheduled]
        return plan

    llm = LLM("tiny", scheduler_cls=ids_plan, **TINY)
    with pytest.raises(InvariantError, match="not their ids"):
        llm.generate(PROMPTS, GREEDY)
