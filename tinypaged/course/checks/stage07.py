"""Stage 7 checks: a token-granular radix tree (match with splits, insert, LRU leaf eviction under lock
references) and the longest-prefix-match order, then both serving SmolLM2 through the engine's seams.

The reference tree is ``tinypaged.radix_cache.RadixCache`` with ``page_size=1``; the learner's class has
the same interface (``match_prefix``, ``insert``, ``evict``, ``inc_lock_ref``/``dec_lock_ref``,
``evictable_size``/``protected_size``, ``root`` of nodes with ``key``, ``value``, ``lock_ref``,
``children``). A case records what the calls return and the tree's shape, never node identities.
"""

from __future__ import annotations

import random

from tinypaged.course.checks import Case, register
from tinypaged.course.checks._util import rng
from tinypaged.course.checks.serving import serving_check
from tinypaged.radix_cache import RadixCache, RadixKVManager
from tinypaged.radix_policy import CacheAwareOrder, longest_prefix_first


def lpm_order(seqs: list, cached_tokens, fcfs_above: int = 128) -> list:
    """SGLang's ``lpm``: longest cached prefix first (stable); arrival order above ``fcfs_above`` requests."""
    if len(seqs) > fcfs_above:
        return list(seqs)
    return longest_prefix_first(seqs, cached_tokens)


def shape(tree) -> list:
    """The tree as nested lists ``[key, pages, lock_ref, children...]``, children by first token."""
    def walk(node):
        kids = sorted(node.children.values(), key=lambda c: tuple(c.key))
        return [list(node.key), list(node.value), node.lock_ref, *[walk(c) for c in kids]]
    return [walk(c) for c in sorted(tree.root.children.values(), key=lambda c: tuple(c.key))]


def _sizes(tree) -> list[int]:
    return [tree.evictable_size, tree.protected_size]


# ---------------------------------------------------------------- the tree

def _workout(seed: int, steps: int):
    def run(cls, t):
        r = random.Random(seed)
        tree = cls()
        prefixes = [[r.randrange(1, 5) for _ in range(r.randint(2, 8))] for _ in range(4)]
        next_page, locks = 100, []
        for step in range(steps):
            op = r.random()
            key = r.choice(prefixes)[: r.randint(0, 8)] + [r.randrange(1, 4) for _ in range(r.randint(0, 4))]
            if op < 0.35 and key:
                pages = list(range(next_page, next_page + len(key)))
                next_page += len(key)
                t(f"step {step}: insert({key}, pages {pages[0]}..) returns, then the sizes",
                  [tree.insert(key, pages), _sizes(tree)])
            elif op < 0.6:
                pages, node = tree.match_prefix(key)
                t(f"step {step}: match_prefix({key}): pages and the matched node's key", [pages, list(node.key)])
                if r.random() < 0.5:
                    tree.inc_lock_ref(node)
                    locks.append(node)
                    t(f"step {step}: lock it: sizes", _sizes(tree))
            elif op < 0.75 and locks:
                tree.dec_lock_ref(locks.pop(r.randrange(len(locks))))
                t(f"step {step}: unlock a locked node: sizes", _sizes(tree))
            else:
                n = r.randint(1, 10)
                t(f"step {step}: evict({n}) frees (sorted), then the sizes", [sorted(tree.evict(n)), _sizes(tree)])
        t("the tree at the end", shape(tree))
    return run


@register("07", "RadixTree", reference=lambda: RadixCache, points=6, name="radix_tree",
          forbidden=lambda: [RadixCache, RadixKVManager])
def cases_radix_tree(hidden):
    def split(cls, t):
        tree = cls()
        t("insert([1, 2, 3, 4, 5], pages [10..14]) into an empty tree", tree.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]))
        pages, node = tree.match_prefix([1, 2, 3, 9])
        t("match_prefix([1, 2, 3, 9]): pages, the node's key", [pages, list(node.key)])
        t("the tree after the match (it split the edge after 3 tokens)", shape(tree))
        t("match_prefix([7]) and match_prefix([]): pages, the node's key",
          [[p, list(n.key)] for p, n in (tree.match_prefix([7]), tree.match_prefix([]))])
        t("the sizes: evictable, protected", _sizes(tree))

    def share(cls, t):
        tree = cls()
        tree.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
        t("insert([1, 2, 3, 7, 7], pages [20..24]) returns the tokens already cached",
          tree.insert([1, 2, 3, 7, 7], [20, 21, 22, 23, 24]))
        t("the tree (it keeps its own pages for 1, 2, 3)", shape(tree))
        t("insert([1, 2], pages [30, 31]): cached already", tree.insert([1, 2], [30, 31]))
        t("the tree (a match that ends inside an edge splits it)", shape(tree))
        t("match_prefix([1, 2, 3, 7, 7, 7]): pages", tree.match_prefix([1, 2, 3, 7, 7, 7])[0])
        t("the sizes", _sizes(tree))

    def locks(cls, t):
        tree = cls()
        tree.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
        tree.insert([1, 2, 3, 7, 7], [20, 21, 22, 23, 24])
        _, node = tree.match_prefix([1, 2, 3, 4, 5])
        tree.inc_lock_ref(node)
        t("lock the node of [1, 2, 3, 4, 5]: sizes", _sizes(tree))
        t("evict(100) frees only the unlocked leaf (sorted pages)", sorted(tree.evict(100)))
        t("the tree and the sizes", [shape(tree), _sizes(tree)])
        tree.dec_lock_ref(node)
        t("unlock: sizes", _sizes(tree))
        t("evict(1) frees a whole leaf: [4, 5]'s pages", sorted(tree.evict(1)))
        t("evict(1) again: the parent became a leaf", sorted(tree.evict(1)))
        t("the empty tree and its sizes; evict(5) on it", [shape(tree), _sizes(tree), tree.evict(5)])

    def lru(cls, t):
        tree = cls()
        tree.insert([1, 1], [0, 1])
        tree.insert([2, 2], [2, 3])
        tree.insert([3, 3], [4, 5])
        tree.match_prefix([1, 1, 9])  # [1, 1] is now the most recently used
        t("evict(2) takes the least recently used leaf", sorted(tree.evict(2)))
        t("evict(2) next", sorted(tree.evict(2)))
        t("what is left", shape(tree))

    if hidden is None:
        return [Case("a match ends inside an edge", split, "split the node: a new parent holds the matched part "
                                                           "and inherits lock_ref and last_access"),
                Case("insert shares a prefix", share, "walk as match does; return the cached length; new leaf for "
                                                      "the rest with the caller's pages for those tokens"),
                Case("locks protect, leaves go first", locks, "evict only leaves with lock_ref 0; a parent left "
                                                              "without children becomes a candidate"),
                Case("least recently used first", lru, "match_prefix and insert stamp every node they walk through"),
                Case("random workout", _workout(7, 60), weight=2)]
    r = rng(hidden, 71)
    return [Case(f"random workout {k}", _workout(r.randrange(10**6), 80), weight=2) for k in range(3)]


# ---------------------------------------------------------------- the order

class _Req:
    def __init__(self, seq_id: int, cached: int):
        self.seq_id, self.cached = seq_id, cached


def _order_case(reqs, fcfs_above=128):
    def run(fn, t):
        seqs = [_Req(i, c) for i, c in reqs]
        before = [s.seq_id for s in seqs]
        out = fn(seqs, lambda s: s.cached, fcfs_above=fcfs_above)
        t(f"lpm_order of (id, cached) {reqs if len(reqs) < 12 else f'{len(reqs)} requests'}, fcfs_above={fcfs_above}",
          [s.seq_id for s in out])
        t("the input list is unchanged", [s.seq_id for s in seqs] == before)
    return run


@register("07", "lpm_order", reference=lambda: lpm_order, points=2,
          forbidden=lambda: [lpm_order, longest_prefix_first, CacheAwareOrder])
def cases_lpm_order(hidden):
    if hidden is None:
        return [Case("longest first", _order_case([(0, 0), (1, 16), (2, 4), (3, 16)]), "sort by cached tokens, "
                                                                                       "longest first"),
                Case("ties keep arrival order", _order_case([(5, 3), (6, 3), (7, 9), (8, 3)]), "a stable sort"),
                Case("fallback above the threshold", _order_case([(i, i % 7) for i in range(9)], fcfs_above=8),
                     "more waiting requests than fcfs_above: arrival order (SGLang: 128)"),
                Case("at the threshold", _order_case([(i, i % 7) for i in range(8)], fcfs_above=8))]
    r = rng(hidden, 72)
    cases = []
    for k in range(6):
        n = r.randint(1, 20)
        cases.append(Case(f"random queue {k}", _order_case([(i, r.choice([0, 4, 7, 16, 30])) for i in range(n)],
                                                           fcfs_above=r.choice([5, 10, 128]))))
    return cases


# ---------------------------------------------------------------- serving SmolLM2

def _preflight(impl):
    """The plug-ins are the package's seams (``RadixKVManager``, ``CacheAwareOrder``): the tree inside the
    manager must be the notebook's RadixTree (not the package's RadixCache) and the policy's order the
    notebook's lpm_order (not a named order such as ``"lpm"``, nor the package's function)."""
    from tinypaged.course.checks import get, reuse_of_reference
    from tinypaged.interfaces import KVCacheSpec

    factory = impl.get("kv_cache_manager") if isinstance(impl, dict) else None
    if factory is None:
        raise TypeError("plugins needs a kv_cache_manager built on your RadixTree")
    kv = factory(KVCacheSpec(num_blocks=4, block_size=4, max_model_len=16))
    tree = getattr(kv, "tree", None)
    why = reuse_of_reference(get("radix_tree"), type(tree)) if tree is not None else "there is no tree"
    if why:
        raise TypeError(f"the manager's tree must be your RadixTree: {why}")
    order = getattr(impl.get("scheduling_policy"), "order", None)
    why = reuse_of_reference(get("lpm_order"), order) if callable(order) else f"its order is {order!r}"
    if why:
        raise TypeError(f"the scheduling policy must order by your lpm_order: {why}")
    tree.insert([1, 2], [0, 1])  # an unfinished piece raises NotImplementedError here, before the model loads
    tree.match_prefix([1, 2])
    tree.evict(2)
    order([], lambda s: 0)


def _reordered(llm, outs) -> bool:
    """The repeat of the first prompt finished before the second prompt (it waited behind it in arrival order)."""
    return outs[2].metrics.finished_time < outs[1].metrics.finished_time


def _whole_hit(llm, outs) -> bool:
    """The repeat found every token but its last one cached (token granularity: blocks of 4 would round down)."""
    return outs[2].metrics.num_cached_tokens == len(outs[2].prompt_token_ids) - 1


_SYSTEM = "You are a helpful assistant who answers briefly."
serving_check("07", "serve_radix",
              prompts=(f"{_SYSTEM} The capital of France is", f"{_SYSTEM} Name three fruits:",
                       f"{_SYSTEM} The capital of France is"),
              max_tokens=8,
              engine_kwargs=dict(block_size=4, num_gpu_blocks_override=8, max_model_len=64, max_num_seqs=1,
                                 dtype="float32", device="cpu"),
              preflight=_preflight, adapters=("kv_cache_manager", "scheduling_policy"),
              facts=[("cache-aware order ran the repeated prompt before the second one", _reordered),
                     ("the repeat found all but its last prompt token cached", _whole_hit)],
              uses=("RadixTree", "lpm_order"))
