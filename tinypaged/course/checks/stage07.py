"""Stage 7 checks: a token-granular radix tree (match with splits, insert, LRU leaf eviction under lock
references) and the longest-prefix-match order, then both serving SmolLM2 through the engine's seams.

The references are the package's own: ``tinypaged.kv.radix_cache.RadixTree`` (the engine's tree, at page size 1
here) and ``tinypaged.sched.radix_policy.lpm_order`` (the engine's ``lpm``). The learner's class has the same
interface (``match_prefix``, ``insert``, ``evict``, ``inc_lock_ref``/``dec_lock_ref``,
``evictable_size``/``protected_size``, ``root`` of nodes with ``key``, ``value``, ``lock_ref``,
``children``). A case records what the calls return and the tree's shape, never node identities.

A random workout that fails attaches a replay note: the reference tree runs beside the learner's only to find
the first wrong step and drop every operation before it that is not needed to get it wrong, printed as code to
paste (that case's operations only; no other case's expected values). ``serve_radix`` (the engine serving
SmolLM2 with both pieces) is registered without points: the notebook's part (c) shows that run, ungraded.
"""

from __future__ import annotations

import random

from tinypaged.course.checks import Case, _show, differ, plain, register
from tinypaged.course.checks._util import rng
from tinypaged.course.checks.serving import serving_check
from tinypaged.kv.radix_cache import RadixKVManager, RadixTree
from tinypaged.sched.radix_policy import CacheAwareOrder, lpm_order


def shape(tree) -> list:
    """The tree as nested lists ``[key, pages, lock_ref, children...]``, children by first token."""
    def walk(node):
        kids = sorted(node.children.values(), key=lambda c: tuple(c.key))
        return [list(node.key), list(node.value), node.lock_ref, *[walk(c) for c in kids]]
    return [walk(c) for c in sorted(tree.root.children.values(), key=lambda c: tuple(c.key))]


def _sizes(tree) -> dict:
    return {"evictable_size": tree.evictable_size, "protected_size": tree.protected_size}


# ---------------------------------------------------------------- the tree

# A failing step gets the hint of the call it made (a wrong insert return value is not a splitting problem).
STAMPS = ("every node a call walks through gets the call's stamp, and a node it splits passes the stamp to both "
          "halves: stamp before splitting, or stamp both")
STEP_HINTS = (
    ("insert(", "insert returns how many tokens of key were in the tree before the call (0 for a new key); the "
                "rest becomes one new leaf holding the caller's pages for those tokens"),
    ("match_prefix(", "walk while a child starts with the next token; a match that ends inside a child's key splits "
                      "it there; return the pages of every matched token and the node the match ends on"),
    ("evict(", f"free unlocked leaves, the smallest last_access first (ties: the node created first), whole leaves, "
               f"until num_tokens are freed; a parent left childless and unlocked becomes a leaf. {STAMPS}"),
    ("lock", "the sizes move only through inc_lock_ref / dec_lock_ref (given); a split node's new half must copy "
             "lock_ref so they stay right"),
    ("the tree", "a split keeps every path's tokens and pages; the new node copies lock_ref and last_access"),
)


def _ops(seed: int, steps: int) -> list[tuple]:
    """A random workout as plain operations (drawn once, whatever the tree answers): ``("insert", key, first
    page)``, ``("match", key, lock it?)``, ``("unlock", index of the match whose node it unlocks)``,
    ``("evict", num_tokens)``."""
    r = random.Random(seed)
    prefixes = [[r.randrange(1, 5) for _ in range(r.randint(2, 8))] for _ in range(4)]
    ops, next_page, locked = [], 100, []
    for i in range(steps):
        op = r.random()
        key = r.choice(prefixes)[: r.randint(0, 8)] + [r.randrange(1, 4) for _ in range(r.randint(0, 4))]
        if op < 0.35 and key:
            ops.append(("insert", key, next_page))
            next_page += len(key)
        elif op < 0.6:
            lock = r.random() < 0.5
            ops.append(("match", key, lock))
            if lock:
                locked.append(i)
        elif op < 0.75 and locked:
            ops.append(("unlock", locked.pop(r.randrange(len(locked)))))
        else:
            ops.append(("evict", r.randint(1, 10)))
    return ops


def _apply(tree, ops: list[tuple], i: int, nodes: dict) -> list[tuple[str, object]]:
    """Run operation ``i`` of ``ops`` on ``tree``: the steps it observes, as (description, value)."""
    op = ops[i]
    if op[0] == "insert":
        key, first = op[1], op[2]
        return [(f"step {i}: insert({key}, pages {first}..{first + len(key) - 1}): the return value and the sizes",
                 {"returns": tree.insert(key, list(range(first, first + len(key)))), **_sizes(tree)})]
    if op[0] == "match":
        pages, node = tree.match_prefix(op[1])
        nodes[i] = node
        out = [(f"step {i}: match_prefix({op[1]}): the pages and the matched node's key",
                {"pages": list(pages), "node's key": list(node.key)})]
        if op[2]:
            tree.inc_lock_ref(node)
            out.append((f"step {i}: lock the node it returned: the sizes", _sizes(tree)))
        return out
    if op[0] == "unlock":
        tree.dec_lock_ref(nodes[op[1]])
        return [(f"step {i}: unlock the node step {op[1]} locked: the sizes", _sizes(tree))]
    return [(f"step {i}: evict({op[1]}): the freed pages (sorted) and the sizes",
             {"freed": sorted(tree.evict(op[1])), **_sizes(tree)})]


def _as_python(ops: list[tuple], keep: list[int]) -> str:
    """``keep``'s operations as lines a learner can paste into a cell."""
    lines = ["t = RadixTree()"]
    for i in keep:
        op = ops[i]
        if op[0] == "insert":
            lines.append(f"t.insert({op[1]}, list(range({op[2]}, {op[2] + len(op[1])})))")
        elif op[0] == "match":
            lines.append(f"_, n{i} = t.match_prefix({op[1]})" + (f"; t.inc_lock_ref(n{i})" if op[2] else ""))
        elif op[0] == "unlock":
            lines.append(f"t.dec_lock_ref(n{op[1]})")
        else:
            lines.append(f"sorted(t.evict({op[1]}))")
    return "; ".join(lines)


def _first_wrong(cls, ops: list[tuple], keep: list[int]) -> tuple[int, str] | None:
    """Where ``cls`` first disagrees with the reference on the operations ``keep``: (position in ``keep``, what the
    reference and ``cls`` answered there), or None."""
    mine, ref, mine_nodes, ref_nodes = cls(), RadixTree(), {}, {}
    for n, i in enumerate(keep):
        want = [plain(v) for _, v in _apply(ref, ops, i, ref_nodes)]
        try:
            got = [plain(v) for _, v in _apply(mine, ops, i, mine_nodes)]
        except Exception as e:  # noqa: BLE001  (the learner's code failing is what we look for)
            return n, f"expected {_show(want[0])}, raised {type(e).__name__}"
        if got != want:
            k = next(j for j in range(len(want)) if j >= len(got) or got[j] != want[j])
            return n, differ(want[k], got[k], 0) if k < len(got) else f"expected {_show(want[k])}, got nothing"
    return None


def _fails_last(cls, ops: list[tuple], keep: list[int]) -> bool:
    """Whether ``cls`` agrees with the reference on every operation of ``keep`` but the last, and not on the last
    (a different value or an exception)."""
    wrong = _first_wrong(cls, ops, keep)
    return wrong is not None and wrong[0] == len(keep) - 1


def _replay_note(cls, ops: list[tuple], upto: int) -> str:
    keep = _shortest_failure(cls, ops, upto)
    wrong = _first_wrong(cls, ops, keep)
    what = f" (its last line: {wrong[1]})" if wrong is not None and wrong[0] == len(keep) - 1 else ""
    return f"replay it, shortened to the operations that still fail{what}: {_as_python(ops, keep)}"


def _shortest_failure(cls, ops: list[tuple], upto: int) -> list[int]:
    """Operations 0..``upto`` with every one dropped whose absence still leaves ``upto`` failing (a match stays while
    a kept unlock needs its node): the run to replay. At most three passes over at most 80 operations."""
    keep = list(range(upto + 1))
    for _ in range(3):
        dropped = False
        for i in reversed(keep[:-1]):
            if any(ops[j][0] == "unlock" and ops[j][1] == i for j in keep if j != i):
                continue
            trial = [j for j in keep if j != i]
            if _fails_last(cls, ops, trial):
                keep, dropped = trial, True
        if not dropped:
            break
    return keep


def _workout(seed: int, steps: int):
    def run(cls, t):
        ops = _ops(seed, steps)
        tree, ref, nodes, ref_nodes = cls(), RadixTree(), {}, {}
        for i in range(len(ops)):
            # The reference runs beside the tree only to find the first wrong step and shorten the run that
            # leads to it (a replayable note); the verdict compares the recorded steps, as in every check.
            want = _apply(ref, ops, i, ref_nodes) if cls is not RadixTree else None
            try:
                got = _apply(tree, ops, i, nodes)
            except NotImplementedError:
                raise
            except Exception:
                if want is not None and t.note is None:
                    t.replay(_replay_note(cls, ops, i))
                raise
            for desc, value in got:
                t(desc, value)
            if want is not None and t.note is None and [plain(v) for _, v in got] != [plain(v) for _, v in want]:
                t.replay(_replay_note(cls, ops, i))
        t("the tree at the end", shape(tree))
    return run


@register("07", "RadixTree", reference=lambda: RadixTree, points=7, name="radix_tree",
          forbidden=lambda: [RadixTree, RadixKVManager])
def cases_radix_tree(hidden):
    def split(cls, t):
        tree = cls()
        t("insert([1, 2, 3, 4, 5], pages [10..14]) into an empty tree: the return value",
          tree.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]))
        pages, node = tree.match_prefix([1, 2, 3, 9])
        t("match_prefix([1, 2, 3, 9]): pages, the node's key", [pages, list(node.key)])
        t("the tree after the match (it split the edge after 3 tokens)", shape(tree))
        t("match_prefix([7]) and match_prefix([]): pages, the node's key",
          [[p, list(n.key)] for p, n in (tree.match_prefix([7]), tree.match_prefix([]))])
        t("the sizes after the matches", _sizes(tree))

    def share(cls, t):
        tree = cls()
        tree.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
        t("insert([1, 2, 3, 7, 7], pages [20..24]) returns the tokens already cached",
          tree.insert([1, 2, 3, 7, 7], [20, 21, 22, 23, 24]))
        t("the tree (it keeps its own pages for 1, 2, 3)", shape(tree))
        t("insert([1, 2], pages [30, 31]): the return value (all cached already)", tree.insert([1, 2], [30, 31]))
        t("the tree (a match that ends inside an edge splits it)", shape(tree))
        t("match_prefix([1, 2, 3, 7, 7, 7]): pages", tree.match_prefix([1, 2, 3, 7, 7, 7])[0])
        t("the sizes after the inserts", _sizes(tree))

    def locks(cls, t):
        tree = cls()
        tree.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
        tree.insert([1, 2, 3, 7, 7], [20, 21, 22, 23, 24])
        _, node = tree.match_prefix([1, 2, 3, 4, 5])
        tree.inc_lock_ref(node)
        t("lock the node of [1, 2, 3, 4, 5]: the sizes", _sizes(tree))
        t("evict(100) frees only the unlocked leaf (sorted pages)", sorted(tree.evict(100)))
        t("the tree and the sizes", [shape(tree), _sizes(tree)])
        tree.dec_lock_ref(node)
        t("unlock: the sizes", _sizes(tree))
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

    def split_stamps(cls, t):
        # Regression (issue 32): a learner stamped only the new upper half of a split, so the remainder kept its
        # old stamp and was evicted before a leaf used later; only a hidden workout caught it.
        tree = cls()
        tree.insert([1, 2, 3, 4], [10, 11, 12, 13])  # stamp 1
        tree.insert([5, 5], [20, 21])  # stamp 2
        tree.match_prefix([1, 2])  # stamp 3: splits [1, 2, 3, 4]; the remainder [3, 4] was walked into too
        t("after insert [1, 2, 3, 4], insert [5, 5], match_prefix([1, 2]): evict(2) frees the least recently used "
          "leaf", sorted(tree.evict(2)))
        tree.insert([6, 6], [30, 31])  # stamp 4
        tree.insert([1, 2, 3, 9], [40, 41, 42, 43])  # stamp 5: splits [3, 4] into [3] and [4]
        t("then insert [6, 6] and insert [1, 2, 3, 9] (it splits [3, 4]): evict(1) frees", sorted(tree.evict(1)))
        t("what is left", shape(tree))

    def case(label, run, hint, **kw):
        return Case(label, run, hint, step_hints=STEP_HINTS, **kw)

    if hidden is None:
        return [case("a match ends inside an edge", split, "a match that ends inside a key splits the node there"),
                case("insert shares a prefix", share, "insert walks as match_prefix does and returns the cached "
                                                      "length; a new leaf for the rest, with the caller's pages"),
                case("locks protect, leaves go first", locks, "evict only leaves with lock_ref 0; a parent left "
                                                              "without children becomes a candidate"),
                case("least recently used first", lru, "match_prefix and insert stamp every node they walk through"),
                Case("a split stamps both halves", split_stamps, STAMPS),
                case("random workout", _workout(7, 60), "", weight=2)]
    r = rng(hidden, 71)
    return [case(f"random workout {k}", _workout(r.randrange(10**6), 80), "", weight=2) for k in range(3)]


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


@register("07", "lpm_order", reference=lambda: lpm_order, points=1,
          forbidden=lambda: [lpm_order, CacheAwareOrder])
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
    manager must be the notebook's RadixTree (not the package's RadixTree) and the policy's order the
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
              uses=("RadixTree", "lpm_order"), points=0)
