"""Stage 1 checks: reservation policies, free holes, first-fit, and a contiguous allocator with accounting.

References: the engine's own ``tinypaged.kv.contiguous`` (``reservation_tokens``, ``free_holes``, ``first_fit``
and ``ContiguousAllocator``, the allocator inside the engine's ``ContiguousKVManager``). The serving check runs
the engine's ``ContiguousKVManager`` over the notebook's allocator and reservation (``ContiguousKVManager.factory``).
"""

from __future__ import annotations

import random

from tinypaged.kv import contiguous
from tinypaged.course.checks import Case, register
from tinypaged.course.checks._util import raised, raises, rng
from tinypaged.course.checks.serving import OneAtATime, serving_check


# ---------------------------------------------------------------- reservation_tokens

@register("01", "reservation_tokens", reference=lambda: contiguous.reservation_tokens, points=1)
def cases_reservation_tokens(hidden):
    def table(policy, pairs, mml):
        return lambda f, t: t(f"policy {policy!r}, max_model_len {mml}: final_len {[p for p in pairs]}",
                              [f(policy, n, mml) for n in pairs])

    if hidden is None:
        return [
            Case("max", table("max", [1, 7, 100, 2048], 2048), "'max' reserves max_model_len whatever the request"),
            Case("max, short model", table("max", [30], 512)),
            Case("pow2", table("pow2", [1, 2, 3, 5, 64, 65, 300, 1025], 2048),
                 "the smallest power of two >= final_len"),
            Case("pow2, capped", table("pow2", [300], 400), "never more than max_model_len"),
            Case("oracle", table("oracle", [1, 17, 300, 2048], 2048)),
            Case("oracle, capped", table("oracle", [3000], 2048), "never more than max_model_len"),
            Case("unknown policy", lambda f, t: t("reservation_tokens('best-guess', 10, 2048) raises",
                                                  raised(lambda: f("best-guess", 10, 2048))),
                 "an unknown policy must raise ValueError"),
        ]
    r = rng(hidden, 11)
    triples = [(r.choice(["max", "pow2", "oracle"]), r.randint(1, 5000), r.choice([100, 512, 1000, 2048, 4096]))
               for _ in range(120)]
    return [Case("random policies and lengths",
                 lambda f, t: t(f"120 random (policy, final_len, max_model_len), e.g. {triples[:2]}",
                                [f(p, n, m) for p, n, m in triples]), weight=2)]


# ---------------------------------------------------------------- free_holes

def _random_regions(r: random.Random, capacity: int) -> list[tuple[int, int]]:
    regions, cursor = [], r.randrange(0, 3)
    while cursor < capacity:
        size = r.randrange(1, 6)
        if cursor + size > capacity:
            break
        regions.append((cursor, size))
        cursor += size + r.choice((0, 0, 1, 2, 5))
    return regions


def _random_holes(r: random.Random, capacity: int) -> list[tuple[int, int]]:
    """Free holes ((start, size), in address order, never touching) of an arena of ``capacity`` slots, drawn as
    data: first_fit's cases need no free_holes (in the student edition it is the learner's, maybe unwritten)."""
    holes, cursor = [], r.choice((0, 0, 1, 3))
    while cursor < capacity:
        size = r.randrange(1, 9)
        if cursor + size > capacity:
            if r.random() < 0.5:  # the arena's tail: free up to its end
                holes.append((cursor, capacity - cursor))
            break
        holes.append((cursor, size))
        cursor += size + r.randrange(1, 7)  # a region in use between two holes
    return holes


@register("01", "free_holes", reference=lambda: contiguous.free_holes, points=1)
def cases_free_holes(hidden):
    def one(regions, capacity, label):
        return Case(label, lambda f, t: t(f"free_holes({regions}, {capacity})", f(list(regions), capacity)))

    if hidden is None:
        r = random.Random(1)
        randoms = [(_random_regions(r, c), c) for c in (r.randrange(1, 40) for _ in range(100))]
        return [
            one([], 10, "empty arena"),
            one([(0, 10)], 10, "full arena"),
            one([(0, 4), (4, 6)], 10, "adjacent regions"),
            one([(2, 3)], 10, "one region in the middle"),
            one([(0, 2), (5, 1), (8, 2)], 10, "holes between regions"),
            Case("100 random arenas", lambda f, t: [t(f"free_holes({g}, {c})", f(list(g), c)) for g, c in randoms],
                 weight=2),
        ]
    r = rng(hidden, 12)
    randoms = [(_random_regions(r, c), c) for c in (r.randrange(1, 200) for _ in range(60))]
    return [one([(5, 5)], 5 + 5, "a region at the very end"),
            Case("random arenas", lambda f, t: [t(f"free_holes({g}, {c})", f(list(g), c)) for g, c in randoms],
                 weight=2)]


# ---------------------------------------------------------------- first_fit

@register("01", "first_fit", reference=lambda: contiguous.first_fit, points=1)
def cases_first_fit(hidden):
    holes = [(0, 2), (5, 8), (20, 3), (30, 10)]

    def one(h, size, label, hint=""):
        return Case(label, lambda f, t: t(f"first_fit({h}, {size})", f(list(h), size)), hint)

    if hidden is None:
        r = random.Random(2)
        randoms = []
        for _ in range(100):
            c = r.randrange(1, 60)
            randoms.append((_random_holes(r, c), r.randrange(1, 8)))
        return [
            one(holes, 1, "size 1"),
            one(holes, 2, "a hole of exactly the size"),
            one(holes, 3, "skip a hole that is too small"),
            one(holes, 9, "only the last hole fits"),
            one([(0, 10), (20, 3)], 3, "first-fit, not best-fit", "take the FIRST hole that fits, not the tightest"),
            one(holes, 11, "no hole large enough", "None, although 23 slots are free in total"),
            one([], 1, "no holes at all"),
            Case("100 random hole lists", lambda f, t: [t(f"first_fit({h}, {s})", f(list(h), s)) for h, s in randoms],
                 weight=2),
        ]
    r = rng(hidden, 13)
    randoms = []
    for _ in range(60):
        c = r.randrange(1, 300)
        randoms.append((_random_holes(r, c), r.randrange(1, 12)))
    return [Case("random hole lists", lambda f, t: [t(f"first_fit({h}, {s})", f(list(h), s)) for h, s in randoms],
                 weight=2)]


# ---------------------------------------------------------------- the allocator

def _workout(seed: int, steps: int, capacity: int):
    """A random sequence of allocate / free / slot / usage calls, recorded step by step."""

    def run(cls, t):
        r = random.Random(seed)
        policy = r.choice(["max", "pow2", "oracle"])
        mml = r.choice([16, 64, 100])
        a = cls(capacity, policy, mml)
        live: dict = {}
        for i in range(steps):
            op = r.random()
            if live and op < 0.3:
                sid = r.choice(sorted(live))
                a.free(sid)
                del live[sid]
                t(f"step {i}: free({sid}), then holes()", a.holes())
            elif live and op < 0.45:
                sid = r.choice(sorted(live))
                pos = r.randrange(live[sid])
                t(f"step {i}: slot({sid}, {pos})", a.slot(sid, pos))
            elif live and op < 0.55:
                written = {sid: r.randint(0, n) for sid, n in live.items()}
                t(f"step {i}: usage({written})", a.usage(written))
            else:
                sid, final = f"s{i}", r.randint(1, mml + 20)
                start = t(f"step {i} ({policy!r}, max_model_len {mml}): allocate({sid!r}, {final})",
                          a.allocate(sid, final))
                if start is not None:
                    live[sid] = min(final, mml)
        t("holes() at the end", a.holes())

    return run


@register("01", "ContiguousAllocator", reference=lambda: contiguous.ContiguousAllocator, points=4,
          forbidden=lambda: [contiguous.ContiguousAllocator, contiguous.ContiguousKVManager])
def cases_contiguous_allocator(hidden):
    def placement(cls, t):
        a = cls(100, "oracle", 64)
        t("a fresh arena of 100: holes()", a.holes())
        t("allocate('a', 30)", a.allocate("a", 30))
        t("allocate('b', 20)", a.allocate("b", 20))
        t("allocate('c', 40)", a.allocate("c", 40))
        t("holes() with a, b, c placed", a.holes())
        a.free("b")
        t("holes() after free('b')", a.holes())
        t("allocate('d', 25): 30 slots are free, but in two holes", a.allocate("d", 25))
        t("allocate('e', 8): first-fit takes the first hole, not the tightest", a.allocate("e", 8))
        t("holes() at the end", a.holes())

    def policies(cls, t):
        a = cls(4096, "max", 2048)
        t("'max', max_model_len 2048, arena 4096: allocate('a', 10)", a.allocate("a", 10))
        t("allocate('b', 10)", a.allocate("b", 10))
        t("allocate('c', 10): the arena is full of reservations", a.allocate("c", 10))
        p = cls(64, "pow2", 64)
        t("'pow2', arena 64: allocate('a', 10), allocate('b', 17), allocate('c', 3), allocate('d', 20)",
          [p.allocate("a", 10), p.allocate("b", 17), p.allocate("c", 3), p.allocate("d", 20)])
        o = cls(64, "oracle", 32)
        t("'oracle', max_model_len 32: allocate('a', 50) reserves 32", [o.allocate("a", 50), o.holes()])

    def slots(cls, t):
        a = cls(50, "oracle", 50)
        a.allocate("x", 5)
        a.allocate("y", 10)
        t("slots of y's positions 0..9", [a.slot("y", p) for p in range(10)])
        t("slot('y', 10) is past y's reservation of 10: raises", raises(lambda: a.slot("y", 10)))

    def accounting(cls, t):
        a = cls(100, "pow2", 64)
        a.allocate("a", 20)   # reserves 32
        a.allocate("b", 5)    # reserves 8
        t("allocate('c', 64): 64 slots, 60 left", a.allocate("c", 64))
        t("usage({'a': 12, 'b': 5}): a reserved 32 for 20, b 8 for 5", a.usage({"a": 12, "b": 5}))
        a.free("a")
        t("usage({'b': 3}) after free('a')", a.usage({"b": 3}))

    def errors(cls, t):
        a = cls(20, "oracle", 20)
        a.allocate("a", 5)
        t("allocate('a', 5) again while 'a' holds a region: raises", raises(lambda: a.allocate("a", 5)))
        t("a failed allocate changes nothing: allocate('big', 20), then holes()", [a.allocate("big", 20), a.holes()])

    if hidden is None:
        return [
            Case("first-fit placement", placement, "regions are placed at the first hole that fits; they never move"),
            Case("reservation policies", policies, "each region's size comes from reservation_tokens"),
            Case("slots", slots, "slot = region start + position"),
            Case("accounting", accounting,
                 "reservation_waste: reserved for tokens not written yet (up to the final length); "
                 "internal_fragmentation: reserved beyond the final length"),
            Case("errors", errors),
            Case("random workout", _workout(7, 60, 160), weight=2),
        ]
    return [Case(f"random workout {k}", _workout(hidden * 31 + k, 80, 200 + 50 * k), weight=2) for k in range(3)]


# ---------------------------------------------------------------- serving SmolLM2

def _preflight(impl):
    """The plug-in is the package's seam (``ContiguousKVManager.factory``): the allocator inside the engine's
    manager must be the notebook's ContiguousAllocator and its reservation the notebook's reservation_tokens
    (not the package's, nor a wrapper around them)."""
    from tinypaged.course.checks import get, reuse_of_reference
    from tinypaged.interfaces import KVCacheSpec

    factory = impl.get("kv_cache_manager") if isinstance(impl, dict) else None
    if factory is None:
        raise TypeError("plugins needs a kv_cache_manager built on your ContiguousAllocator")
    kv = factory(KVCacheSpec(num_blocks=64, block_size=1, max_model_len=32, reservation_policy="pow2"))
    allocator = getattr(kv, "allocator", None)
    why = reuse_of_reference(get("contiguous_allocator"), type(allocator)) if allocator is not None \
        else "the manager has no allocator"
    if why:
        raise TypeError(f"the manager's allocator must be your ContiguousAllocator: {why}")
    reservation = getattr(kv, "reservation", None)
    why = reuse_of_reference(get("reservation_tokens"), reservation) if callable(reservation) \
        else f"its reservation is {reservation!r}"
    if why:
        raise TypeError(f"the manager must size regions with your reservation_tokens: {why}")
    allocator.allocate("preflight", 5)  # an unfinished piece raises NotImplementedError here, before the model loads
    allocator.slot("preflight", 0)
    allocator.usage({})
    allocator.free("preflight")


def _regions_released(llm, outs) -> bool:
    return llm.llm_engine.kv.usage == 0 and llm.llm_engine.kv.allocator.usage({})["reserved"] == 0


serving_check("01", "serve_contiguous", prompts=("The capital of France is", "def fibonacci(n):"), max_tokens=8,
              engine_kwargs=dict(reservation_policy="pow2", kv_cache_tokens=256,
                                 max_model_len=64, max_num_seqs=2, dtype="float32", device="cpu",
                                 scheduler_cls=OneAtATime),  # not stage 4's schedule_step, unwritten yet
              preflight=_preflight, adapters=("kv_cache_manager",),
              facts=[("every region was released at the end (usage 0)", _regions_released)],
              uses=("reservation_tokens", "free_holes", "first_fit", "ContiguousAllocator"))
