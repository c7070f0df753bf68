"""A straight step with typed hand-offs (vLLM v1): the scheduler hands the runner data, a plan policy only
decides and one adapter applies its plan, only ``tinypaged.sched`` writes a Sequence's progress, static
batching admits with ``schedule_step``'s own loop, and one loop drives the engine to completion."""

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.sched.output import ScheduledChunk
from tinypaged.sched.policies import PlanPolicy, schedule_step
from tinypaged.sched.radix_policy import CacheAwareOrder
from tinypaged.sequence import FinishReason, Sequence

pytestmark = pytest.mark.usefixtures("shared_weights")

PROMPTS = [{"prompt_token_ids": [(5 * i + 3 * j) % 900 + 5 for j in range(n)]} for i, n in enumerate([6, 19, 3, 11])]
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PACKAGE = Path(__file__).resolve().parents[1] / "tinypaged"


def tiny(**kw):
    return LLM("tiny", **{"dtype": "float64", "device": "cpu", "block_size": 4, "max_model_len": 64, **kw})


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference():
    return token_ids(tiny(num_gpu_blocks_override=64).generate(PROMPTS, PARAMS))


def _fields(obj):
    return [getattr(obj, f.name) for f in dataclasses.fields(obj)]


@pytest.mark.parametrize("kw", [dict(), dict(kv_cache_manager="contiguous", kv_cache_tokens=256),
                                dict(attention_backend="torch", enable_prefix_caching=True)],
                         ids=["paged", "contiguous", "torch-prefix"])
def test_the_runner_reads_plain_data_and_never_the_kv_manager(kw, reference):
    """The runner gets ``SchedulerOutput.batch``: chunks of plain data (no Sequence reachable; they survive a
    pickle round trip, so nothing live is read), and it holds no KV manager. Tokens are unchanged."""
    llm = tiny(num_gpu_blocks_override=64, **kw)
    runner = llm.llm_engine.runner
    assert not hasattr(runner, "kv"), "the runner must not hold the KV manager"
    execute, seen = runner.execute, []

    def on_data(batch):
        assert all(isinstance(c, ScheduledChunk) for c in batch)
        assert not any(isinstance(v, Sequence) for c in batch for v in _fields(c))
        seen.append(len(batch))
        return execute(pickle.loads(pickle.dumps(batch)))  # a copy: the runner cannot reach live state

    runner.execute = on_data
    assert token_ids(llm.generate(PROMPTS, PARAMS)) == reference
    assert seen and max(seen) > 1


def test_a_plan_policy_is_asked_once_per_step_and_never_calls_the_scheduler(reference):
    """A plan policy only decides: ``plan`` runs once per engine step, on the adapter's requests, with the
    adapter as its kv (the scheduler is never handed to it), whichever order it runs in."""
    class Counting(PlanPolicy):
        calls = 0

        def plan(self, running, waiting, budget, max_num_seqs, kv):
            Counting.calls += 1
            assert type(kv).__name__ == "StepKV"
            return super().plan(running, waiting, budget, max_num_seqs, kv)

    for order in ("fcfs", CacheAwareOrder("lpm"), "priority"):
        Counting.calls = 0
        llm = tiny(num_gpu_blocks_override=64, scheduler_cls=Counting(), scheduling_policy=order)
        steps = []
        assert token_ids(llm.generate(PROMPTS, PARAMS, on_step=steps.append)) == reference
        assert Counting.calls == len(steps) > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_queues_change_once_after_the_plan(mode, reference):
    """While the step function decides, the scheduler's queues stay as they were: ``kv.allocate`` and ``kv.free``
    act on the KV manager only, and the queues settle after the plan (preempted requests leave ``running`` and go
    back to the front of their queue, swapped-in groups run again, the scheduled waiting ones are admitted).
    The cache is small enough that steps preempt, and the tokens are the reference's."""
    checked = {"calls": 0, "frees": 0}

    def watching_step(running, waiting, budget, max_num_seqs, kv):
        sched = kv.sched  # the test peeks; the step function itself is never handed the scheduler
        before = ([s.seq_id for s in sched.running], [s.seq_id for s in sched.waiting],
                  [[s.seq_id for s in g] for g in sched.swapped])

        class Watched:
            def allocate(self, req, n):
                ok = kv.allocate(req, n)
                self.same()
                return ok

            def free(self, req):
                kv.free(req)
                checked["frees"] += 1
                self.same()

            @staticmethod
            def same():
                checked["calls"] += 1
                now = ([s.seq_id for s in sched.running], [s.seq_id for s in sched.waiting],
                       [[s.seq_id for s in g] for g in sched.swapped])
                assert now == before, "the queues changed while the step was deciding"

        return schedule_step(running, waiting, budget, max_num_seqs, Watched())

    llm = tiny(num_gpu_blocks_override=6, scheduler_cls=watching_step, preemption_mode=mode)
    assert token_ids(llm.generate(PROMPTS, PARAMS)) == reference
    assert checked["frees"] > 0, "the cache was meant to make the steps preempt"


def test_static_batching_admits_with_schedule_steps_loop(monkeypatch, reference):
    """One FCFS admission loop: static batching forms its batches by running ``schedule_step``."""
    import tinypaged.sched.static as static

    calls = []

    def spy(running, waiting, budget, max_num_seqs, kv):
        calls.append(type(kv).__name__)
        return schedule_step(running, waiting, budget, max_num_seqs, kv)

    monkeypatch.setattr(static, "schedule_step", spy)
    llm = tiny(num_gpu_blocks_override=64, scheduler_cls="static", max_num_seqs=2)
    assert token_ids(llm.generate(PROMPTS, PARAMS)) == reference
    assert calls.count("_Reservations") >= 2, "each static batch is formed by schedule_step's admission"


def _writes_outside_sched():
    """(file, line, attribute) of every assignment to a Sequence's progress, status or finish outside
    tinypaged/sched/ and sequence.py (the class itself), found by reading the source."""
    owned = {"num_computed_tokens", "num_cached_tokens", "status", "finish_reason", "stop_reason", "pending_forks",
             "num_preemptions", "output_token_ids"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("sched/") or rel == "sequence.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in (e for tgt in targets for e in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])):
                if isinstance(t, ast.Attribute) and t.attr in owned and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self"):
                    found.append((rel, node.lineno, t.attr))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "output_token_ids"
                    and not (isinstance(node.func.value.value, ast.Name) and node.func.value.value.id == "self")):
                # (an object appending to its own list, as the server's SampleText does, is not a Sequence's state)
                found.append((rel, node.lineno, "output_token_ids"))
    return found


def test_only_the_scheduler_writes_sequence_state():
    assert _writes_outside_sched() == []


def test_the_engines_one_loop_drives_generate_and_beam_search_and_aborts_when_closed(monkeypatch):
    from tinypaged.engine.llm_engine import LLMEngine
    from tinypaged.sampling_params import BeamSearchParams

    llm = tiny(num_gpu_blocks_override=64)
    engine = llm.llm_engine
    used, loop = [], LLMEngine.run_until_done

    def counted(self, *args, **kwargs):
        used.append(kwargs.get("until") is not None)
        return loop(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "run_until_done", counted)
    llm.generate(PROMPTS[:1], PARAMS)
    llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert used == [False, True]

    # closing the loop early aborts what is still pending: the same enum everywhere, every block freed
    reqs = [engine.make_request(f"r{i}", p, PARAMS) for i, p in enumerate(PROMPTS)]
    engine.enqueue(reqs)
    run = engine.run_until_done([r.request_id for r in reqs])
    next(run)
    run.close()
    assert not engine.has_unfinished_requests() and engine.kv.usage == 0
    assert {s.finish_reason for r in reqs for s in r.seqs} == {FinishReason.ABORT}
    with pytest.raises(TypeError, match="FinishReason"):
        engine.scheduler.finish(reqs[0].seqs[0], "abort")
