"""Stage 9 checks: a cache-aware router (load thresholds, longest match over per-replica radix trees, the
smallest-tree fallback, eviction by size), then the same router as the policy of the course's HTTP proxy in front
of two real tiny-model replicas.

The reference is the package's own ``tinypaged.lab.routing.CacheAwareRouter``. The learner's class has the same
interface: ``CacheAwareRouter(num_replicas, cache_threshold, balance_abs_threshold, balance_rel_threshold,
max_tree_size)``, ``route(prompt_token_ids) -> replica``, ``finished(replica)``, ``imbalanced()``, ``load`` and
``trees`` (one stage-7 ``RadixTree`` per replica). A case records the replicas chosen, the loads and the trees'
sizes, never node identities. One case routes through a subclass whose ``matched`` is told what the replicas hold
(as ``PreciseRouter``'s is): a ``route`` that reads its trees instead of calling ``self.matched`` fails it.

``router_in_proxy`` starts two in-process replicas of the seeded tiny model (prefix caching on) behind
``tinypaged.entrypoints.router_proxy`` on 127.0.0.1, sends six requests of two conversations through it one after
the other, and records where each went, each replica's prefix-cache hit tokens and whether every output equals the
offline engine's greedy tokens; it prints the decisions and the hit tokens per replica for the learner.
"""

from __future__ import annotations

import os
import random

from tinypaged.course.checks import Case, register
from tinypaged.course.checks._util import rng
from tinypaged.lab.routing import CacheAwareRouter, PreciseRouter
from tinypaged.lab.routing_lab import offline_greedy, serve_routed

STEP_HINTS = (
    ("imbalanced", "imbalanced() is True only when max(load) - min(load) > balance_abs_threshold AND max(load) > "
                   "min(load) * balance_rel_threshold"),
    ("route(", "imbalanced: the least loaded replica; otherwise the longest match if matched / len(prompt) > "
               "cache_threshold, else the smallest tree; ties go to the lowest index; then insert the prompt into "
               "the chosen tree, evict down to max_tree_size and add one to its load"),
    ("sizes", "after inserting, a tree over max_tree_size tokens evicts (tree.evict(size - max_tree_size))"),
    ("finished", "finished(replica) takes one off that replica's load"),
)


def _sizes(router) -> list[int]:
    return [t.evictable_size + t.protected_size for t in router.trees]


def _script(kw: dict, ops: list):
    """A case from plain operations: ``("route", prompt)``, ``("finished", replica)``, ``("imbalanced",)``."""
    def run(cls, t):
        router = cls(**kw)
        for i, op in enumerate(ops):
            if op[0] == "route":
                short = op[1] if len(op[1]) <= 12 else f"{list(op[1][:10])}... ({len(op[1])} tokens)"
                t(f"step {i}: route({short}): the replica, the loads, the trees' sizes",
                  [router.route(list(op[1])), list(router.load), _sizes(router)])
            elif op[0] == "finished":
                router.finished(op[1])
                t(f"step {i}: finished({op[1]}): the loads", list(router.load))
            else:
                t(f"step {i}: imbalanced() with loads {list(router.load)}", bool(router.imbalanced()))
    return run


def _random_ops(r: random.Random, num_replicas: int, steps: int) -> list:
    prefixes = [[r.randrange(1, 50) for _ in range(r.randint(3, 12))] for _ in range(r.randint(2, 5))]
    ops, inflight = [], []
    for _ in range(steps):
        x = r.random()
        if x < 0.65 or not inflight:
            p = r.choice(prefixes)[: r.randint(1, 12)] + [r.randrange(1, 50) for _ in range(r.randint(0, 6))]
            ops.append(("route", p or [1]))
            inflight.append(len(ops) - 1)
        elif x < 0.9:
            ops.append(("finished", None, inflight.pop(r.randrange(len(inflight)))))
        else:
            ops.append(("imbalanced",))
    return ops


def _workout(kw: dict, seed: int, steps: int):
    """A random run: finishes name the route step whose replica they give back (known only as the router answers)."""
    def run(cls, t):
        router, chosen = cls(**kw), {}
        for i, op in enumerate(_random_ops(random.Random(seed), kw["num_replicas"], steps)):
            if op[0] == "route":
                chosen[i] = router.route(list(op[1]))
                t(f"step {i}: route({list(op[1])}): the replica, the loads, the trees' sizes",
                  [chosen[i], list(router.load), _sizes(router)])
            elif op[0] == "finished":
                router.finished(chosen[op[2]])
                t(f"step {i}: finished(the replica of step {op[2]}): the loads", list(router.load))
            else:
                t(f"step {i}: imbalanced() with loads {list(router.load)}", bool(router.imbalanced()))
    return run


def _told(kw: dict, ops: list, holder: int, prefix: list):
    """``_script`` on a subclass whose ``matched`` is told what the replicas hold (as ``PreciseRouter``'s is, from
    KV events): replica ``holder`` holds every prompt that starts with ``prefix``, the others nothing, whatever the
    router's own trees say. A ``route`` that reads the trees itself instead of calling ``self.matched`` misses it."""
    def matched(self, replica, key):
        key = tuple(key)
        return len(key) if replica == holder and key[: len(prefix)] == tuple(prefix) else 0

    def run(cls, t):
        # (something that is not a class, a stub function say, runs as it is: it fails or is "not written yet")
        told = type(cls.__name__, (cls,), {"matched": matched, "__module__": __name__}) if isinstance(cls, type) else cls
        _script(kw, ops)(told, t)
    return run


A, B = list(range(100, 110)), list(range(200, 210))  # two 10-token "system prompts"


@register("09", "CacheAwareRouter", reference=lambda: CacheAwareRouter, points=6, name="cache_aware_router",
          forbidden=lambda: [CacheAwareRouter, PreciseRouter])
def cases_cache_aware_router(hidden):
    def case(label, kw, ops, hint="", **extra):
        return Case(label, _script(kw, ops), hint, step_hints=STEP_HINTS, **extra)

    if hidden is None:
        three = dict(num_replicas=3, cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5)
        return [
            case("imbalanced: both thresholds", dict(num_replicas=2, balance_abs_threshold=2,
                                                     balance_rel_threshold=1.5),
                 [("imbalanced",), ("route", A), ("route", A), ("imbalanced",), ("route", A), ("imbalanced",),
                  ("finished", 0), ("imbalanced",)]),
            case("the relative threshold holds it back", dict(num_replicas=2, balance_abs_threshold=1,
                                                             balance_rel_threshold=10.0),
                 [("route", A), ("route", B), ("route", A + [1]), ("route", A + [2]), ("route", A + [3]),
                  ("imbalanced",)]),
            case("cold prompts go to the smallest tree", three,
                 [("route", A + [1, 2]), ("route", B + [3]), ("route", [7, 8, 9]), ("route", [5] * 20)]),
            case("a long enough match wins", three,
                 [("route", A + [1, 2]), ("route", B + [3]), ("route", A + [4, 4, 4]), ("route", B + [5, 6]),
                  ("route", A[:2] + [9] * 8)],
                 "the longest match wins only above cache_threshold (2 of 10 tokens is 0.2: the smallest tree)"),
            case("exactly at the threshold is not above it", dict(num_replicas=2, cache_threshold=0.5),
                 [("route", A), ("route", A[:5] + [1] * 5), ("route", A[:6] + [2] * 4)],
                 "the match must be strictly above cache_threshold: 5 of 10 tokens at 0.5 goes to the smallest tree"),
            case("ties go to the lowest index", dict(num_replicas=4), [("route", [1, 2]), ("route", [3]),
                                                                      ("route", [3]), ("route", [1, 2, 5])]),
            case("load beats cache when imbalanced", dict(num_replicas=2, balance_abs_threshold=2,
                                                          balance_rel_threshold=1.5),
                 [("route", A), ("route", A + [1]), ("route", A + [2]), ("route", A + [3]), ("route", A + [4]),
                  ("finished", 1), ("route", A + [5])]),
            case("trees evict down to max_tree_size", dict(num_replicas=1, max_tree_size=12),
                 [("route", A), ("route", B), ("route", A + [1]), ("route", [3] * 30)]),
            Case("route asks self.matched (a subclass told what the replicas hold)",
                 _told(dict(num_replicas=3), [("route", A), ("route", B), ("route", A + [1]), ("route", B + [2]),
                                              ("route", A + [3])], holder=2, prefix=A[:3]),
                 "route must get each replica's match from self.matched(r, key), not from the trees directly: a "
                 "subclass (PreciseRouter, told by the replicas' KV events) replaces matched to say what the "
                 "replicas really hold; here it says replica 2 holds every prompt that starts like A"),
            Case("random workout", _workout(dict(num_replicas=3, cache_threshold=0.3, balance_abs_threshold=2,
                                                  balance_rel_threshold=1.5, max_tree_size=40), 9, 60), "",
                 step_hints=STEP_HINTS, weight=2),
        ]
    r = rng(hidden, 91)
    cases = []
    for k in range(4):
        kw = dict(num_replicas=r.randint(2, 6), cache_threshold=r.choice([0.0, 0.3, 0.5, 0.8]),
                  balance_abs_threshold=r.choice([0, 1, 2, 4, 64]), balance_rel_threshold=r.choice([1.0, 1.5, 3.0]),
                  max_tree_size=r.choice([8, 30, 2**25]))
        cases.append(Case(f"random workout {k}", _workout(kw, r.randrange(10**6), 80), "", step_hints=STEP_HINTS,
                          weight=2))
    return cases


# ---------------------------------------------------------------- the router in the proxy, in front of replicas

SYSTEM_A = [11 + (7 * i) % 40 for i in range(24)]
SYSTEM_B = [60 + (5 * i) % 30 for i in range(24)]
PROXY_PROMPTS = (SYSTEM_A + [1, 2], SYSTEM_A + [3], SYSTEM_B + [4, 5], SYSTEM_A + [6, 7], SYSTEM_B + [8],
                 SYSTEM_B + [9, 9])
PROXY_MAX_TOKENS = 4


def run_through_proxy(router) -> dict:
    return serve_routed(PROXY_PROMPTS, router=router, max_tokens=PROXY_MAX_TOKENS)


def _offline_greedy() -> list[list[int]]:
    return offline_greedy(PROXY_PROMPTS, PROXY_MAX_TOKENS)


SHARED_TOKENS = 24  # each conversation's shared prompt: 6 whole blocks of 4 tokens
WENT = "the replica each of the six requests went to (conversations A, A, B, A, B, B)"
FACTS = ("each replica's prefix-cache hit tokens are 24 for every request that found its conversation there before",
         "every output equals the offline engine's greedy tokens", "the proxy's /health answered 200")


def _hits_follow_routing(went, hits) -> bool:
    seen, want = set(), [0] * len(hits)
    for p, r in zip(PROXY_PROMPTS, went):
        conv = tuple(p[:SHARED_TOKENS])
        if (r, conv) in seen:
            want[r] += SHARED_TOKENS
        seen.add((r, conv))
    return list(hits) == want


def _decisions(cls) -> list[int]:
    """Where ``cls``'s router sends the six prompts, each finished before the next (as the proxy case runs them)."""
    router, went = cls(2), []
    for p in PROXY_PROMPTS:
        went.append(router.route(list(p)))
        router.finished(went[-1])
    return went


def _proxy_expected(hidden):
    return [{"steps": [[WENT, _decisions(CacheAwareRouter)], *[[f, True] for f in FACTS]]}]


@register("09", "CacheAwareRouter", points=1, name="router_in_proxy", expected=_proxy_expected, trace=False,
          expected_uses_reference=True,
          forbidden=lambda: [CacheAwareRouter, PreciseRouter])
def cases_router_in_proxy(hidden):
    def run(cls, t):
        router = cls(2)
        router.route([1, 2, 3])  # an unfinished router raises NotImplementedError here, before any replica starts
        router.finished(0)
        got = run_through_proxy(cls(2))
        if os.environ.get("TINYPAGED_PROBE") != "1":
            print("your router sent the six requests (conversations A, A, B, A, B, B) to replicas "
                  f"{got['went']}; prefix-cache hit tokens per replica: {got['hits']} "
                  f"(24 for each request that found its conversation's shared prompt cached)")
        t(WENT, got["went"])
        t(FACTS[0], _hits_follow_routing(got["went"], got["hits"]))
        t(FACTS[1], got["outputs"] == _offline_greedy())
        t(FACTS[2], got["health"] == 200)

    return [Case("six requests through the proxy, two tiny replicas", run,
                 "a cache-aware router keeps each conversation on one replica, so its shared prompt is computed once")]
