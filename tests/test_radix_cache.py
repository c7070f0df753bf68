"""Stage 7: the radix tree, its KV manager and the cache-aware order.

Two hypothesis state machines: one drives the bare ``RadixTree`` (insert, match, lock, evict) with keys of
tokens and of pages (``page_key``), one drives ``RadixKVManager`` through the KVCacheManager contract with fake
sequences whose "KV" is a dict from slot to (token, position), so a page overwritten while someone reads it is
caught. Invariants: no locked node
evicted, evictable / protected sizes add up, every cached token held by one node, nothing leaked after a
drain. Then the engine: outputs identical with every manager and order, and the hits each one finds.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tinypaged.kv.radix_cache import RadixKVManager, RadixTree, check_tree, page_key, tree_nodes
from tinypaged.sched.radix_policy import CacheAwareOrder, dfs_weight_order, lpm_order

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9], [4, 4, 4, 4], [1, 2, 7]]


def keys():
    """Token lists that share prefixes often (so matches end inside edges and nodes split)."""
    return st.tuples(st.sampled_from(PREFIXES), st.integers(0, 8),
                     st.lists(st.integers(1, 3), max_size=6)).map(lambda t: t[0][: t[1]] + t[2])


class TreeMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.p = page_size
        self.tree = RadixTree()  # the tree is the same at every page size: its keys are page_keys
        self.free = list(range(200))
        self.locks: list[tuple[tuple, list, object]] = []  # (key, pages, node) of each lock held

    @rule(key=keys())
    def insert(self, key):
        key = page_key(key, self.p)
        before, _ = self.tree.match_prefix(key)
        pages = [self.free.pop() for _ in key]
        cached = self.tree.insert(key, pages)
        assert cached == len(before), "insert reports the prefix that match_prefix found"
        got, _ = self.tree.match_prefix(key)
        assert got == before + pages[cached:], "the tree keeps its pages and adopts the rest"
        self.free += pages[:cached]  # duplicates go back

    @rule(key=keys())
    def lock(self, key):
        key = page_key(key, self.p)
        pages, node = self.tree.match_prefix(key)
        self.tree.inc_lock_ref(node)
        self.locks.append((key[: len(pages)], pages, node))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 50))
    def unlock(self, i):
        _, _, node = self.locks.pop(i % len(self.locks))
        self.tree.dec_lock_ref(node)

    @rule(n=st.integers(0, 40))
    def evict(self, n):
        evictable = self.tree.evictable_size
        freed = self.tree.evict(n)
        assert len(freed) >= min(n, evictable) and self.tree.evictable_size == evictable - len(freed)
        self.free += freed
        for key, pages, _ in self.locks:  # no locked path lost a token
            assert self.tree.match_prefix(key)[0] == pages

    @invariant()
    def consistent(self):
        if not hasattr(self, "tree"):
            return
        check_tree(self.tree)
        held = [pg for n in tree_nodes(self.tree) for pg in n.value]
        assert sorted(held + self.free) == list(range(200)), "every page is free or in exactly one node"
        assert self.tree.evictable_size + self.tree.protected_size == len(held)

    def teardown(self):
        if not hasattr(self, "tree"):
            return
        for _, _, node in self.locks:
            self.tree.dec_lock_ref(node)
        self.free += self.tree.evict(10**9)
        assert self.tree.protected_size == self.tree.evictable_size == 0 and not self.tree.root.children
        assert sorted(self.free) == list(range(200)), "a drained tree gives every page back"


TestTree = TreeMachine.TestCase
TestTree.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class FakeParams:
    max_tokens = 64


class FakeSeq:
    """What the manager reads: id, tokens, progress, whether the next step is a decode."""

    _next = 0

    def __init__(self, prompt):
        FakeSeq._next += 1
        self.seq_id = 50_000 + FakeSeq._next
        self.prompt = list(prompt)
        self.outputs: list[int] = []
        self.num_computed_tokens = 0
        self.params = FakeParams()

    @property
    def token_ids(self):
        return self.prompt + self.outputs

    def __len__(self):
        return len(self.prompt) + len(self.outputs)

    @property
    def is_decoding(self):
        return bool(self.outputs) and len(self) - self.num_computed_tokens == 1

    def max_total_tokens(self, max_model_len):
        return min(len(self.prompt) + self.params.max_tokens, max_model_len)


class ManagerMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), pages=st.integers(6, 40))
    def setup(self, page_size, pages):
        self.kv = RadixKVManager(pages * page_size, page_size, max_model_len=256)
        self.running: list[FakeSeq] = []
        self.written: dict[int, tuple[int, int]] = {}  # slot -> (token, position): the "KV"

    def _compute(self, seq, n):
        """The forward: write (token, position) into the slots of the next n positions."""
        start = seq.num_computed_tokens
        for pos, slot in zip(range(start, start + n), self.kv.slot_mapping(seq, start, start + n)):
            self.written[slot] = (seq.token_ids[pos], pos)
        seq.num_computed_tokens += n

    @rule(key=keys(), chunk=st.integers(1, 12))
    def admit(self, key, chunk):
        seq = FakeSeq(key or [5])
        hit = self.kv.get_computed_blocks(seq)
        assert len(hit) * self.kv.page_size <= len(seq) - 1, "a hit leaves one token to run"
        n = min(chunk, len(seq) - len(hit) * self.kv.page_size)
        free_before = list(self.kv.free_pages)
        if self.kv.allocate_slots(seq, n, hit):
            seq.num_computed_tokens = len(hit) * self.kv.page_size
            self._compute(seq, n)
            self.running.append(seq)
        else:
            assert seq.seq_id not in self.kv.tables and list(self.kv.free_pages) == free_before

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 50), tok=st.integers(1, 3))
    def step(self, i, tok):
        """Prefill the next chunk, or (prompt done) sample a token and decode it."""
        seq = self.running[i % len(self.running)]
        if seq.num_computed_tokens == len(seq):
            seq.outputs.append(tok)
        n = min(4, len(seq) - seq.num_computed_tokens)
        if self.kv.allocate_slots(seq, n):
            self._compute(seq, n)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 50))
    def finish(self, i):
        seq = self.running.pop(i % len(self.running))
        self.kv.free(seq)
        self.kv.free(seq)  # twice is harmless

    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()
        for seq in self.running:  # nobody's computed KV was overwritten (eviction, reuse, duplicates)
            slots = self.kv.slot_mapping(seq, 0, seq.num_computed_tokens)
            assert [self.written.get(s) for s in slots] == \
                [(t, p) for p, t in enumerate(seq.token_ids[: seq.num_computed_tokens])]
        assert 0.0 <= self.kv.usage <= 1.0

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for seq in self.running:
            self.kv.free(seq)
        kv = self.kv
        assert kv.tree.protected_size == 0 and kv.usage == 0.0, "a drained manager holds nothing"
        kv.free_pages.extend(kv.tree.evict(10**9))
        assert sorted(kv.free_pages) == list(range(kv.num_pages)), "nothing leaked"


TestManager = ManagerMachine.TestCase
TestManager.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_cached_pages_hold_their_tokens():
    """After requests finish, what the tree maps a key to is what was written there (outputs included)."""
    kv = RadixKVManager(64, 1, max_model_len=64)
    written = {}
    seq = FakeSeq([1, 2, 3, 4, 5])
    assert kv.allocate_slots(seq, 5)
    for p, s in enumerate(kv.slot_mapping(seq, 0, 5)):
        written[s] = seq.token_ids[p]
    seq.num_computed_tokens = 5
    for tok in (7, 8):  # two decodes; the second sampled token has no KV yet when the request ends
        seq.outputs.append(tok)
        assert kv.allocate_slots(seq, 1)
        written[kv.slot_mapping(seq, len(seq) - 1, len(seq))[0]] = tok
        seq.num_computed_tokens += 1
    seq.outputs.append(9)
    kv.free(seq)
    pages, _ = kv.tree.match_prefix([1, 2, 3, 4, 5, 7, 8, 9, 9])
    assert [written[p] for p in pages] == [1, 2, 3, 4, 5, 7, 8], "prompt and output KV stay, the unwritten token not"


def test_page_key_makes_one_symbol_per_whole_page():
    assert page_key([5, 6, 7], 1) == (5, 6, 7)
    assert page_key([1, 2, 3, 4, 5, 6, 7], 2) == ((1, 2), (3, 4), (5, 6)), "the partial last page is left out"
    assert page_key([1, 2, 3], 4) == ()


def test_bad_page_size_is_named():
    with pytest.raises(ValueError, match="page_size"):
        RadixKVManager(64, 0)
    with pytest.raises(ValueError, match="order="):
        CacheAwareOrder("longest")


# ---------------------------------------------------------------- the order

class _S:
    def __init__(self, sid, toks):
        self.seq_id, self.token_ids = sid, toks

    def __len__(self):
        return len(self.token_ids)


def test_lpm_order_is_stable_and_keeps_arrival_order_above_the_cut_off():
    seqs = [_S(i, []) for i in range(5)]
    hits = {0: 4, 1: 16, 2: 0, 3: 16, 4: 4}
    assert [s.seq_id for s in lpm_order(seqs, lambda s: hits[s.seq_id])] == [1, 3, 0, 4, 2]
    assert [s.seq_id for s in lpm_order(seqs, lambda s: hits[s.seq_id], fcfs_above=4)] == [0, 1, 2, 3, 4]
    assert [s.seq_id for s in seqs] == [0, 1, 2, 3, 4], "a new list: the caller's is left alone"


def test_dfs_weight_takes_the_heavier_subtree_first():
    kv = RadixKVManager(200, 1)
    kv.tree.insert([1, 1, 1, 1], list(range(4)))
    kv.tree.insert([2, 2, 2, 2], list(range(4, 8)))
    waiting = [_S(0, [1, 1, 1, 1, 5]), _S(1, [2, 2, 2, 2, 5]), _S(2, [2, 2, 2, 2, 6]), _S(3, [9, 9]),
               _S(4, [2, 2, 2, 2, 7])]
    order = [s.seq_id for s in dfs_weight_order(kv, waiting)]
    assert order == [3, 1, 2, 4, 0], "the root's own request, then the subtree with three, then the one with one"
    with pytest.raises(TypeError, match="RadixKVManager"):
        dfs_weight_order(object(), waiting)


# ---------------------------------------------------------------- the engine

def _generate(**kw):
    from tinypaged import LLM, SamplingParams

    llm = LLM("tiny", block_size=4, kv_cache_tokens=160, max_num_seqs=4, **kw)
    r = random.Random(0)
    system = [r.randrange(1, 200) for _ in range(22)]
    prompts = [{"prompt_token_ids": system + [r.randrange(1, 200) for _ in range(r.randint(1, 9))]} for _ in range(8)]
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    outs = llm.generate(prompts, sp)
    follow = [{"prompt_token_ids": p["prompt_token_ids"] + list(o.outputs[0].token_ids) + [3]}
              for p, o in zip(prompts[:2], outs)]
    outs += llm.generate(follow, sp)
    return llm, outs


def test_every_manager_and_order_gives_the_same_tokens():
    from tinypaged.sched.policies import schedule_step

    _, base = _generate()
    want = [o.outputs[0].token_ids for o in base]
    runs = {
        "hashed, lpm": dict(enable_prefix_caching=True, scheduling_policy=CacheAwareOrder("lpm")),
        "radix page 1, fcfs": dict(kv_cache_manager=RadixKVManager.factory(1), scheduler_cls=schedule_step),
        "radix page 4, lpm": dict(kv_cache_manager=RadixKVManager.factory(), scheduling_policy=CacheAwareOrder()),
        "radix page 1, dfs-weight": dict(kv_cache_manager=RadixKVManager.factory(1),
                                         scheduling_policy=CacheAwareOrder("dfs-weight")),
    }
    hits = {}
    for name, kw in runs.items():
        llm, outs = _generate(**kw)
        assert [o.outputs[0].token_ids for o in outs] == want, name
        hits[name] = [o.metrics.num_cached_tokens for o in outs]
        kv = llm.llm_engine.kv
        if isinstance(kv, RadixKVManager):
            kv.check_invariants()
            assert kv.tree.protected_size == 0 and kv.usage == 0.0
    # page 1 reuses the whole previous turn (prompt + outputs but the last sampled token) in the follow-ups
    first_turn = [len(p) for p in [o.prompt_token_ids for o in base[:2]]]
    assert hits["radix page 1, fcfs"][8:] == [n + 4 for n in first_turn]
    assert all(h % 4 == 0 for h in hits["radix page 4, lpm"]), "page 4 hits whole pages only"
    assert sum(hits["radix page 1, fcfs"]) > sum(hits["hashed, lpm"]), "token granularity finds partial blocks"


def test_same_step_prefix_sharing_passes_the_slot_check():
    """Regression: with a plug-in (so the cross-sequence slot check is on) and prefix caching, two requests
    admitted in one step share the prefix the first is writing; the check took that for an overwrite."""
    from tinypaged import LLM, SamplingParams
    from tinypaged.sched.policies import schedule_step

    llm = LLM("tiny", enable_prefix_caching=True, scheduler_cls=schedule_step, block_size=4, kv_cache_tokens=256)
    p = {"prompt_token_ids": list(range(1, 40))}
    outs = llm.generate([p, p], SamplingParams(max_tokens=3, temperature=0.0))
    assert outs[1].metrics.num_cached_tokens == 36
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


class _FakeSched:
    """What CacheAwareOrder reads: the waiting queue, arrival, and each request's prefix hit."""

    def __init__(self, hits):
        from collections import deque

        self.waiting = deque(_S(i, [0] * 8) for i in range(len(hits)))
        self.hits = hits

    def arrived(self, seq):
        return True

    def prefix_hit(self, seq):
        return [0] * self.hits[seq.seq_id]

    def hit_tokens(self, computed):
        return len(computed)


@pytest.mark.parametrize("order, fcfs_above, want", [
    ("lpm", 128, [1, 3, 0, 2]),
    ("lpm", 3, [0, 1, 2, 3]),  # four waiting, over the cut-off: arrival order
    ("fcfs", 128, [0, 1, 2, 3]),
    (lambda seqs, cached: list(reversed(seqs)), 128, [3, 2, 1, 0]),  # a learner's own order plugs in
])
def test_cache_aware_order_only_orders(order, fcfs_above, want):
    sched = _FakeSched([0, 8, 0, 5])
    ordered = CacheAwareOrder(order, fcfs_above)
    assert [s.seq_id for s in ordered.waiting_order(sched)] == want
    assert [s.seq_id for s in sched.waiting] == [0, 1, 2, 3], "the scheduler's own queue keeps arrival order"
    running = [object(), object()]
    assert ordered.rank_running(running) == running, "running requests keep admission order"


@pytest.mark.parametrize("order, repeat_first", [("lpm", True), ("fcfs", False)])
def test_cache_aware_order_changes_what_the_engine_admits(order, repeat_first):
    """Regression: the engine's continuous step read the scheduler's real queue, not the reordered view,
    so ``lpm`` admitted in arrival order. One request at a time: after the first prompt, its repeat (all
    but the last token cached) goes before the other prompt under lpm, after it under fcfs."""
    from tinypaged import LLM, SamplingParams

    llm = LLM("tiny", block_size=4, kv_cache_tokens=64, max_num_seqs=1,
              kv_cache_manager=RadixKVManager.factory(1), scheduling_policy=CacheAwareOrder(order))
    first, other = list(range(10, 22)), list(range(50, 62))
    admitted = []
    llm.generate([{"prompt_token_ids": p} for p in (first, other, first)],
                 SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                 on_step=lambda st: admitted.extend(s.seq.seq_id for s in st.scheduled if s.seq.seq_id not in admitted))
    assert [a - admitted[0] for a in admitted] == ([0, 2, 1] if repeat_first else [0, 1, 2])


# ---------------------------------------------------------------- workloads and the view

def test_workloads_share_what_they_say():
    from tinypaged.lab.prefix_workloads import all_workloads, few_shot, multi_turn_chat

    fs = few_shot()
    names = [r.name for r in fs.waves[0]]
    assert names[:5] == ["task0q0", "task1q0", "task2q0", "task3q0", "task0q1"], "queries arrive interleaved"
    assert fs.waves[0][0].tokens[:80] == fs.waves[0][4].tokens[:80] != fs.waves[0][1].tokens[:80]
    chat = multi_turn_chat()
    assert [r.parent for r in chat.waves[1]] == ["chat0t0", "chat1t0", "chat2t0"]
    assert [w.name for w in all_workloads()] == [w.name for w in all_workloads()]  # seeded: same every call
    assert all_workloads()[0].waves == all_workloads()[0].waves


def test_replay_shows_the_partial_block_and_the_reply():
    from tinypaged.lab.radix_view import replay, tree_lines

    system = list(range(1, 11))
    snaps = replay([("arrive", "A", system + [20, 21, 22]), ("arrive", "B", system + [30, 31]),
                    ("finish", "A", [40, 41, 42]), ("arrive", "C", system + [20, 21, 22, 40, 41, 42, 60])], 40, 4)
    assert snaps[2].hits == {"radix": 10, "blocks": 8}, "the tree finds the whole system prompt, blocks of 4 only 8"
    assert snaps[4].hits == {"radix": 15, "blocks": 12}, "A's reply, but its last token, serves C"
    assert "lock 1" in tree_lines(snaps[2])[1] and "evicted next" in "".join(tree_lines(snaps[3]))


def test_slot_check_still_catches_an_overwrite_of_other_tokens():
    """The same-step exemption covers only the very token at the very position: a manager that maps a new
    request onto slots another request has cached, with other tokens, is still stopped."""
    from tinypaged import LLM, SamplingParams
    from tinypaged.interfaces import InvariantError

    class SameSlots(RadixKVManager):
        def slot_mapping(self, seq, start, end):
            return list(range(start, end))  # every sequence writes from slot 0: B lands on A's cached keys

    llm = LLM("tiny", kv_cache_manager=lambda spec: SameSlots(spec.capacity_tokens, 1, spec.max_model_len),
              kv_cache_tokens=256, max_num_seqs=2, max_num_batched_tokens=20)
    prompts = [{"prompt_token_ids": list(range(1, 21))}, {"prompt_token_ids": list(range(50, 60))}]
    with pytest.raises(InvariantError, match="overwrite slot"):
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))


def test_a_split_ties_two_leaves_and_the_older_goes_first():
    """Regression: an insert that splits an edge stamps both the remainder and the new leaf; eviction must break
    the tie the same way every run (creation order), or a check's expected pages depend on memory addresses."""
    tree = RadixTree()
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 2, 4], [20, 21, 22])
    leaves = [n for n in tree_nodes(tree) if not n.children]
    assert len({n.last_access for n in leaves}) == 1, "the remainder [3] and the new leaf [4] share a stamp"
    assert tree.evict(1) == [12], "the remainder, created first, is evicted first"


# ---------------------------------------------------------------- a tree with the assignment's interface only

class _AssignmentNode:
    """The node stage 7's assignment gives (``key``, ``value``, ``parent``, ``children``, ``lock_ref``,
    ``last_access``, ``order``), with ``__slots__`` so nothing else can be read off it."""

    __slots__ = ("order", "children", "parent", "key", "value", "lock_ref", "last_access")
    created = iter(range(10**9))

    def __init__(self, key=(), value=(), parent=None):
        self.order, self.children, self.parent = next(_AssignmentNode.created), {}, parent
        self.key, self.value, self.lock_ref, self.last_access = tuple(key), list(value), 0, 0


class AssignmentTree:
    """Exactly the methods and attributes stage 7's assignment asks a learner's ``RadixTree`` for (page size 1),
    with ``__slots__``: no ``nodes``, ``total_size``, ``next_victim``, ``check_invariants`` or ``id``."""

    __slots__ = ("root", "evictable_size", "protected_size", "clock")

    def __init__(self):
        self.root, self.evictable_size, self.protected_size, self.clock = _AssignmentNode(), 0, 0, 0
        self.root.lock_ref = 1

    def tick(self):
        self.clock += 1
        return self.clock

    def inc_lock_ref(self, node):
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size, self.protected_size = self.evictable_size - len(node.key), \
                    self.protected_size + len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node):
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size, self.protected_size = self.evictable_size + len(node.key), \
                    self.protected_size - len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def split_node(self, node, n):
        top = _AssignmentNode(node.key[:n], node.value[:n], node.parent)
        top.lock_ref, top.last_access = node.lock_ref, node.last_access
        node.parent.children[node.key[0]] = top
        node.key, node.value, node.parent = node.key[n:], node.value[n:], top
        top.children[node.key[0]] = node
        return top

    def _walk(self, key, now):
        node, done = self.root, 0
        while done < len(key) and key[done] in node.children:
            child = node.children[key[done]]
            child.last_access = now
            n = 0
            while n < min(len(child.key), len(key) - done) and child.key[n] == key[done + n]:
                n += 1
            if n < len(child.key):
                child = self.split_node(child, n)
            node, done = child, done + n
        return node, done

    def match_prefix(self, key):
        key = tuple(key)
        node, _ = self._walk(key, self.tick())
        pages, n = [], node
        while n is not self.root:
            pages[:0] = n.value
            n = n.parent
        return pages, node

    def insert(self, key, pages):
        key, now = tuple(key), self.tick()
        node, done = self._walk(key, now)
        if done < len(key):
            leaf = _AssignmentNode(key[done:], pages[done:len(key)], node)
            leaf.last_access = now
            node.children[key[done]] = leaf
            self.evictable_size += len(leaf.key)
        return done

    def evict(self, num_tokens):
        freed = []
        while len(freed) < num_tokens:
            leaves, stack = [], list(self.root.children.values())
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                if not n.children and n.lock_ref == 0:
                    leaves.append(n)
            if not leaves:
                break
            leaf = min(leaves, key=lambda n: (n.last_access, n.order))
            freed += leaf.value
            del leaf.parent.children[leaf.key[0]]
            self.evictable_size -= len(leaf.key)
        return freed


def test_a_tree_with_only_the_assignments_interface_drives_engine_metrics_policy_and_server():
    """Regression (issue 32): with a learner's tree, ``llm.get_metrics()`` raised AttributeError ('RadixTree' object
    has no attribute 'nodes') and the server's GET /metrics answered 500; ``dfs-weight`` and the lab's drawing read
    ``nodes()`` and node ids too. The manager, the policy and the lab now read a tree through the assignment's
    interface alone."""
    import httpx

    from tinypaged import LLM, SamplingParams
    from tinypaged.lab.radix_view import describe
    from tinypaged.entrypoints.server import ServerThread, create_app

    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}, {"prompt_token_ids": [1, 2, 3, 4, 9, 9]},
               {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 10]}]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    want = [o.outputs[0].token_ids for o in LLM("tiny", block_size=4, kv_cache_tokens=160).generate(prompts, params)]
    for order in ("lpm", "dfs-weight"):
        llm = LLM("tiny", block_size=4, kv_cache_tokens=160, max_num_seqs=1, check_invariants=True,
                  kv_cache_manager=RadixKVManager.factory(page_size=1, tree_factory=AssignmentTree),
                  scheduling_policy=CacheAwareOrder(order))
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want, order
        m = llm.get_metrics()
        assert m["radix_nodes"] > 0 and m["radix_cached_tokens"] > 0 and m["prefix_cache_hits"] > 0, m
        kv = llm.llm_engine.scheduler.kv
        kv.check_invariants()
        lines = describe(kv.tree)
        assert len(lines) == m["radix_nodes"] and sum("evicted next" in line for line in lines) == 1, lines
    srv = ServerThread(create_app(llm, "tiny", 8))
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.get(srv.url + "/metrics", timeout=60)
        assert r.status_code == 200 and "vllm:prefix_cache_hits_total" in r.text, r.text[:500]
    finally:
        srv.close()


@pytest.mark.parametrize("page_size, order", [(1, "lpm"), (4, "lpm"), (4, "dfs-weight")])
def test_a_page_size_1_tree_serves_any_page_size(page_size, order):
    """The radix manager is the lesson's tree at any page size: a tree written for page size 1 (the assignment's
    interface only) gets one symbol per whole page from the manager and finds the same hits, evicts the same
    pages and gives the same tokens as the engine's own RadixTree; at pages of 4 every hit is whole pages."""
    from tinypaged import LLM, SamplingParams

    r = random.Random(1)
    systems = [[r.randrange(1, 200) for _ in range(18)] for _ in range(3)]
    prompts = [{"prompt_token_ids": systems[i % 3] + [r.randrange(1, 200) for _ in range(r.randint(1, 7))]}
               for i in range(9)]
    runs = {}
    for name, factory in (("engine's", RadixTree), ("assignment's", AssignmentTree)):
        llm = LLM("tiny", block_size=4, kv_cache_tokens=64, max_num_seqs=2, check_invariants=True,
                  kv_cache_manager=RadixKVManager.factory(page_size, tree_factory=factory),
                  scheduling_policy=CacheAwareOrder(order))
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        llm.llm_engine.scheduler.kv.check_invariants()  # whole pages in every key, every page in one place
        m = llm.get_metrics()
        runs[name] = ([o.outputs[0].token_ids for o in outs], [o.metrics.num_cached_tokens for o in outs],
                      m["prefix_cache_evicted_tokens"], m["radix_cached_tokens"], m["radix_nodes"])
    assert runs["engine's"] == runs["assignment's"]
    _, hits, evicted, _, _ = runs["engine's"]
    assert sum(hits) > 0 and evicted > 0, "the run hits and evicts"
    assert all(h % page_size == 0 for h in hits)
