"""Stage 3 checks: sharing blocks (fork, copy-on-write, freeing) and prefix caching (hash chains, an
LRU free queue with a hash index, the longest cached prefix).

The learner's data structures are plain: a block table is a list of block ids, ``refcounts`` a dict
from block id to the number of tables holding it, ``allocator`` any object with ``allocate() -> int``
and ``free(block_id)``. The references are the engine's own code, which is the lesson's:
``tinypaged.kv.block_manager``'s ``fork``, ``append_slot``, ``free_table`` and ``longest_cached_prefix``,
``tinypaged.kv.block_pool``'s ``hash_chain`` and ``PrefixCache``. The serving check runs the learner's parts
inside the engine's ``BlockManager`` (``BlockManager.factory``).
"""

from __future__ import annotations

import random

from tinypaged.kv.block_manager import BlockManager, BlockTables, append_slot, fork, free_table, longest_cached_prefix
from tinypaged.kv.block_pool import BlockAllocator, PrefixCache, hash_block_tokens, hash_chain
from tinypaged.course.checks import Case, register
from tinypaged.course.checks._util import raises, rng
from tinypaged.course.checks.serving import OneAtATime, serving_check


def _allocator(num_blocks: int, held: int = 0) -> BlockAllocator:
    """The engine's free queue (stage 2's allocator), with its first ``held`` blocks handed out."""
    a = BlockAllocator(num_blocks)
    for _ in range(held):
        a.allocate()
    return a


# ---------------------------------------------------------------- fork

@register("03", "fork", reference=lambda: fork, points=1, name="fork_table",
          forbidden=lambda: [fork, PrefixCache, BlockManager])
def cases_fork(hidden):
    def basic(f, t):
        refs = {3: 1, 7: 1, 1: 2}
        table = [3, 7, 1]
        child = f(table, refs)
        t("fork([3, 7, 1], {3: 1, 7: 1, 1: 2}): the child's table", child)
        t("the refcounts after the fork", refs)
        t("the parent's table after the fork", table)
        child.append(9)
        t("the parent's table after the child appends 9 (the child must own a new list)", table)
        t("fork of an empty table", f([], {}))

    def randoms(seed):
        def run(f, t):
            r = random.Random(seed)
            refs = {b: r.randint(1, 3) for b in range(20)}
            for k in range(10):
                table = r.sample(range(20), r.randint(0, 6))
                t(f"fork({table}) and the refcounts", [f(list(table), refs), dict(sorted(refs.items()))])
        return run

    if hidden is None:
        return [Case("basic", basic, "share, don't copy: the same ids in a new list, each count + 1"),
                Case("random tables", randoms(3))]
    return [Case("random tables", randoms(hidden), weight=2)]


# ---------------------------------------------------------------- append_slot

def _cow_workout(seed: int, steps: int, bs: int):
    def run(fn, t):
        r = random.Random(seed)
        alloc, refs = _allocator(400), {}
        tables, lens = [[]], [0]
        for step in range(steps):
            i = r.randrange(len(lens))
            if r.random() < 0.15 and len(lens) < 6:
                tables.append(fork(tables[i], refs))
                lens.append(lens[i])
                continue
            out = fn(tables[i], lens[i], bs, refs, alloc)
            t(f"step {step}: append_slot(table {i}, position {lens[i]}, block_size {bs}) returns, then the table "
              f"and the refcounts", [out, tables[i], dict(sorted(refs.items()))])
            lens[i] += 1
    return run


@register("03", "append_slot", reference=lambda: append_slot, points=3,
          forbidden=lambda: [append_slot, PrefixCache, BlockManager])
def cases_append_slot(hidden):
    def private(fn, t):
        alloc, refs, table = _allocator(8), {}, []
        t("a private table writes positions 0..5 (block_size 4): what append_slot returns",
          [fn(table, n, 4, refs, alloc) for n in range(6)])
        t("its table and refcounts", [table, refs])

    def shared(fn, t):
        alloc, refs, table = _allocator(8), {}, []
        for n in range(6):
            append_slot(table, n, 4, refs, alloc)
        child = fork(table, refs)  # both hold 6 tokens; block 1 is shared and partly filled
        t("the child writes position 6 into shared, partly filled block 1", fn(child, 6, 4, refs, alloc))
        t("the child's table and the refcounts", [child, refs])
        t("the parent, now block 1's only holder, writes position 6", fn(table, 6, 4, refs, alloc))
        t("the parent's table and the refcounts", [table, refs])
        child2 = fork(table, refs)  # both hold 7 tokens: block 1 is shared again
        t("the parent writes position 7, then its child writes position 7",
          [fn(table, 7, 4, refs, alloc), fn(child2, 7, 4, refs, alloc)])
        t("position 8 starts a new block in each table: nothing to copy",
          [fn(table, 8, 4, refs, alloc), fn(child2, 8, 4, refs, alloc)])
        t("tables and refcounts: full blocks stay shared", [table, child2, dict(sorted(refs.items()))])

    if hidden is None:
        return [Case("a private table", private, "take a block when a position starts one; nothing to copy"),
                Case("copy-on-write", shared, "a shared, partly filled last block is copied to a fresh one before "
                                              "writing; the writer's reference moves to the copy"),
                Case("random workout", _cow_workout(3, 150, 4), weight=2)]
    r = rng(hidden, 31)
    return [Case(f"random workout {k}", _cow_workout(hidden * 5 + k, 200, r.choice([1, 2, 3, 4, 16])), weight=2)
            for k in range(3)]


# ---------------------------------------------------------------- free_table

@register("03", "free_table", reference=lambda: free_table, points=1,
          forbidden=lambda: [free_table, PrefixCache, BlockManager])
def cases_free_table(hidden):
    def basic(fn, t):
        alloc = _allocator(7, held=7)
        refs = {4: 1, 5: 2, 6: 1}
        table = [4, 5, 6]
        fn(table, refs, alloc)
        t("free_table([4, 5, 6], {4: 1, 5: 2, 6: 1}): the allocator's free queue", list(alloc.queue))
        t("the refcounts", refs)
        t("the freed table", table)

    def randoms(seed):
        def run(fn, t):
            r = random.Random(seed)
            alloc, refs = _allocator(60), {}
            tables = []
            for _ in range(5):
                tb = []
                for n in range(r.randint(1, 12)):
                    append_slot(tb, n, 2, refs, alloc)
                tables.append(tb)
                if r.random() < 0.6:
                    tables.append(fork(tb, refs))
            r.shuffle(tables)
            for k, tb in enumerate(tables):
                fn(tb, refs, alloc)
                t(f"after freeing table {k}: the free queue's last 8 and the refcounts",
                  [list(alloc.queue)[-8:], dict(sorted(refs.items()))])
        return run

    if hidden is None:
        return [Case("basic", basic, "tail first; a block goes back only when nobody holds it"),
                Case("random tables", randoms(4))]
    return [Case("random tables", randoms(hidden), weight=2)]


# ---------------------------------------------------------------- hash_chain

@register("03", "hash_chain", reference=lambda: hash_chain, points=1,
          forbidden=lambda: [hash_chain, BlockManager])
def cases_hash_chain(hidden):
    def basic(fn, t):
        toks = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
        t("hash_chain(10 tokens, block_size 4): two full blocks, as hex", fn(toks, 4))
        t("the same second block after a different first block", fn([0, 0, 0, 0, 9, 10, 11, 12], 4))
        t("fewer tokens than a block", fn([1, 2, 3], 4))

    def keys(fn, t):
        toks = [5, 6, 7, 8, 9, 10, 11, 12]
        t("extra_keys='tenant-1' (a cache salt) goes into every block's hash", fn(toks, 4, "tenant-1"))
        t("known=[the first block's hash]: kept, the second block chained after it",
          fn(toks, 4, None, hash_chain(toks[:4], 4)))
        t("known=[a made-up hash]: kept as given, not recomputed", fn(toks, 4, None, [bytes(32)]))

    def randoms(seed, n):
        def run(fn, t):
            r = random.Random(seed)
            for _ in range(n):
                toks = [r.randrange(5) for _ in range(r.randrange(30))]
                bs = r.choice([1, 2, 3, 16])
                t(f"hash_chain({toks}, {bs})", fn(toks, bs))
        return run

    if hidden is None:
        return [Case("basic", basic, "hash i = hash_block_tokens(hash i-1 (None for the first), block i's tokens); "
                                     "a partial block gets no hash"),
                Case("extra keys and known hashes", keys, "pass extra_keys to every hash_block_tokens; start after "
                                                          "the known hashes, chaining from the last of them"),
                Case("random token lists", randoms(1, 20))]
    return [Case("random token lists", randoms(hidden, 30), weight=2)]


# ---------------------------------------------------------------- PrefixCache

def _cache_workout(seed: int, steps: int, num_blocks: int):
    def run(cls, t):
        r = random.Random(seed)
        c = cls(num_blocks)
        held: list[int] = []
        hashed: set[int] = set()  # blocks registered since they were allocated (a full block is registered once)
        hashes = [hash_block_tokens(None, [k]) for k in range(12)]
        for step in range(steps):
            op = r.random()
            if held and op < 0.3:
                b = held.pop(r.randrange(len(held)))
                c.free(b)
                t(f"step {step}: free({b}), then num_free", c.num_free)
            elif op < 0.5:
                h = r.randrange(len(hashes))
                got = t(f"step {step}: lookup(hash {h})", c.lookup(hashes[h]))
                if got is not None and r.random() < 0.7:
                    c.touch(got)
                    held.append(got)
                    hashed.add(got)
                    t(f"step {step}: touch({got}), then ref_count and num_free", [c.ref_count(got), c.num_free])
            elif op < 0.65 and set(held) - hashed:
                b = r.choice(sorted(set(held) - hashed))
                h = r.randrange(len(hashes))
                c.register(b, hashes[h])
                hashed.add(b)
                t(f"step {step}: register({b}, hash {h}), then lookup(hash {h})", c.lookup(hashes[h]))
            elif c.num_free:
                b = t(f"step {step}: allocate()", c.allocate())
                held.append(b)
                hashed.discard(b)
                t(f"step {step}: ref_count({b})", c.ref_count(b))
        t("lookup of every hash at the end", [c.lookup(h) for h in hashes])
    return run


@register("03", "PrefixCache", reference=lambda: PrefixCache, points=4, name="prefix_cache",
          forbidden=lambda: [PrefixCache, BlockAllocator, BlockTables, BlockManager])
def cases_prefix_cache(hidden):
    h = [hash_block_tokens(None, [k]) for k in range(6)]

    def lru(cls, t):
        c = cls(4)
        blocks = [c.allocate() for _ in range(4)]
        t("4 allocations from a fresh PrefixCache(4)", blocks)
        for b, hh in zip(blocks, h):
            c.register(b, hh)
        t("lookup of the 4 registered hashes while in use", [c.lookup(x) for x in h[:4]])
        for b in (2, 0, 3):
            c.free(b)
        t("after free(2), free(0), free(3): num_free, and lookups still hit (freed blocks stay cached)",
          [c.num_free, [c.lookup(x) for x in h[:4]]])
        t("allocate() evicts the least recently freed block", c.allocate())
        t("its old hash is stale now: lookup of every hash", [c.lookup(x) for x in h[:4]])

    def touch(cls, t):
        c = cls(3)
        a, b = c.allocate(), c.allocate()
        c.register(a, h[0])
        c.free(a)
        t("a freed, cached block: num_free and ref_count", [c.num_free, c.ref_count(a)])
        c.touch(a)
        t("touch() on a hit takes it out of the free queue: num_free and ref_count", [c.num_free, c.ref_count(a)])
        t("the next allocation cannot be the touched block", c.allocate())
        c.touch(b)
        t("touch() on a block in use: its ref_count", c.ref_count(b))
        c.free(b)
        t("one free(): still held once", [c.ref_count(b), c.num_free])

    def errors(cls, t):
        c = cls(2)
        x = c.allocate()
        c.free(x)
        t("freeing a free block raises", raises(lambda: c.free(x)))
        c.allocate(), c.allocate()
        t("allocate() with nothing free raises", raises(c.allocate))

    def duplicate(cls, t):
        c = cls(3)
        a, b = c.allocate(), c.allocate()
        c.register(a, h[1])
        c.register(b, h[1])  # two requests computed the same block in one step
        t("two blocks registered under one hash: lookup returns the first", c.lookup(h[1]))
        c.free(a)
        t("the first is freed, then the next two allocations (the second evicts it)", [c.allocate(), c.allocate()])
        t("the other block still holds the prefix: lookup finds it", c.lookup(h[1]))

    if hidden is None:
        return [Case("LRU and stale hashes", lru, "allocation takes the head of the free queue and forgets that "
                                                  "block's hash; freed blocks keep theirs"),
                Case("hits take blocks out of the queue", touch),
                Case("errors", errors),
                Case("one hash, two blocks", duplicate, "the index maps a hash to every block holding it; lookup "
                                                          "returns the first registered that still does"),
                Case("random workout", _cache_workout(6, 120, 6), weight=2)]
    return [Case(f"random workout {k}", _cache_workout(hidden * 11 + k, 150, 3 + 3 * k), weight=2) for k in range(3)]


# ---------------------------------------------------------------- longest_cached_prefix

class _Index:
    """A read-only cache for the lookup check: ``lookup(hash)`` from a dict."""

    def __init__(self, index):
        self.index = dict(index)

    def lookup(self, block_hash):
        return self.index.get(block_hash)


@register("03", "longest_cached_prefix", reference=lambda: longest_cached_prefix, points=2,
          forbidden=lambda: [longest_cached_prefix, PrefixCache, BlockManager])
def cases_longest_cached_prefix(hidden):
    bs = 4
    cached = list(range(100, 112))  # a 12-token prompt computed into blocks 20, 21, 22

    def index(blocks=(20, 21, 22)):
        """The cache holding ``blocks`` of the prompt, built when a case runs: its hashes come from hash_chain (in
        the student edition, the learner's own; the block ids the lookup returns do not depend on the hashes)."""
        return {h: b for h, b in zip(hash_chain(cached, bs), [20, 21, 22]) if b in blocks}

    def one(tokens, label, blocks=(20, 21, 22), hint=""):
        return Case(label, lambda f, t: t(f"longest_cached_prefix({tokens}, {bs}, cache of blocks "
                                          f"{sorted(blocks)})", f(list(tokens), bs, _Index(index(blocks)))), hint)

    def salted(f, t):
        salted_index = _Index(zip(hash_chain(cached, bs, "tenant-1"), [30, 31, 32]))
        t("the cached prompt + [7] under extra_keys='tenant-1' (blocks 30, 31, 32 hold it)",
          f(cached + [7], bs, salted_index, "tenant-1"))
        t("the same prompt without extra keys", f(cached + [7], bs, salted_index))

    if hidden is None:
        return [
            one(cached[:8] + [1, 2, 3, 4, 5], "two blocks match"),
            one(cached + [7], "a longer prompt hits all three"),
            one(cached, "the same prompt again", hint="capped at len - 1 tokens: one token must run through the model"),
            one(cached[:3], "shorter than a block"),
            one([0] + cached[1:], "a different first block", hint="the chain: nothing after a miss can hit"),
            one(cached + [7], "a missing middle block", (20, 22)),
            Case("extra keys", salted, "hash the prompt with the same extra_keys"),
        ]
    r = rng(hidden, 33)
    cases = []
    for k in range(8):
        toks = cached[: r.randint(0, 12)] + [r.randrange(3) for _ in range(r.randint(0, 9))]
        if not toks:
            toks = [1]
        drop = r.choice([None, 20, 21, 22])
        cases.append(one(toks, f"random prompt {k}", tuple(b for b in (20, 21, 22) if b != drop)))
    return cases


# ---------------------------------------------------------------- serving SmolLM2

def _hits(llm, outs) -> bool:
    return outs[2].metrics.num_cached_tokens > 0


_PARTS = {"PrefixCache": "prefix_cache", "fork": "fork_table", "append_slot": "append_slot",
          "free_table": "free_table", "hash_chain": "hash_chain", "longest_cached_prefix": "longest_cached_prefix"}


def _preflight(impl):
    """The kv_cache_manager is the engine's ``BlockManager`` (its seam, ``BlockManager.factory``) built from the
    notebook's PrefixCache, fork, append_slot, free_table, hash_chain and longest_cached_prefix."""
    from tinypaged.course.checks import get, reuse_of_reference
    from tinypaged.interfaces import KVCacheSpec

    factory = impl.get("kv_cache_manager")
    if factory is None:
        raise TypeError("plugins needs a kv_cache_manager: BlockManager.factory(PrefixCache=..., fork=..., ...)")
    kv = factory(KVCacheSpec(num_blocks=4, block_size=4, max_model_len=16, enable_prefix_caching=True))
    parts = getattr(kv, "parts", None)
    for part, check in _PARTS.items():
        why = reuse_of_reference(get(check), getattr(parts, part, None)) if parts is not None else "no parts"
        if why:
            raise TypeError(f"the manager's {part} must be yours: {why}")
    cache = kv.allocator  # an unfinished piece raises NotImplementedError here, before the model loads
    table = kv.parts.fork([], {})
    kv.parts.append_slot(table, 0, 4, {}, cache)
    kv.parts.free_table(table, {table[0]: 1}, cache)
    cache.register(cache.allocate(), b"probe")
    kv.parts.longest_cached_prefix([1, 2, 3, 4, 5], 4, cache)


_SYSTEM = "You are a helpful assistant."
serving_check("03", "serve_prefix_cache",
              prompts=(f"{_SYSTEM} The capital of France is", f"{_SYSTEM} Name three fruits:",
                       f"{_SYSTEM} The capital of France is"),
              max_tokens=8,
              engine_kwargs=dict(block_size=4, num_gpu_blocks_override=8, max_model_len=64, max_num_seqs=1,
                                 enable_prefix_caching=True, dtype="float32", device="cpu",
                                 scheduler_cls=OneAtATime),  # not stage 4's schedule_step, unwritten yet
              preflight=_preflight, adapters=("kv_cache_manager",),
              facts=[("the third request found its prefix in the cache", _hits)],
              uses=("append_slot", "free_table", "hash_chain", "PrefixCache", "longest_cached_prefix"))
