"""Stage 7: SGLang's radix tree against vLLM's hashed blocks, on the same traffic, side by side.

Eight engines on SmolLM2-135M (greedy, float32, CPU), each running the four prefix workloads of
``tinypaged.lab.prefix_workloads`` in turn, in one KV cache of the same size:

    no caching | hashed blocks (vLLM v1, block 16) | radix, page 1 | radix, page 16
    each with FCFS order and with cache-aware order (SGLang's lpm)

Per workload and engine: prompt tokens, prefill tokens computed (what caching saves, recomputation after a
preemption included), the hit rate in tokens (cached / looked-up, vLLM's definition), mean time to first
token, output tokens per second, peak KV in use (tokens held by running requests; cached but unused KV
counts as free, as vLLM counts it) and preemptions. Every engine's output tokens must equal the first
engine's: the script stops if one differs. The cross-sequence slot check is off (``check_invariants=False``)
so that timings measure the engines, not the checks; the tests run with it on.

    python benchmarks/bench_radix.py              # a few minutes on 2 CPU cores
    python benchmarks/bench_radix.py --model tiny # a quick rehearsal on random weights
"""

from __future__ import annotations

import argparse
import time

import torch

from tinypaged import LLM
from tinypaged.lab.prefix_workloads import all_workloads, run_workload
from tinypaged.radix_cache import RadixKVManager
from tinypaged.radix_policy import CacheAwareOrder

BLOCK = 16
MANAGERS = {
    "no caching": {},
    "hashed blocks (16)": {"enable_prefix_caching": True},
    "radix, page 1": {"kv_cache_manager": RadixKVManager.factory(page_size=1)},
    "radix, page 16": {"kv_cache_manager": RadixKVManager.factory(page_size=BLOCK)},
}
ORDERS = ("fcfs", "lpm")


def run_engine(model: str, manager: dict, order: str, kv_tokens: int, max_num_seqs: int, workloads) -> dict:
    llm = LLM(model, block_size=BLOCK, kv_cache_tokens=kv_tokens, max_num_seqs=max_num_seqs, device="cpu",
              scheduling_policy=CacheAwareOrder(order), check_invariants=False, **manager)
    engine = llm.llm_engine
    rows = {}
    for wl in workloads:
        prefill0 = engine.counters["num_prefill_tokens"]
        pre0 = engine.scheduler.num_preemptions
        stats0 = engine.get_metrics()
        engine.history.clear()
        t0 = time.perf_counter()
        outs = run_workload(llm, wl)
        wall = time.perf_counter() - t0
        stats = engine.get_metrics()
        queries = stats.get("prefix_cache_queries", 0) - stats0.get("prefix_cache_queries", 0)
        hits = stats.get("prefix_cache_hits", 0) - stats0.get("prefix_cache_hits", 0)
        generated = sum(len(o.outputs[0].token_ids) for o in outs.values())
        rows[wl.name] = {
            "prompt": sum(len(o.prompt_token_ids) for o in outs.values()),
            "prefill": engine.counters["num_prefill_tokens"] - prefill0,
            "hit": hits / queries if queries else 0.0,
            "ttft_ms": 1000 * sum(o.metrics.time_to_first_token for o in outs.values()) / len(outs),
            "tok_s": generated / wall,
            "peak_kv": round(max(h["kv_cache_usage"] for h in engine.history) * engine.kv.capacity_tokens),
            "preempted": engine.scheduler.num_preemptions - pre0,
            "tokens": {name: list(o.outputs[0].token_ids) for name, o in outs.items()},
        }
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-tokens", type=int, default=320, help="KV cache capacity in tokens (the same for all)")
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    workloads = all_workloads()
    print(f"model {args.model}, KV cache {args.kv_tokens} tokens, max_num_seqs {args.max_num_seqs}, "
          f"{args.threads} torch thread(s); workloads: " + "; ".join(f"{w.name} ({w.num_requests} requests: {w.shares})"
                                                                      for w in workloads))
    results, reference = {}, None
    t_all = time.perf_counter()
    for mname, manager in MANAGERS.items():
        for order in ORDERS:
            rows = run_engine(args.model, manager, order, args.kv_tokens, args.max_num_seqs, workloads)
            tokens = {w: r.pop("tokens") for w, r in rows.items()}
            if reference is None:
                reference = tokens
            elif tokens != reference:
                raise SystemExit(f"outputs differ: {mname}, {order} vs the first engine")
            results[(mname, order)] = rows
            print(f"  done: {mname}, {order}", flush=True)
    print(f"outputs identical across all {len(results)} engines: True  ({time.perf_counter() - t_all:.0f} s in all)\n")
    for wl in workloads:
        print(f"### {wl.name}: {wl.num_requests} requests, {wl.shares}\n")
        print("| KV manager | order | prompt tokens | prefill computed | hit rate (tokens) | mean TTFT ms | "
              "output tok/s | peak KV tokens | preemptions |")
        print("|---|---|---|---|---|---|---|---|---|")
        for (mname, order), rows in results.items():
            r = rows[wl.name]
            print(f"| {mname} | {order} | {r['prompt']} | {r['prefill']} | {r['hit']:.1%} | {r['ttft_ms']:.0f} | "
                  f"{r['tok_s']:.1f} | {r['peak_kv']} | {r['preempted']} |")
        print()


if __name__ == "__main__":
    main()
