"""Stage 9: routing at production scale by simulation: N replicas (16-64) behind a routing policy.

No engine runs. Each replica is modelled by two things:

* **its prefix cache**: a stage-7 ``RadixTree`` over the prompts it served, in blocks of ``block_size`` tokens
  (``page_key``: one symbol per whole block, as vLLM's hashed blocks), holding at most ``cache_tokens`` tokens
  and evicting least recently used leaves beyond that; a request's hit is the cached part of its prompt;
* **its time**: one queue served in arrival order. A request's prefill costs the cost model's step for its
  *uncached* tokens (attending over the whole prompt), and it then holds the replica for ``output_len`` decode
  tokens at ``decode_batch`` sequences per step (continuous batching amortised: one step of ``decode_batch``
  sequences, divided by ``decode_batch``). TTFT is the wait in the queue plus the prefill.

That is a queueing model, not the engine's scheduler (``tinypaged.lab.simulator`` replays the real scheduler on
one replica; 64 of them would take minutes): it keeps what routing changes (where the prefix is cached, how long
the queues get) and drops what it does not (batch composition). The cost model is stage 6's roofline of the
paper's setting, OPT-13B on an A100 (``OPT13B_A100``), with the paper's KV budget per replica (15.7K tokens).

Traffic (``mixed_trace``): Poisson arrivals; a ``shared`` fraction of requests start with one of ``num_prefixes``
system prompts (popularity Zipf-like, seeded), the rest are ShareGPT-like prompts of their own; prompt and
output lengths are ShareGPT-like (``tinypaged.lab.workloads``). The router sees every arrival in time order, and
``finished`` when the request's decode ends. ``precise`` routes on the replicas' real caches (the ``kv_aware``
stand-in); ``cache_aware`` on its own trees, which do not know what the replicas evicted.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from tinypaged.kv.radix_cache import RadixTree, page_key
from tinypaged.lab.routing import POLICIES, make_policy
from tinypaged.lab.serving import PAPER_KV_TOKENS, BatchShape
from tinypaged.lab.simulator import OPT13B_A100
from tinypaged.lab.workloads import sharegpt_like

MAX_REQUESTS = 20000  # a bound on one run (every loop below is bounded by the trace's length)


@dataclass(frozen=True)
class FleetRequest:
    arrival: float
    prompt: tuple[int, ...]
    output_len: int
    prefix_id: int  # which system prompt it starts with; -1: none


def mixed_trace(num_requests: int, rate: float, shared: float = 0.7, num_prefixes: int = 64, prefix_len: int = 512,
                seed: int = 0) -> list[FleetRequest]:
    """Poisson arrivals at ``rate`` requests/s; a ``shared`` fraction starts with one of ``num_prefixes`` system
    prompts of ``prefix_len`` tokens (prompt i drawn with weight 1/(i+1)); lengths ShareGPT-like."""
    if not 0 < num_requests <= MAX_REQUESTS:
        raise ValueError(f"num_requests must be in 1..{MAX_REQUESTS} (got {num_requests})")
    if rate <= 0 or not 0 <= shared <= 1 or num_prefixes < 1 or prefix_len < 1:
        raise ValueError("rate > 0, 0 <= shared <= 1, num_prefixes >= 1 and prefix_len >= 1 are needed")
    r = random.Random(seed)
    prefixes = [tuple(r.randrange(100, 32000) for _ in range(prefix_len)) for _ in range(num_prefixes)]
    weights = [1 / (i + 1) for i in range(num_prefixes)]
    base = sharegpt_like(num_requests, seed=seed, rate=rate, max_len=2048 - prefix_len)
    out = []
    for req in base:
        own = tuple(r.randrange(100, 32000) for _ in range(req.prompt_len))
        if r.random() < shared:
            pid = r.choices(range(num_prefixes), weights)[0]
            out.append(FleetRequest(req.arrival_time, prefixes[pid] + own, req.output_len, pid))
        else:
            out.append(FleetRequest(req.arrival_time, own, req.output_len, -1))
    return out


class Replica:
    """One replica: its prefix cache (a RadixTree in blocks) and its queue (when it is next free)."""

    def __init__(self, cache_tokens: int, block_size: int):
        self.tree, self.block_size = RadixTree(), block_size
        self.capacity = max(1, cache_tokens // block_size)  # in blocks
        self.free_at = 0.0

    def cached(self, key) -> int:
        """Blocks of ``key`` (a prompt's ``page_key``) this replica holds, without touching its LRU order."""
        node, n = self.tree.root, 0
        while n < len(key) and key[n] in node.children:
            child = node.children[key[n]]
            k = 0
            while k < len(child.key) and n + k < len(key) and child.key[k] == key[n + k]:
                k += 1
            n += k
            if k < len(child.key):
                break
            node = child
        return n

    def serve(self, prompt) -> int:
        """Look the prompt up (stamping what it uses), then cache it; the tokens it found."""
        key = page_key(prompt, self.block_size)
        hit = len(self.tree.match_prefix(key)[0]) * self.block_size
        self.tree.insert(key, list(range(len(key))))
        over = self.tree.evictable_size + self.tree.protected_size - self.capacity
        if over > 0:
            self.tree.evict(over)
        return hit


@dataclass
class FleetResult:
    policy: str
    num_replicas: int
    prompt_tokens: int
    hit_tokens: int
    ttft: list[float]  # per request, in arrival order
    per_replica: list[int]  # requests served by each replica
    went: list[int]  # the replica of each request, in arrival order
    hits: list[int]  # prompt tokens each request found cached, in arrival order

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens

    def ttft_quantile(self, q: float) -> float:
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    @property
    def imbalance(self) -> float:
        """Most requests on one replica over the mean (1.0: perfectly even)."""
        return max(self.per_replica) / (sum(self.per_replica) / len(self.per_replica))


def simulate_fleet(trace: list[FleetRequest], policy: str, num_replicas: int, cost_model=OPT13B_A100,
                   cache_tokens: int = PAPER_KV_TOKENS, block_size: int = 16, decode_batch: int = 32, seed: int = 0,
                   **policy_kw) -> FleetResult:
    """Serve ``trace`` on ``num_replicas`` replicas behind ``policy`` (a name from ``routing.POLICIES`` or a
    policy object with ``route``/``finished``)."""
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or not 1 <= num_replicas <= 1024:
        raise ValueError(f"num_replicas must be an int in 1..1024 (got {num_replicas!r})")
    if decode_batch < 1 or block_size < 1 or cache_tokens < block_size:
        raise ValueError("decode_batch >= 1, block_size >= 1 and cache_tokens >= block_size are needed")
    if len(trace) > MAX_REQUESTS:
        raise ValueError(f"the trace has {len(trace)} requests; at most {MAX_REQUESTS}")
    replicas = [Replica(cache_tokens, block_size) for _ in range(num_replicas)]
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        name = policy
        router = make_policy(policy, num_replicas, seed=seed, lookup=lambda r, key: replicas[r].cached(key),
                             **({"max_tree_size": 1} if policy == "precise" else {}), **policy_kw)
    else:
        name, router = type(policy).__name__, policy
    decode_step = cost_model(BatchShape(num_seqs=decode_batch, num_decode_tokens=decode_batch,
                                        context_tokens=decode_batch * 512)) / decode_batch
    done: list[tuple[float, int]] = []  # (finish time, replica) of requests in flight
    ttft, per_replica, prompt_tokens, hit_tokens, went, hits = [], [0] * num_replicas, 0, 0, [], []
    for req in sorted(trace, key=lambda q: q.arrival):
        while done and done[0][0] <= req.arrival:
            router.finished(heapq.heappop(done)[1])
        # the routers see the prompt in blocks too (a block's symbol is the tuple of its tokens): the same match
        # to the block, and 16 times fewer steps in Python; a prompt shorter than a block is one partial symbol
        r = router.route(page_key(req.prompt, block_size) or (tuple(req.prompt),))
        if not 0 <= r < num_replicas:
            raise ValueError(f"the policy routed to replica {r}; there are {num_replicas}")
        rep = replicas[r]
        hit = min(rep.serve(req.prompt), len(req.prompt) - 1)  # the last prompt token is always computed
        new = len(req.prompt) - hit
        prefill = cost_model(BatchShape(num_seqs=1, num_prefill_tokens=new, context_tokens=len(req.prompt),
                                        attention_pairs=new * hit + new * (new + 1) // 2))
        start = max(req.arrival, rep.free_at)
        rep.free_at = start + prefill + req.output_len * decode_step
        heapq.heappush(done, (rep.free_at, r))
        ttft.append(start + prefill - req.arrival)
        per_replica[r] += 1
        went.append(r)
        hits.append(hit)
        prompt_tokens += len(req.prompt)
        hit_tokens += hit
    return FleetResult(name, num_replicas, prompt_tokens, hit_tokens, ttft, per_replica, went, hits)


def sweep_fleet(policies=POLICIES, replica_counts=(16, 32, 64), requests_per_replica: int = 30,
                rate_per_replica: float = 4.0, seed: int = 0, policy_kw=None, **trace_kw) -> list[FleetResult]:
    """Every policy at every replica count; the trace grows with the fleet (same load per replica).
    ``policy_kw``: {policy name: its knobs}, e.g. ``{"cache_aware": {"balance_abs_threshold": 4}}``."""
    results = []
    for n in replica_counts:
        trace = mixed_trace(n * requests_per_replica, rate_per_replica * n, seed=seed, **trace_kw)
        results += [simulate_fleet(trace, p, n, seed=seed, **(policy_kw or {}).get(p, {})) for p in policies]
    return results


def plot_fleet(results: list[FleetResult]):
    """Hit rate and p99 TTFT against the replica count, one line per policy."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for policy in dict.fromkeys(r.policy for r in results):
        rs = [r for r in results if r.policy == policy]
        xs = [r.num_replicas for r in rs]
        a.plot(xs, [100 * r.hit_rate for r in rs], marker="o", label=policy)
        b.plot(xs, [r.ttft_quantile(0.99) for r in rs], marker="o", label=policy)
    a.set(xlabel="replicas", ylabel="prompt tokens found cached (%)", title="prefix-cache hit rate")
    b.set(xlabel="replicas", ylabel="p99 TTFT (s)", title="tail time to first token", yscale="log")
    a.legend(fontsize=8)
    fig.tight_layout()
    return fig
