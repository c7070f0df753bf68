"""Stage 4 checks: the continuous-batching policy (admission under the token budget, preemption)."""

from __future__ import annotations

import random

from tinypaged.block_manager import blocks_needed
from tinypaged.checks import register
from tinypaged.scheduler import BlockCounter, PlanRequest


def _R(rid, n):
    return PlanRequest(rid, n)


def _plan(plan) -> tuple[list, list]:
    assert hasattr(plan, "scheduled") and hasattr(plan, "preempted"), \
        f"return a StepPlan(scheduled=[(request_id, num_tokens), ...], preempted=[request_id, ...]), got {plan!r}"
    return [tuple(x) for x in plan.scheduled], list(plan.preempted)


@register("04", "pick_victim", reference=lambda: __import__("tinypaged.scheduler", fromlist=["x"]).pick_victim)
def check_pick_victim(pick_victim):
    a, b, c = _R("a", 1), _R("b", 1), _R("c", 5)
    running = [a, b, c]
    got = pick_victim(running)
    assert got is c, f"running (admission order) is [a, b, c]: the victim is the last admitted, c; got {got!r}"
    assert running == [a, b, c], "pick_victim must not change the running list (the scheduler removes the victim)"
    assert pick_victim([b]) is b, "with one running request, it is the victim"
    assert pick_victim([c, a]) is a, "running [c, a]: a was admitted last, so a is the victim"


def _case(schedule_step, running, waiting, budget, max_num_seqs, kv, want_sched, want_pre, what):
    before = (list(running), list(waiting))
    got_sched, got_pre = _plan(schedule_step(running, waiting, budget, max_num_seqs, kv))
    assert (list(running), list(waiting)) == before, f"{what}: schedule_step must not modify running or waiting"
    assert got_sched == want_sched, f"{what}: expected scheduled {want_sched}, got {got_sched}"
    assert got_pre == want_pre, f"{what}: expected preempted {want_pre}, got {got_pre}"


@register("04", "schedule_step", reference=lambda: __import__("tinypaged.scheduler", fromlist=["x"]).schedule_step)
def check_schedule_step(schedule_step):
    from tinypaged.scheduler import schedule_step as reference

    big = lambda held=None: BlockCounter(1000, 16, held)  # noqa: E731  (never runs out)
    # 1. decodes first, the prompt takes what is left of the budget
    a, b, c = _R("a", 1), _R("b", 1), _R("c", 30)
    _case(schedule_step, [a, b], [c], 16, 8, big({"a": 20, "b": 20}), [("a", 1), ("b", 1), ("c", 14)], [],
          "running a, b decode; c (30-token prompt) waits; budget 16")
    # 2. budget splits prompts (chunked prefill), in queue order
    x, y, z = _R("x", 10), _R("y", 10), _R("z", 10)
    _case(schedule_step, [], [x, y, z], 16, 8, big(), [("x", 10), ("y", 6)], [],
          "three 10-token prompts, budget 16")
    # 3. a running prompt chunk continues before anything new
    p = _R("p", 40)
    _case(schedule_step, [p], [x], 16, 8, big({"p": 16}), [("p", 16)], [],
          "p is mid-prefill with 40 tokens left, budget 16")
    # 4. max_num_seqs caps admission
    _case(schedule_step, [a, b], [x], 64, 2, big({"a": 3, "b": 3}), [("a", 1), ("b", 1)], [],
          "max_num_seqs=2 and two are running")
    # 5. first-come first-served: a waiting request that does not fit blocks the ones behind it
    kv = BlockCounter(4, 4, {"a": 8})  # 2 blocks held, 2 free
    _case(schedule_step, [a], [_R("w", 12), _R("s", 2)], 64, 8, kv, [("a", 1)], [],
          "a decodes (needs a 3rd block), w needs 3 blocks, s 1 block, 4 blocks in all")
    # 6. preemption: the last admitted goes; nothing new is admitted in that step
    kv = BlockCounter(7, 4, {"a": 8, "b": 8, "c": 8})  # one block free; each decode needs a new one
    c = _R("c", 1)
    _case(schedule_step, [a, b, c], [_R("s", 2)], 64, 8, kv, [("a", 1), ("b", 1)], ["c"],
          "a, b, c each need a new block and one is free (7 blocks); s (2 tokens) waits")
    # 7. the victim can be the request being scheduled
    kv = BlockCounter(5, 4, {"a": 8, "b": 8})  # one block free: a takes it, b has none
    _case(schedule_step, [a, b], [x], 64, 8, kv, [("a", 1)], ["b"],
          "a takes the last free block; b needs one too")
    # 8. several victims for one request
    kv = BlockCounter(4, 4, {"a": 4, "b": 4, "c": 4, "d": 4})
    big_a = _R("a", 9)
    _case(schedule_step, [big_a, b, c, _R("d", 1)], [], 64, 8, kv, [("a", 9)], ["d", "c", "b"],
          "a needs 3 more blocks; b, c, d hold one each and none is free")
    # 9. random cases against the reference
    rng = random.Random(4)
    for trial in range(300):
        nb, bs = rng.randint(2, 12), rng.choice([1, 2, 4])
        held, running = {}, []
        for i in range(rng.randint(0, 5)):
            t = rng.randint(1, 3 * bs)
            if sum(blocks_needed(v, bs) for v in held.values()) + blocks_needed(t, bs) > nb:
                break
            held[f"r{i}"] = t
            running.append(_R(f"r{i}", rng.choice([1, 1, 1, rng.randint(1, 10)])))
        waiting = [_R(f"w{i}", rng.randint(1, 12)) for i in range(rng.randint(0, 4))]
        budget, mns = rng.randint(1, 24), rng.randint(max(1, len(running)), 6)
        want = reference(running, waiting, budget, mns, BlockCounter(nb, bs, held))
        _case(schedule_step, running, waiting, budget, mns, BlockCounter(nb, bs, held), want.scheduled,
              want.preempted, f"random case {trial} (blocks {nb}x{bs}, held {held}, budget {budget}, "
                              f"max_num_seqs {mns}, running {[(r.request_id, r.num_new_tokens) for r in running]}, "
                              f"waiting {[(r.request_id, r.num_new_tokens) for r in waiting]})")

