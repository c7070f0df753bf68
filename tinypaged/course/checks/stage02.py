"""Stage 2 checks: the block allocator, block tables, slot mapping, the block-table gather, and decode
attention over a paged cache.

References: the engine's own pieces, which are the lesson's code: ``tinypaged.kv.block_pool.BlockAllocator``
(the free queue of the engine's ``BlockManager`` without prefix caching), ``tinypaged.kv.block_manager.BlockTables``
(its tables), ``tinypaged.attention.backends.slot_mapping``, ``gather_kv`` and ``paged_attention``. The serving
check runs the learner's allocator and tables inside the engine's ``BlockManager`` (``BlockManager.factory``).
"""

from __future__ import annotations

import random

import torch

from tinypaged.attention import backends as attention
from tinypaged.kv.block_manager import BlockManager, BlockTables
from tinypaged.kv.block_pool import BlockAllocator, PrefixCache, blocks_needed
from tinypaged.course.checks import Case, register
from tinypaged.course.checks._util import raises, rng
from tinypaged.course.checks.serving import OneAtATime, serving_check


# ---------------------------------------------------------------- BlockAllocator

def _allocator_workout(seed: int, num_blocks: int, steps: int):
    def run(cls, t):
        r = random.Random(seed)
        a = cls(num_blocks)
        owned = set()
        for step in range(steps):
            if owned and (len(owned) == num_blocks or r.random() < 0.45):
                b = r.choice(sorted(owned))
                a.free(b)
                owned.discard(b)
                t(f"step {step}: free({b}), then num_free", a.num_free)
            else:
                b = t(f"step {step}: allocate()", a.allocate())
                owned.add(b)
    return run


@register("02", "BlockAllocator", reference=lambda: BlockAllocator, points=2, name="block_allocator",
          forbidden=lambda: [BlockAllocator, PrefixCache, BlockManager])
def cases_block_allocator(hidden):
    def fresh(cls, t):
        a = cls(4)
        t("num_free of a fresh BlockAllocator(4)", a.num_free)
        t("4 allocations", [a.allocate() for _ in range(4)])
        t("num_free after allocating every block", a.num_free)
        t("allocate() with no free block raises", raises(a.allocate))

    def order(cls, t):
        a = cls(4)
        for _ in range(4):
            a.allocate()
        a.free(2)
        a.free(0)
        t("num_free after free(2), free(0)", a.num_free)
        t("free(2) again (a double free) raises", raises(lambda: a.free(2)))
        t("the next two allocations: freed blocks come back in the order they were freed", [a.allocate(), a.allocate()])

    if hidden is None:
        return [Case("a fresh allocator", fresh, "ids 0, 1, 2, ... from a FIFO queue; no block twice"),
                Case("free and reuse", order, "freed blocks join the TAIL of the queue"),
                Case("random workout", _allocator_workout(2, 8, 120), weight=2)]
    return [Case(f"random workout {k}", _allocator_workout(hidden * 7 + k, 3 + 5 * k, 150), weight=2)
            for k in range(3)]


# ---------------------------------------------------------------- slot_mapping

@register("02", "slot_mapping", reference=lambda: attention.slot_mapping, points=1,
          forbidden=lambda: [attention.slot_mapping, attention.paged_context_slots, BlockManager])
def cases_slot_mapping(hidden):
    def one(table, positions, bs, label, hint=""):
        return Case(label, lambda f, t: t(f"block table {table}, block_size {bs}, positions {positions}",
                                          [int(s) for s in f(list(table), list(positions), bs)]), hint)

    def randoms(r, n):
        out = []
        for _ in range(n):
            bs = r.choice([1, 2, 4, 16])
            table = r.sample(range(100), 12)
            out.append((table, [r.randrange(12 * bs) for _ in range(20)], bs))
        return out

    if hidden is None:
        many = randoms(random.Random(1), 20)
        return [
            one([7, 2, 9], range(10), 4, "three blocks", "slot = block_table[p // block_size] * block_size + p % block_size"),
            one([5], [0, 1, 2], 16, "one block"),
            one([3, 1], [5, -1, -1], 4, "padding", "a negative position is padding: slot -1"),
            one([4, 0, 2], range(12), 4, "block 0 in the middle"),
            Case("random tables", lambda f, t: [t(f"table {tb}, block_size {bs}, positions {ps}",
                                                  [int(s) for s in f(list(tb), list(ps), bs)]) for tb, ps, bs in many],
                 weight=2),
        ]
    many = randoms(rng(hidden, 21), 30)
    return [Case("random tables", lambda f, t: [t(f"table {tb}, block_size {bs}, positions {ps}",
                                                  [int(s) for s in f(list(tb), list(ps), bs)]) for tb, ps, bs in many],
                 weight=2)]


# ---------------------------------------------------------------- BlockTables

def _tables_workout(seed: int, steps: int):
    def run(cls, t):
        r = random.Random(seed)
        bs = r.choice([1, 2, 4, 16])
        alloc = BlockAllocator(r.randint(4, 20))
        bt = cls(alloc, bs)
        lens: dict = {}
        for step in range(steps):
            op = r.random()
            if lens and op < 0.2:
                sid = r.choice(sorted(lens))
                bt.free(sid)
                del lens[sid]
                t(f"step {step} (block_size {bs}): free({sid!r}), then num_free",
                  [alloc.num_free])
            elif lens and op < 0.35:
                sid = r.choice(sorted(lens))
                pos = list(range(0, lens[sid], max(1, lens[sid] // 5)))
                t(f"step {step}: slots({sid!r}, {pos})", bt.slots(sid, pos))
            else:
                sid = r.choice(sorted(lens) + [f"s{step}"]) if lens else f"s{step}"
                n = lens.get(sid, 0) + r.randint(1, 3 * bs)
                ok = t(f"step {step} (block_size {bs}): allocate_slots({sid!r}, {n})", bt.allocate_slots(sid, n))
                t(f"step {step}: block_ids({sid!r}) and num_free", [bt.block_ids(sid), alloc.num_free])
                if ok:
                    lens[sid] = n
        return [[sid, bt.block_ids(sid)] for sid in sorted(lens)]
    return run


@register("02", "BlockTables", reference=lambda: BlockTables, points=3, name="block_tables",
          forbidden=lambda: [BlockTables, BlockManager, PrefixCache])
def cases_block_tables(hidden):
    def grow(cls, t):
        alloc = BlockAllocator(6)
        bt = cls(alloc, 4)
        t("allocate_slots('x', 1) with block_size 4", bt.allocate_slots("x", 1))
        t("block_ids('x')", bt.block_ids("x"))
        t("allocate_slots('x', 4): 4 tokens still fit in one block", [bt.allocate_slots("x", 4), bt.block_ids("x")])
        t("allocate_slots('x', 5): the 5th token needs a second block", [bt.allocate_slots("x", 5), bt.block_ids("x")])
        t("allocate_slots('y', 9): ceil(9 / 4) = 3 blocks", [bt.allocate_slots("y", 9), bt.block_ids("y")])
        t("block_ids of a sequence that holds nothing", bt.block_ids("nobody"))
        t("allocate_slots('x', 16) needs 2 more blocks, 1 is free", bt.allocate_slots("x", 16))
        t("a failed allocate_slots changes nothing: block_ids('x') and the allocator's num_free",
          [bt.block_ids("x"), alloc.num_free])
        t("allocate_slots('x', 12)", [bt.allocate_slots("x", 12), bt.block_ids("x")])

    def free(cls, t):
        alloc = BlockAllocator(5)
        bt = cls(alloc, 2)
        bt.allocate_slots("a", 5)
        bt.allocate_slots("b", 3)
        t("tables of a (5 tokens) and b (3 tokens), block_size 2", [bt.block_ids("a"), bt.block_ids("b")])
        bt.free("a")
        t("after free('a'): block_ids('a') and num_free", [bt.block_ids("a"), alloc.num_free])
        t("the next three allocations come from a's blocks, freed last block first",
          [alloc.allocate() for _ in range(3)])

    def slots(cls, t):
        alloc = BlockAllocator(8)
        for _ in range(3):
            alloc.allocate()  # blocks 0, 1, 2 belong to someone else
        bt = cls(alloc, 4)
        bt.allocate_slots("s", 10)
        t("slots('s', 0..9): through the table", bt.slots("s", range(10)))

    if hidden is None:
        return [Case("growing tables", grow, "ceil(num_tokens / block_size) blocks; check before you allocate"),
                Case("freeing", free, "free a table's blocks from its last block to its first"),
                Case("slots", slots, "use your slot_mapping"),
                Case("random workout", _tables_workout(5, 40), weight=2)]
    return [Case(f"random workout {k}", _tables_workout(hidden * 13 + k, 60), weight=2) for k in range(3)]


# ---------------------------------------------------------------- gather_kv

@register("02", "gather_kv", reference=lambda: attention.gather_kv, points=2,
          forbidden=lambda: [attention.gather_kv, attention.paged_context_slots])
def cases_gather_kv(hidden):
    def make(seed, num_blocks=10, bs=4, kvh=2, d=3):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(num_blocks, bs, kvh, d, generator=g, dtype=torch.float64)

    def one(table, n, label, as_tensor=False, seed=0, bs=4):
        def run(f, t):
            cache = make(seed, bs=bs)
            tb = torch.tensor(table, dtype=torch.int32) if as_tensor else list(table)
            out = f(cache, tb, n)
            t(f"gather_kv(cache [10, {bs}, 2, 3], table {table}, context_len {n})", out)
        return Case(label, run, "row j is cache[block_table[j // block_size], j % block_size]")

    if hidden is None:
        return [one([7, 2, 9], 10, "three blocks"), one([3], 1, "one token"), one([0, 1], 8, "two full blocks"),
                one([5, 8, 1, 4], 13, "a table longer than needed"),
                one([6, 3, 0], 9, "an int32 tensor table", as_tensor=True)]
    r = rng(hidden, 22)
    cases = []
    for k in range(6):
        bs = r.choice([1, 2, 4])
        n = r.randint(1, 10 * bs // 2)
        table = r.sample(range(10), blocks_needed(n, bs) + r.randint(0, 1))
        cases.append(one(table, n, f"random table {k}", as_tensor=bool(k % 2), seed=hidden + k, bs=bs))
    return cases


# ---------------------------------------------------------------- decode attention over pages

def _kernels():
    from tinypaged import kernels

    return kernels


@register("02", "paged_attention", reference=lambda: attention.paged_attention, points=2,
          name="paged_attention_torch",
          forbidden=lambda: [attention.paged_attention, _kernels().paged_attention_reference,
                             _kernels().gather_then_attend, _kernels().paged_attention_decode,
                             attention.attend_gathered])
def cases_paged_attention(hidden):
    shapes = [(2, 2, 8, 4, [5]), (4, 2, 8, 4, [1, 8, 13]), (6, 2, 16, 8, [20, 3])] if hidden is None else \
        [(9, 3, 16, 4, [hidden % 17 + 1, 9, 30]), (4, 1, 8, 2, [7, hidden % 5 + 1])]

    def one(i, h, kvh, d, bs, lens):
        def run(f, t):
            from tinypaged.lab.kernel_lab import random_paged_batch

            q, kc, vc, tables, seq_lens = random_paged_batch(lens, h, kvh, d, bs, dtype=torch.float64,
                                                             seed=(hidden or 0) + i, pad_block=0)
            kc[0], vc[0] = 30.0, 100.0  # unused table entries point at block 0: reading past the end shows
            out = f(q, kc, vc, tables, seq_lens, d ** -0.5)
            t(f"{h} query heads over {kvh} KV heads, head_dim {d}, block_size {bs}, seq_lens {lens}", out)
        return Case(f"batch {i}", run, "query head h reads KV head h // (num_heads // num_kv_heads); "
                                       "only the first seq_lens[s] tokens count", tol=1e-9)

    return [one(i, *s) for i, s in enumerate(shapes)]


# ---------------------------------------------------------------- serving SmolLM2

def _blocks_back(llm, outs) -> bool:
    kv = llm.llm_engine.kv
    return kv.usage == 0


def _preflight(impl):
    """The kv_cache_manager is the engine's ``BlockManager`` (its seam, ``BlockManager.factory``) built from the
    notebook's BlockAllocator and BlockTables, not the package's."""
    from tinypaged.course.checks import get, reuse_of_reference
    from tinypaged.interfaces import KVCacheSpec

    factory = impl.get("kv_cache_manager")
    if factory is None:
        raise TypeError("plugins needs a kv_cache_manager: BlockManager.factory(BlockAllocator=..., BlockTables=...)")
    kv = factory(KVCacheSpec(num_blocks=4, block_size=4, max_model_len=16))
    for check, part in (("block_allocator", getattr(kv, "allocator", None)),
                        ("block_tables", getattr(kv, "block_tables", None))):
        why = reuse_of_reference(get(check), type(part)) if part is not None else "the manager has none"
        if why:
            raise TypeError(f"the manager's {get(check).target} must be yours: {why}")
    if not isinstance(getattr(kv.block_tables, "tables", None), dict):
        raise TypeError("your BlockTables needs a `tables` dict (seq_id -> block ids): the engine's manager reads it")
    kv.block_tables.allocate_slots("probe", 5)  # an unfinished piece raises NotImplementedError here
    kv.block_tables.slots("probe", range(5))
    kv.block_tables.free("probe")


serving_check("02", "serve_paged", prompts=("Once upon a time", "Paged attention splits the cache into blocks of"),
              max_tokens=8,
              engine_kwargs=dict(block_size=4, num_gpu_blocks_override=16, max_model_len=64, max_num_seqs=2,
                                 dtype="float32", device="cpu",
                                 scheduler_cls=OneAtATime),  # not stage 4's schedule_step, unwritten yet
              preflight=_preflight, adapters=("kv_cache_manager",),
              facts=[("every block was back in the free queue at the end", _blocks_back)],
              uses=("BlockAllocator", "slot_mapping", "BlockTables", "gather_kv", "paged_attention"))
