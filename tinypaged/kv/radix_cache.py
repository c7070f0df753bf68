"""Stage 7: SGLang's RadixAttention, a radix tree of cached KV, as a KV cache manager for the engine.

vLLM (stage 3) names each *full block* by a hash chained on its parent's hash and keeps freed blocks in
an LRU free queue. SGLang (Zheng et al., 2023; ``python/sglang/srt/mem_cache/radix_cache.py``) keeps a
*radix tree*: each edge is a run of token ids together with the KV pages that hold them, so any shared
prefix, to the token when ``page_size == 1``, is found by walking from the root.

``RadixCache`` (the tree, on plain token lists and page ids):

* ``match_prefix(key)`` walks the tree and returns the pages of the longest cached prefix of ``key`` and
  the node where it ends; a match that ends inside an edge *splits* that node, so every match ends on a node.
* ``insert(key, pages)`` adds ``key``; returns how many of its tokens were cached already (the caller's pages
  for those are duplicates: the tree keeps its own) and adopts ``pages`` for the rest.
* ``inc_lock_ref(node)`` / ``dec_lock_ref(node)`` protect a running request's path: a node with
  ``lock_ref > 0`` is never evicted. They move the path's size between ``protected_size`` and
  ``evictable_size``.
* ``evict(num_tokens)`` frees least recently used unlocked leaves until ``num_tokens`` are freed (or nothing
  is left to evict); a parent that becomes a leaf may go next.

Invariants (``check_invariants``, run by the property tests): every node's key length is a multiple of
``page_size`` and equals ``page_size * len(value)``; children are keyed by their first page of tokens; a
page is held by at most one node; ``evictable_size`` + ``protected_size`` is the tokens in the tree, split by
whether ``lock_ref`` is 0; a locked node's parent is locked too.

``RadixKVManager`` takes any tree with the interface of stage 7's assignment (``tree_factory``): ``root`` (nodes with
``key``, ``value``, ``parent``, ``children``, ``lock_ref``, ``last_access``), ``evictable_size``, ``protected_size``,
``match_prefix``, ``insert``, ``evict``, ``inc_lock_ref``, ``dec_lock_ref``. It reads the tree through those
alone (``tree_nodes`` walks it from ``root``), so a learner's tree drives the engine, its metrics and the server.

Labels: the tree, LRU leaf eviction, lock references and output KV kept after a request are the SGLang
paper's and SGLang today's; publishing a prompt's pages at allocation (so requests in the same step share
them, as vLLM's hashed blocks do) is course-only: SGLang inserts after the chunk has run.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque


def tree_nodes(tree):
    """Every node of ``tree`` but the root, parents before children, read through ``root`` and ``children`` only
    (any tree with the assignment's interface, not just ``RadixCache``)."""
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


class TreeNode:
    """An edge of the tree: ``key`` (token ids) and ``value`` (one KV page per ``page_size`` tokens)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")
    _ids = itertools.count()

    def __init__(self, key=(), value=(), parent=None):
        self.children: dict[tuple, TreeNode] = {}
        self.parent = parent
        self.key, self.value = tuple(key), list(value)
        self.lock_ref = 0
        self.last_access = 0
        self.id = next(TreeNode._ids)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, tokens={len(self.key)}, lock={self.lock_ref})"


class RadixCache:
    """The tree. Pages are plain ints; it never allocates or frees a page itself, it hands them back."""

    def __init__(self, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes
        self._clock = itertools.count(1)  # a logical clock: LRU order is deterministic

    # -- helpers -------------------------------------------------------------------------
    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _child_key(self, key) -> tuple:
        return tuple(key[: self.page_size])

    def _match_len(self, a, b) -> int:
        """Tokens ``a`` and ``b`` share from the start, rounded down to whole pages."""
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return self._aligned(n)

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut ``node`` after ``n`` tokens: a new parent holds the first ``n``, ``node`` keeps the rest.
        The new node inherits the lock count and access time, so the sizes do not move."""
        p = self.page_size
        top = TreeNode(node.key[:n], node.value[: n // p], node.parent)
        top.lock_ref, top.last_access = node.lock_ref, node.last_access
        node.parent.children[self._child_key(node.key)] = top
        node.key, node.value, node.parent = node.key[n:], node.value[n // p:], top
        top.children[self._child_key(node.key)] = node
        return top

    # -- the three operations --------------------------------------------------------------
    def match_prefix(self, key) -> tuple[list[int], TreeNode]:
        """Pages of the longest cached prefix of ``key`` (whole pages) and the node it ends on."""
        key = tuple(key[: self._aligned(len(key))])
        node, pages, now = self.root, [], next(self._clock)
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = now
            n = self._match_len(child.key, key)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            pages += child.value
            node, key = child, key[n:]
        return pages, node

    def insert(self, key, pages) -> int:
        """Add ``key`` (whole pages of it), held in ``pages``. Returns the tokens already cached: the tree
        keeps its own pages for those and adopts ``pages[cached // page_size:]`` for the rest."""
        key = tuple(key[: self._aligned(len(key))])
        p, node, done, now = self.page_size, self.root, 0, next(self._clock)
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                leaf = TreeNode(rest, pages[done // p: len(key) // p], node)
                leaf.last_access = now
                node.children[self._child_key(rest)] = leaf
                self.evictable_size += len(rest)
                return done
            child.last_access = now
            n = self._match_len(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            node, done = child, done + n
        return done

    def evict(self, num_tokens: int) -> list[int]:
        """Free LRU unlocked leaves until ``num_tokens`` tokens are freed; returns their pages."""
        heap = [(n.last_access, n.id, n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) * self.page_size < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            freed += leaf.value
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            self.evictable_size -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # -- lock references ---------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # -- reading the tree ----------------------------------------------------------------------
    def nodes(self):
        """Every node but the root, parents before children."""
        return tree_nodes(self)

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def next_victim(self) -> TreeNode | None:
        """The leaf ``evict`` would free first (for pictures and lessons)."""
        leaves = [n for n in self.nodes() if not n.children and n.lock_ref == 0]
        return min(leaves, key=lambda n: (n.last_access, n.id), default=None)

    def check_invariants(self) -> None:
        seen, evictable, protected, p = set(), 0, 0, self.page_size
        for node in self.nodes():
            assert len(node.key) > 0 and len(node.key) % p == 0 and len(node.key) == p * len(node.value), node
            assert node.parent.children.get(self._child_key(node.key)) is node, "child keyed by its first page"
            assert node.lock_ref >= 0 and (node.lock_ref == 0 or node.parent.lock_ref > 0), "locks cover the path"
            assert not seen & set(node.value), f"page held by two nodes: {seen & set(node.value)}"
            seen |= set(node.value)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), \
            f"sizes {(self.evictable_size, self.protected_size)} but the nodes hold {(evictable, protected)}"


class RadixKVManager:
    """``tinypaged.interfaces.KVCacheManager`` over a radix tree (SGLang's memory manager, course-sized).

    The cache is ``capacity // page_size`` pages. Every page is in exactly one place: the free list, a
    tree node, or ``owned`` by one running sequence (its tokens not in the tree yet, or duplicates of
    tokens another sequence put there first). A running sequence's ``table`` maps its positions to pages
    and may point at tree pages: the sequence locks the deepest tree node it uses, so none is evicted.

    Tokens reach the tree at allocation for prefill steps (the prompt, or what a preempted request
    recomputes) and at ``free``: everything computed, the outputs included, stays cached (the paper's
    multi-turn win). ``block_size`` is ``page_size``: ``get_computed_blocks`` returns pages.
    """

    def __init__(self, capacity_tokens: int, page_size: int = 1, max_model_len: int | None = None, tree=None):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.block_size = self.page_size = page_size
        self.num_pages = capacity_tokens // page_size
        if self.num_pages < 1:
            raise ValueError(f"a cache of {capacity_tokens} tokens holds no page of {page_size} tokens")
        self.capacity_tokens = self.num_pages * page_size
        self.max_model_len = max_model_len
        self.tree = tree if tree is not None else RadixCache(page_size)
        self.free_pages = deque(range(self.num_pages))
        self.tables: dict[int, list[int]] = {}  # seq_id -> page of each page-sized run of positions
        self.owned: dict[int, set[int]] = {}  # seq_id -> pages it alone holds
        self.locked: dict[int, TreeNode] = {}  # seq_id -> the deepest tree node it uses
        self.published: dict[int, int] = {}  # seq_id -> tokens of it the tree holds
        self.prefix_queries = self.prefix_hits = self.evicted_tokens = 0

    @classmethod
    def factory(cls, page_size: int | None = None, tree_factory=None):
        """``LLM(kv_cache_manager=RadixKVManager.factory(page_size=1))``; ``None``: the engine's block_size."""
        def build(spec):
            p = page_size or spec.block_size
            return cls(spec.capacity_tokens, p, spec.max_model_len, tree_factory(p) if tree_factory else None)
        return build

    # -- sizes --------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Pages held by running sequences (cached pages nobody uses count as free, as in vLLM)."""
        return 1.0 - (len(self.free_pages) + self.tree.evictable_size // self.page_size) / self.num_pages

    def max_tokens_needed(self, seq) -> int:
        return seq.max_total_tokens(self.max_model_len or len(seq) + (seq.params.max_tokens or 0))

    # -- prefix lookup ---------------------------------------------------------------------------
    def get_computed_blocks(self, seq) -> list[int]:
        """Pages of the longest cached prefix, at most ``len(seq) - 1`` tokens (one must run)."""
        if seq.seq_id in self.tables:
            return []
        pages, _ = self.tree.match_prefix(seq.token_ids[: len(seq) - 1])
        return pages

    def record_prefix_lookup(self, seq, num_hit_tokens: int) -> None:
        self.prefix_queries += len(seq)
        self.prefix_hits += num_hit_tokens

    # -- allocation -------------------------------------------------------------------------------
    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks=()) -> bool:
        sid, p = seq.seq_id, self.page_size
        fresh = sid not in self.tables
        if fresh:
            k = len(computed_blocks)
            pages, node = self.tree.match_prefix(seq.token_ids[: k * p]) if k else ([], self.tree.root)
            if pages != list(computed_blocks):
                return False  # evicted since the lookup: the scheduler will look again
            self.tree.inc_lock_ref(node)  # before evicting anything, so our own hit stays
            table = list(pages)
        else:
            table = self.tables[sid]
        start = seq.num_computed_tokens + len(computed_blocks) * p
        need = max(-(-(start + num_new_tokens) // p) - len(table), 0)
        if need > len(self.free_pages) + self.tree.evictable_size // p:
            if fresh:
                self.tree.dec_lock_ref(node)
            return False
        if need > len(self.free_pages):
            freed = self.tree.evict((need - len(self.free_pages)) * p)
            self.evicted_tokens += len(freed) * p
            self.free_pages.extend(freed)
        new = [self.free_pages.popleft() for _ in range(need)]
        if fresh:
            self.tables[sid], self.owned[sid], self.locked[sid] = table, set(), node
            self.published[sid] = len(pages) * p
        table.extend(new)
        self.owned[sid].update(new)
        if not seq.is_decoding:  # a prefill: its tokens are known and this step writes them
            self._publish(seq, min(start + num_new_tokens, len(seq)))
        return True

    def _publish(self, seq, upto: int) -> None:
        """Give the tree ``seq``'s tokens up to ``upto`` (whole pages) and lock the node they end on."""
        sid, p = seq.seq_id, self.page_size
        end = upto - upto % p
        if end <= self.published[sid]:
            return
        key, pages = seq.token_ids[:end], self.tables[sid][: end // p]
        cached = self.tree.insert(key, pages)
        self.owned[sid].difference_update(pages[cached // p:])  # adopted by the tree
        _, node = self.tree.match_prefix(key)
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(self.locked[sid])
        self.locked[sid], self.published[sid] = node, end

    def free(self, seq) -> None:
        """The computed tokens stay in the tree (unlocked: evictable); the rest goes back to the free list."""
        sid = seq.seq_id
        if sid not in self.tables:
            return
        self._publish(seq, seq.num_computed_tokens)
        self.free_pages.extend(sorted(self.owned.pop(sid)))
        self.tree.dec_lock_ref(self.locked.pop(sid))
        del self.tables[sid], self.published[sid]

    # -- addressing -------------------------------------------------------------------------------
    def slot_mapping(self, seq, start: int, end: int) -> list[int]:
        table, p = self.tables[seq.seq_id], self.page_size
        return [table[j // p] * p + j % p for j in range(start, end)]

    def context_slots(self, seqs, context_len: int):
        import torch

        rows = []
        for s in seqs:
            n = min(context_len, len(self.tables[s.seq_id]) * self.page_size)
            rows.append(self.slot_mapping(s, 0, n) + [0] * (context_len - n))
        return torch.tensor(rows, dtype=torch.long)

    def stats(self) -> dict:
        t = self.tree
        return {
            "kv_num_pages": self.num_pages, "kv_page_size": self.page_size, "kv_pages_free": len(self.free_pages),
            "kv_cache_usage": self.usage, "radix_nodes": sum(1 for _ in tree_nodes(t)),
            "radix_cached_tokens": t.evictable_size + t.protected_size, "radix_evictable_tokens": t.evictable_size,
            "radix_protected_tokens": t.protected_size,
            "prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            "prefix_cache_evicted_tokens": self.evicted_tokens,
        }

    def check_invariants(self) -> None:
        """Every page is in exactly one place: free, one tree node, or owned by one sequence (and the tree's own
        invariants, if it has a ``check_invariants``)."""
        if hasattr(self.tree, "check_invariants"):
            self.tree.check_invariants()
        places = list(self.free_pages) + [pg for n in tree_nodes(self.tree) for pg in n.value]
        places += [pg for own in self.owned.values() for pg in own]
        assert sorted(places) == list(range(self.num_pages)), "a page is lost or in two places"
        tree_pages = {pg for n in tree_nodes(self.tree) for pg in n.value}
        for sid, table in self.tables.items():
            locked_path, node = set(), self.locked[sid]
            while node is not self.tree.root:
                assert node.lock_ref > 0
                locked_path |= set(node.value)
                node = node.parent
            for pg in table:
                assert pg in self.owned[sid] or pg in locked_path, f"seq {sid} reads page {pg} it does not hold"
                assert pg in self.owned[sid] or pg in tree_pages
