"""Stage 9: routing requests across replicas. The learner's cache-aware router and the baselines beside it.

A *routing policy* is any object with ``route(prompt_token_ids) -> replica index`` and ``finished(replica)``
(called when a request the policy routed there has completed). The course's HTTP proxy
(``tinypaged.entrypoints.router_proxy``) and the fleet simulator (``tinypaged.lab.fleet_sim``) run any such
object; neither looks inside it.

``CacheAwareRouter`` is stage 9's assignment, line for line (``solutions/09_many_engines.ipynb``): an
*approximate* prefix-cache router. It never asks a replica what it holds; it remembers what it sent where, one
stage-7 ``RadixTree`` per replica (``tinypaged.kv.radix_cache.RadixTree``: the lesson's tree is the package's),
and follows the rule of SGLang's router and vLLM's router (``vllm-router --policy cache_aware``; their help text
and docs state it, this is the course's own code):

1. **Load first.** With ``load`` the requests in flight per replica, the fleet is *imbalanced* when
   ``max(load) - min(load) > balance_abs_threshold`` **and** ``max(load) > min(load) * balance_rel_threshold``
   (``imbalanced()``); then the request goes to the least loaded replica (the lowest index on ties).
2. **Otherwise cache.** Each replica's tree is matched; the replica with the longest match (lowest index on ties)
   wins if ``matched / len(prompt) > cache_threshold``. Below the threshold the request goes to the replica whose
   tree is smallest: the one with the most room in its cache (lowest index on ties).
3. Either way the prompt is inserted into the chosen replica's tree, its load goes up by one, and a tree over
   ``max_tree_size`` tokens evicts its least recently used leaves back down to it (the routers evict on a timer,
   ``--eviction-interval-secs``; here it happens at insert, so a run is deterministic).

Defaults are ``vllm-router``'s (``--cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5``;
its ``--max-tree-size`` counts characters, 2**25). SGLang's router matches the request's *text*; the course's
policies see token ids (the proxy passes a text prompt's UTF-8 bytes, a text-level match like SGLang's).

Baselines, as ``vllm-router`` names them: ``RoundRobin``, ``PowerOfTwo`` (two random replicas, the less loaded),
``ConsistentHash`` (a hash ring over a request key: here the prompt's first ``key_tokens`` tokens). The *precise*
router (``PreciseRouter``) is the same rule matched against the replicas' real caches instead of the router's own
trees: what ``kv_aware`` (vLLM's KV events) and llm-d's precise prefix-cache scorer do. Where the two disagree is
eviction: a replica that dropped a prefix still has it in the router's tree.
"""

from __future__ import annotations

import bisect
import hashlib
import random

from tinypaged.kv.radix_cache import RadixTree

POLICIES = ("round_robin", "power_of_two", "consistent_hash", "cache_aware", "precise")


def _check_replicas(num_replicas) -> int:
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1 (got {num_replicas!r})")
    return num_replicas


def _check_prompt(prompt_token_ids) -> tuple:
    key = tuple(prompt_token_ids)
    if not key:
        raise ValueError("prompt_token_ids must not be empty")
    return key


class _Loaded:
    """In-flight requests per replica: ``route`` adds one, ``finished`` takes it back."""

    def __init__(self, num_replicas: int):
        self.num_replicas = _check_replicas(num_replicas)
        self.load = [0] * num_replicas

    def finished(self, replica: int) -> None:
        if not 0 <= replica < self.num_replicas or self.load[replica] == 0:
            raise ValueError(f"finished({replica}): no request in flight on that replica")
        self.load[replica] -= 1


class RoundRobin(_Loaded):
    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self.next = 0

    def route(self, prompt_token_ids) -> int:
        _check_prompt(prompt_token_ids)
        choice, self.next = self.next, (self.next + 1) % self.num_replicas
        self.load[choice] += 1
        return choice


class PowerOfTwo(_Loaded):
    """Two replicas drawn at random (seeded); the less loaded one (the first drawn on ties)."""

    def __init__(self, num_replicas: int, seed: int = 0):
        super().__init__(num_replicas)
        self.rng = random.Random(seed)

    def route(self, prompt_token_ids) -> int:
        _check_prompt(prompt_token_ids)
        if self.num_replicas == 1:
            choice = 0
        else:
            a, b = self.rng.sample(range(self.num_replicas), 2)
            choice = b if self.load[b] < self.load[a] else a
        self.load[choice] += 1
        return choice


class ConsistentHash(_Loaded):
    """A hash ring with ``virtual_nodes`` points per replica; a request goes to the first point at or after its
    key's hash. The key is the prompt's first ``key_tokens`` tokens (a real router hashes a session or user id)."""

    def __init__(self, num_replicas: int, key_tokens: int = 32, virtual_nodes: int = 64):
        super().__init__(num_replicas)
        if key_tokens < 1 or virtual_nodes < 1:
            raise ValueError("key_tokens and virtual_nodes must be >= 1")
        self.key_tokens = key_tokens
        points = sorted((self._hash(f"replica-{r}-{v}".encode()), r)
                        for r in range(num_replicas) for v in range(virtual_nodes))
        self.ring = [p for p, _ in points]
        self.owner = [r for _, r in points]

    @staticmethod
    def _hash(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")

    def route(self, prompt_token_ids) -> int:
        key = _check_prompt(prompt_token_ids)[: self.key_tokens]
        h = self._hash(",".join(map(str, key)).encode())
        choice = self.owner[bisect.bisect_left(self.ring, h) % len(self.ring)]
        self.load[choice] += 1
        return choice


class CacheAwareRouter:
    """Stage 9's assignment: approximate cache-aware routing over one ``RadixTree`` per replica (module docstring)."""

    def __init__(self, num_replicas, cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5,
                 max_tree_size=2**25):
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1 (got {num_replicas!r})")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1] (got {cache_threshold!r})")
        if balance_abs_threshold < 0 or balance_rel_threshold < 0:
            raise ValueError("balance_abs_threshold and balance_rel_threshold must be >= 0")
        if max_tree_size < 1:
            raise ValueError(f"max_tree_size must be >= 1 (got {max_tree_size!r})")
        self.num_replicas = num_replicas
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.trees = [RadixTree() for _ in range(num_replicas)]
        self.load = [0] * num_replicas

    def imbalanced(self):
        """Whether the fleet is out of balance: ``max - min > abs`` and ``max > min * rel`` (both must hold)."""
        ### BEGIN SOLUTION
        lo, hi = min(self.load), max(self.load)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold
        ### END SOLUTION

    def tree_size(self, replica):
        tree = self.trees[replica]
        return tree.evictable_size + tree.protected_size

    def matched(self, replica, key):
        """Tokens of ``key`` found in ``replica``'s tree (a subclass may look somewhere else: ``PreciseRouter``)."""
        return len(self.trees[replica].match_prefix(key)[0])

    def route(self, prompt_token_ids):
        key = tuple(prompt_token_ids)
        if not key:
            raise ValueError("prompt_token_ids must not be empty")
        ### BEGIN SOLUTION
        replicas = range(self.num_replicas)
        if self.imbalanced():
            choice = min(replicas, key=lambda r: self.load[r])
        else:
            matched = [self.matched(r, key) for r in replicas]
            best = max(replicas, key=lambda r: (matched[r], -r))
            if matched[best] / len(key) > self.cache_threshold:
                choice = best
            else:
                choice = min(replicas, key=lambda r: self.tree_size(r))
        tree = self.trees[choice]
        tree.insert(key, list(range(len(key))))
        over = self.tree_size(choice) - self.max_tree_size
        if over > 0:
            tree.evict(over)
        self.load[choice] += 1
        return choice
        ### END SOLUTION

    def finished(self, replica):
        if not 0 <= replica < self.num_replicas or self.load[replica] == 0:
            raise ValueError(f"finished({replica}): no request in flight on that replica")
        self.load[replica] -= 1


class PreciseRouter(CacheAwareRouter):
    """The same rule, matched against the replicas' real caches: ``lookup(replica, key)`` returns the tokens of
    ``key`` that replica holds (in the simulator, its cache; in production, an index fed by KV events)."""

    def __init__(self, num_replicas, lookup, **kw):
        super().__init__(num_replicas, **kw)
        self.lookup = lookup

    def matched(self, replica, key):
        return self.lookup(replica, key)

    def tree_size(self, replica):
        return self.load[replica]  # no tree of its own: below the threshold, the least loaded replica


def make_policy(name: str, num_replicas: int, seed: int = 0, lookup=None, **kw):
    """A baseline by ``vllm-router``'s name, ``cache_aware`` (the reference router) or ``precise`` (needs
    ``lookup``)."""
    if name == "round_robin":
        return RoundRobin(num_replicas)
    if name == "power_of_two":
        return PowerOfTwo(num_replicas, seed)
    if name == "consistent_hash":
        return ConsistentHash(num_replicas)
    if name == "cache_aware":
        return CacheAwareRouter(num_replicas, **kw)
    if name == "precise":
        if lookup is None:
            raise ValueError("policy 'precise' needs lookup(replica, key): the replicas' real caches")
        return PreciseRouter(num_replicas, lookup, **kw)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
