"""Stage 7: SGLang's RadixAttention, a radix tree of cached KV, as a KV cache manager for the engine.

vLLM (stage 3) names each *full block* by a hash chained on its parent's hash and keeps freed blocks in
an LRU free queue. SGLang (Zheng et al., 2023; ``python/sglang/srt/mem_cache/radix_cache.py``) keeps a
*radix tree*: each edge is a run of token ids together with the KV pages that hold them, so any shared
prefix, to the token when ``page_size == 1``, is found by walking from the root.

``RadixTree`` is stage 7's assignment, line for line (``solutions/07_radix_attention.ipynb``, part a): a tree of
``Node`` edges whose ``key`` is a run of symbols and ``value`` one page per symbol.

* ``match_prefix(key)`` walks the tree and returns the pages of the longest cached prefix of ``key`` and
  the node where it ends; a match that ends inside an edge *splits* that node (``split_node``), so every match
  ends on a node.
* ``insert(key, pages)`` adds ``key``; returns how many of its symbols were cached already (the caller's pages for
  those are duplicates: the tree keeps its own) and adopts ``pages`` for the rest.
* ``inc_lock_ref(node)`` / ``dec_lock_ref(node)`` protect a running request's path: a node with
  ``lock_ref > 0`` is never evicted. They move the path's size between ``protected_size`` and
  ``evictable_size``.
* ``evict(n)`` frees least recently used unlocked leaves until ``n`` symbols are freed (or nothing is left to
  evict); a parent that becomes a leaf may go next. "Recently used" is the tree's logical clock (``tick``), so the
  order is deterministic; equal stamps go by creation order (``Node.order``).

Pages of more than one token (SGLang's ``page_size > 1``): the tree stays the same, its *symbols* change.
``page_key(tokens, page_size)`` turns a token list into one symbol per whole page (the tuple of its tokens; a
partial last page is left out), so the tree matches, splits, locks and evicts whole pages only, its children are
keyed by their first page and its sizes count pages. At page size 1 a symbol is a token.

``check_tree`` asserts the tree's invariants (the property tests run it): every node holds one page per symbol, is
found under its parent by its first symbol, and holds pages no other node holds; ``evictable_size`` +
``protected_size`` is the symbols in the tree, split by whether ``lock_ref`` is 0; a locked node's parent is locked.

``RadixKVManager`` (the engine's ``KVCacheManager``) is built on any tree with the assignment's interface
(``tree_factory``, ``RadixTree`` by default): ``root`` (nodes with ``key``, ``value``, ``parent``, ``children``,
``lock_ref``, ``last_access``), ``evictable_size``, ``protected_size``, ``match_prefix``, ``insert``, ``evict``,
``inc_lock_ref``, ``dec_lock_ref``. It reads the tree through those alone (``tree_nodes`` walks it from ``root``) and
gives it ``page_key``s, so a learner's page-size-1 tree drives the engine, its metrics and the server at any page
size.

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
    (any tree with the assignment's interface)."""
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def page_key(token_ids, page_size: int = 1) -> tuple:
    """The tree's key for ``token_ids``: one symbol per whole page of ``page_size`` tokens (the tuple of its tokens),
    a partial last page left out; at page size 1 the tokens themselves."""
    if page_size == 1:
        return tuple(token_ids)
    whole = len(token_ids) - len(token_ids) % page_size
    return tuple(tuple(token_ids[i: i + page_size]) for i in range(0, whole, page_size))


def node_tokens(node) -> tuple:
    """The token ids of a node's edge, whatever its symbols (tokens, or pages as tuples of tokens)."""
    return tuple(t for sym in node.key for t in (sym if isinstance(sym, tuple) else (sym,)))


class Node:
    """One edge of the tree: ``key`` is a tuple of symbols (token ids at page size 1), ``value`` the page of each."""

    created = itertools.count()  # creation order: the tie-break between equal last_access values

    def __init__(self, key=(), value=(), parent=None):
        self.order = next(Node.created)
        self.children = {}  # first symbol of the child's key -> child
        self.parent = parent
        self.key, self.value = tuple(key), list(value)
        self.lock_ref = 0  # running requests whose path goes through this node
        self.last_access = 0  # the tree's clock when a match or insert last walked through it

    def __repr__(self) -> str:
        return f"Node(order={self.order}, symbols={len(self.key)}, lock={self.lock_ref})"


class RadixTree:
    """The tree (stage 7's assignment). Pages are plain ints; it never allocates or frees a page, it hands them back."""

    def __init__(self):
        self.root = Node()
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0
        self.clock = 0

    def tick(self):
        self.clock += 1
        return self.clock

    def inc_lock_ref(self, node):
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node):
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def split_node(self, node, n):
        """Cut ``node`` after ``n`` symbols: a new node holds the first ``n``, ``node`` keeps the rest below it;
        returns the new node."""
        top = Node(node.key[:n], node.value[:n], node.parent)
        top.lock_ref, top.last_access = node.lock_ref, node.last_access
        node.parent.children[node.key[0]] = top
        node.key, node.value, node.parent = node.key[n:], node.value[n:], top
        top.children[node.key[0]] = node
        return top

    def match_prefix(self, key):
        """Pages of the longest cached prefix of ``key`` and the node it ends on (split there if need be)."""
        key, node, pages, now = tuple(key), self.root, [], self.tick()
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access = now
            n = 0
            while n < min(len(child.key), len(key)) and child.key[n] == key[n]:
                n += 1
            if n < len(child.key):
                child = self.split_node(child, n)
            pages += child.value
            node, key = child, key[n:]
        return pages, node

    def insert(self, key, pages):
        """Add ``key``, held in ``pages``. Returns the symbols already cached: the tree keeps its own pages for those
        and adopts ``pages[cached:]`` for the rest, as one new leaf."""
        key, node, done, now = tuple(key), self.root, 0, self.tick()
        while done < len(key):
            child = node.children.get(key[done])
            if child is None:
                leaf = Node(key[done:], pages[done:len(key)], node)
                leaf.last_access = now
                node.children[key[done]] = leaf
                self.evictable_size += len(leaf.key)
                return done
            child.last_access = now
            n = 0
            while n < min(len(child.key), len(key) - done) and child.key[n] == key[done + n]:
                n += 1
            if n < len(child.key):
                child = self.split_node(child, n)
            node, done = child, done + n
        return done

    def evict(self, num_tokens):
        """Free unlocked leaves, least recently used first, until ``num_tokens`` symbols are freed; their pages."""
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node.lock_ref == 0:
                leaves.append((node.last_access, node.order, node))
        heapq.heapify(leaves)
        freed = []
        while leaves and len(freed) < num_tokens:
            _, _, leaf = heapq.heappop(leaves)
            freed += leaf.value
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.evictable_size -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, parent.order, parent))
        return freed


def check_tree(tree) -> None:
    """Assert a tree's invariants, read through the assignment's interface (any tree, a learner's too)."""
    seen, evictable, protected = set(), 0, 0
    for node in tree_nodes(tree):
        assert len(node.key) > 0 and len(node.key) == len(node.value), f"{node}: one page per symbol"
        assert node.parent.children.get(node.key[0]) is node, "a child is keyed by its first symbol"
        assert node.lock_ref >= 0 and (node.lock_ref == 0 or node.parent.lock_ref > 0), "locks cover the path"
        assert not seen & set(node.value), f"page held by two nodes: {seen & set(node.value)}"
        seen |= set(node.value)
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
    assert (evictable, protected) == (tree.evictable_size, tree.protected_size), \
        f"sizes {(tree.evictable_size, tree.protected_size)} but the nodes hold {(evictable, protected)}"


class RadixKVManager:
    """``tinypaged.interfaces.KVCacheManager`` over a radix tree (SGLang's memory manager, course-sized).

    The cache is ``capacity // page_size`` pages. Every page is in exactly one place: the free list, a
    tree node, or ``owned`` by one running sequence (its tokens not in the tree yet, or duplicates of
    tokens another sequence put there first). A running sequence's ``table`` maps its positions to pages
    and may point at tree pages: the sequence locks the deepest tree node it uses, so none is evicted.

    Tokens reach the tree at allocation for prefill steps (the prompt, or what a preempted request
    recomputes) and at ``free``: everything computed, the outputs included, stays cached (the paper's
    multi-turn win). ``block_size`` is ``page_size``: ``get_computed_blocks`` returns pages. The tree sees
    ``page_key``s (one symbol per whole page), so its sizes and ``evict`` count pages.
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
        self.tree = tree if tree is not None else RadixTree()
        self.free_pages = deque(range(self.num_pages))
        self.tables: dict[int, list[int]] = {}  # seq_id -> page of each page-sized run of positions
        self.owned: dict[int, set[int]] = {}  # seq_id -> pages it alone holds
        self.locked: dict[int, Node] = {}  # seq_id -> the deepest tree node it uses
        self.published: dict[int, int] = {}  # seq_id -> tokens of it the tree holds
        self.prefix_queries = self.prefix_hits = self.evicted_tokens = 0

    @classmethod
    def factory(cls, page_size: int | None = None, tree_factory=RadixTree):
        """``LLM(kv_cache_manager=RadixKVManager.factory(page_size=1))``; ``None``: the engine's block_size.
        ``tree_factory()`` builds the tree (a learner's ``RadixTree`` class will do, at any page size)."""
        def build(spec):
            return cls(spec.capacity_tokens, page_size or spec.block_size, spec.max_model_len, tree_factory())
        return build

    def key(self, token_ids) -> tuple:
        """What the tree is asked for: ``page_key(token_ids, page_size)``."""
        return page_key(token_ids, self.page_size)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Pages held by running sequences (cached pages nobody uses count as free, as in vLLM)."""
        return 1.0 - (len(self.free_pages) + self.tree.evictable_size) / self.num_pages

    def max_tokens_needed(self, seq) -> int:
        return seq.max_total_tokens(self.max_model_len or len(seq) + (seq.params.max_tokens or 0))

    # -- prefix lookup ---------------------------------------------------------------------------
    def get_computed_blocks(self, seq) -> list[int]:
        """Pages of the longest cached prefix, at most ``len(seq) - 1`` tokens (one must run)."""
        if seq.seq_id in self.tables:
            return []
        pages, _ = self.tree.match_prefix(self.key(seq.token_ids[: len(seq) - 1]))
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
            pages, node = self.tree.match_prefix(self.key(seq.token_ids[: k * p])) if k else ([], self.tree.root)
            if pages != list(computed_blocks):
                return False  # evicted since the lookup: the scheduler will look again
            self.tree.inc_lock_ref(node)  # before evicting anything, so our own hit stays
            table = list(pages)
        else:
            table = self.tables[sid]
        start = seq.num_computed_tokens + len(computed_blocks) * p
        need = max(-(-(start + num_new_tokens) // p) - len(table), 0)
        if need > len(self.free_pages) + self.tree.evictable_size:
            if fresh:
                self.tree.dec_lock_ref(node)
            return False
        if need > len(self.free_pages):
            freed = self.tree.evict(need - len(self.free_pages))
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
        key, pages = self.key(seq.token_ids[:end]), self.tables[sid][: end // p]
        cached = self.tree.insert(key, pages)
        self.owned[sid].difference_update(pages[cached:])  # adopted by the tree
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
        t, p = self.tree, self.page_size
        return {
            "kv_num_pages": self.num_pages, "kv_page_size": self.page_size, "kv_pages_free": len(self.free_pages),
            "kv_cache_usage": self.usage, "radix_nodes": sum(1 for _ in tree_nodes(t)),
            "radix_cached_tokens": (t.evictable_size + t.protected_size) * p,
            "radix_evictable_tokens": t.evictable_size * p, "radix_protected_tokens": t.protected_size * p,
            "prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            "prefix_cache_evicted_tokens": self.evicted_tokens,
        }

    def check_invariants(self) -> None:
        """Every page is in exactly one place: free, one tree node, or owned by one sequence; the tree's own
        invariants hold (``check_tree``) and every key in it is whole pages of tokens."""
        check_tree(self.tree)
        if self.page_size > 1:
            for n in tree_nodes(self.tree):
                assert all(len(sym) == self.page_size for sym in n.key), f"{n}: a symbol that is not a whole page"
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
