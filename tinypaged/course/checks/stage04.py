"""Stage 4 checks: one continuous-batching step (token budget, chunked prefill, preemption, admission).

The reference is ``tinypaged.sched.policies.schedule_step``, the very function the engine runs (there it
sees the scheduler's own requests and ``StepKV``; here ``PlanRequest`` objects and a ``BlockCounter``,
without prefix caching, swapping or arrival times).
"""

from __future__ import annotations

import random

from tinypaged.sched import policies
from tinypaged.kv.block_pool import blocks_needed
from tinypaged.course.checks import Case, register
from tinypaged.course.checks.serving import serving_check
from tinypaged.sched.policies import BlockCounter, PlanRequest


def _R(rid, n):
    return PlanRequest(rid, n)


def _name(req, given) -> str:
    """A plan lists the request objects it was given; anything else is shown as what it is."""
    if any(req is g for g in given):
        return str(req.request_id)
    return f"{req!r} (not one of the requests given: a plan lists the request objects, not their ids)"


def _step(fn, running, waiting, budget, max_num_seqs, kv):
    """Run one step; what it scheduled, preempted, left untouched and left allocated."""
    before = ([r.request_id for r in running], [r.request_id for r in waiting])
    given = list(running) + list(waiting)
    plan = fn(running, waiting, budget, max_num_seqs, kv)
    sched = [[_name(a, given), int(b)] for a, b in getattr(plan, "scheduled", [])]
    pre = [_name(x, given) for x in getattr(plan, "preempted", [])]
    unchanged = ([r.request_id for r in running], [r.request_id for r in waiting]) == before
    return {"scheduled": sched, "preempted": pre, "inputs unchanged": unchanged,
            "tokens held": dict(sorted(kv.held.items()))}


def _case(label, running, waiting, budget, mns, make_kv, hint=""):
    desc = (f"running {[(r.request_id, r.num_new_tokens) for r in running]}, waiting "
            f"{[(r.request_id, r.num_new_tokens) for r in waiting]}, budget {budget}, max_num_seqs {mns}")
    return Case(label, lambda fn, t: t(desc, _step(fn, list(running), list(waiting), budget, mns, make_kv())), hint)


def _random_cases(seed: int, n: int, label: str) -> Case:
    r = random.Random(seed)
    trials = []
    for _ in range(n):
        nb, bs = r.randint(2, 12), r.choice([1, 2, 4])
        held, running = {}, []
        for i in range(r.randint(0, 5)):
            t = r.randint(1, 3 * bs)
            if sum(blocks_needed(v, bs) for v in held.values()) + blocks_needed(t, bs) > nb:
                break
            held[f"r{i}"] = t
            running.append((f"r{i}", r.choice([1, 1, 1, r.randint(1, 10)])))
        waiting = [(f"w{i}", r.randint(1, 12)) for i in range(r.randint(0, 4))]
        trials.append((nb, bs, held, running, waiting, r.randint(1, 24), r.randint(max(1, len(running)), 6)))

    def run(fn, t):
        for k, (nb, bs, held, running, waiting, budget, mns) in enumerate(trials):
            t(f"trial {k}: {nb} blocks of {bs}, tokens held {held}, running {running}, waiting {waiting}, "
              f"budget {budget}, max_num_seqs {mns}",
              _step(fn, [_R(a, b) for a, b in running], [_R(a, b) for a, b in waiting], budget, mns,
                    BlockCounter(nb, bs, held)))
    return Case(label, run, weight=3)


@register("04", "schedule_step", reference=lambda: policies.schedule_step, points=5,
          forbidden=lambda: [policies.schedule_step])
def cases_schedule_step(hidden):
    def big(held=None):
        return lambda: BlockCounter(1000, 16, held)  # never runs out

    a, b, c = _R("a", 1), _R("b", 1), _R("c", 30)
    x, y, z = _R("x", 10), _R("y", 10), _R("z", 10)
    if hidden is not None:
        return [_random_cases(hidden, 300, "random steps")]
    return [
        _case("decodes first", [a, b], [c], 16, 8, big({"a": 20, "b": 20}),
              "running requests go first; a waiting prompt takes what is left of the budget"),
        _case("chunked prefill", [], [x, y, z], 16, 8, big(), "a prompt larger than the budget left is cut"),
        _case("a running prefill continues", [_R("p", 40)], [x], 16, 8, big({"p": 16})),
        _case("max_num_seqs", [a, b], [x], 64, 2, big({"a": 3, "b": 3}), "no more than max_num_seqs running"),
        _case("first come, first served", [a], [_R("w", 12), _R("s", 2)], 64, 8,
              lambda: BlockCounter(4, 4, {"a": 8}), "stop at the first waiting request that does not fit"),
        _case("preemption", [a, b, _R("c", 1)], [_R("s", 2)], 64, 8,
              lambda: BlockCounter(7, 4, {"a": 8, "b": 8, "c": 8}),
              "the most recently admitted running request is preempted; a step that preempted admits nothing"),
        _case("the victim can be the request itself", [a, b], [x], 64, 8, lambda: BlockCounter(5, 4, {"a": 8, "b": 8})),
        _case("several victims", [_R("a", 9), b, _R("c", 1), _R("d", 1)], [], 64, 8,
              lambda: BlockCounter(4, 4, {"a": 4, "b": 4, "c": 4, "d": 4})),
        _case("budget 0 left", [_R("a", 5), b], [x], 5, 8, big({"a": 1, "b": 2}), "stop when the budget is spent"),
        _random_cases(4, 200, "random steps"),
    ]


# ---------------------------------------------------------------- serving SmolLM2

def _preempted(llm, outs) -> bool:
    return llm.get_metrics()["num_preemptions"] > 0


serving_check("04", "serve_policy",
              prompts=("The capital of France is", "Once upon a time", "def fibonacci(n):",
                       "Water boils at a temperature of"),
              max_tokens=8,
              engine_kwargs=dict(block_size=4, num_gpu_blocks_override=10, max_model_len=64, max_num_seqs=4,
                                 max_num_batched_tokens=8, dtype="float32", device="cpu"),
              facts=[("the cache ran out and a request was preempted", _preempted)],
              uses=("schedule_step",))
