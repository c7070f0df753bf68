"""Routing policies on a fleet: two replicas behind vllm-router, stage 7's prefix workloads and a ShareGPT-like trace.

    python benchmarks/bench_fleet.py                          # tinypaged replicas (SmolLM2), all five policies
    python benchmarks/bench_fleet.py --engines tinypaged vllm # and the same with two real `vllm serve` replicas
    python benchmarks/bench_fleet.py --model tiny --policies round_robin cache_aware --sharegpt 8   # a quick look

For each engine one fleet (``tinypaged.entrypoints.fleet.Fleet``: 2 replicas, one core each, KV events on) is
started; for each policy the router is replaced (``Fleet.restart_router``) and every workload runs through it:
``shared_system_prompt``, ``few_shot``, ``multi_turn_chat``, ``tree_of_thought`` (tinypaged/lab/prefix_workloads.py;
waves in order, a request's parent's prompt and output start its prompt) and ``--sharegpt`` ShareGPT-like requests
(tinypaged/lab/workloads.py, lengths x ``--scale``). The replicas' caches stay warm from one policy to the next, so
every prompt of a (policy, workload) run starts with its own token: no run hits another's blocks.

Per run: prefix-cache hit tokens per replica (their ``/metrics``), requests per replica (load balance: the busiest
replica's share over the mean), TTFT (streamed, first chunk) mean and p90, output tokens/s over the run's wall
time. Each request is bounded (``--request-timeout``), each run by its request count, the whole script by
``--deadline`` seconds, shared equally by the engines (what is left is skipped and said). The machine's load
average is printed with the table and written on the plot: figures from a shared machine are not quiet ones.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from tinypaged.entrypoints.fleet import Fleet
from tinypaged.lab import prefix_workloads as pw
from tinypaged.lab import vllm_side
from tinypaged.lab.workloads import prompt_token_ids, sharegpt_like

POLICIES = ["round_robin", "power_of_two", "consistent_hash", "cache_aware", "kv_aware"]
ROOT = Path(__file__).resolve().parent.parent


def stream_request(url: str, model: str, ids: list[int], max_tokens: int, timeout: float) -> dict:
    """One streamed completion: TTFT (first chunk with tokens), the output token ids, the end-to-end time."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    ttft, out = None, []
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for c in chunk.get("choices", []):
                if c.get("token_ids") or c.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    out += c.get("token_ids") or []
    except (OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.close()
    return {"ttft": ttft, "tokens": out, "e2e": time.perf_counter() - t0}


def workloads(sharegpt: int, scale: float, vocab: int = 49152):
    """(name, waves) with requests as (name, own token ids, max_tokens, parent name or None)."""
    out = []
    for w in (pw.shared_system_prompt(), pw.few_shot(), pw.multi_turn_chat(), pw.tree_of_thought()):
        out.append((w.name, [[(r.name, list(r.tokens), r.max_tokens, r.parent) for r in wave] for wave in w.waves]))
    if sharegpt:
        trace = sharegpt_like(sharegpt, seed=0, scale=scale)
        out.append(("sharegpt-like", [[(f"s{r.request_id}", prompt_token_ids(r, vocab, 0), max(1, r.output_len),
                                        None) for r in trace]]))
    return out


def run_one(fleet: Fleet, salt: int, waves, concurrency: int, timeout: float, deadline: float) -> dict:
    before = fleet.metrics()
    done: dict[str, tuple] = {}
    results = []
    t0 = time.perf_counter()
    for wave in waves:
        if time.monotonic() > deadline:
            return {"skipped": "deadline"}
        jobs = []
        for name, own, max_tokens, parent in wave:
            head = list(done[parent][0]) + list(done[parent][1]) if parent in done else [salt]
            jobs.append((name, head + own, max_tokens))
        with ThreadPoolExecutor(concurrency) as pool:
            outs = list(pool.map(lambda j: stream_request(fleet.url, fleet.model, j[1], j[2], timeout), jobs))
        for (name, ids, _), r in zip(jobs, outs):
            results.append(r)
            if "error" not in r:
                done[name] = (ids, r["tokens"])
    wall = time.perf_counter() - t0
    after = fleet.metrics()
    ok = [r for r in results if "error" not in r]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    reqs = [(a or {}).get("requests", 0) - (b or {}).get("requests", 0) for a, b in zip(after, before)]
    hits = [(a or {}).get("prefix_cache_hits", 0) - (b or {}).get("prefix_cache_hits", 0)
            for a, b in zip(after, before)]
    mean = sum(reqs) / len(reqs) if reqs else 0
    return {"requests": len(results), "errors": len(results) - len(ok), "hits": hits, "per_replica": reqs,
            "balance": (max(reqs) / mean) if mean else None,
            "ttft_mean_ms": 1000 * statistics.mean(ttfts) if ttfts else None,
            "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
            "tok_per_s": sum(len(r["tokens"]) for r in ok) / wall if wall else None, "wall_s": wall}


def fmt(v, spec="{:.0f}"):
    return "-" if v is None else spec.format(v)


def plot(rows, path: Path, load: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["engine"], r["workload"]) for r in rows if "hits" in r})
    policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(policies))
    for i, p in enumerate(policies):
        hits = [next((sum(r["hits"]) for r in rows if (r["engine"], r["workload"]) == k and r["policy"] == p
                      and "hits" in r), 0) for k in keys]
        ttft = [next((r["ttft_mean_ms"] or 0 for r in rows if (r["engine"], r["workload"]) == k and r["policy"] == p
                      and "hits" in r), 0) for k in keys]
        xs = [j + i * width for j in range(len(keys))]
        axes[0].bar(xs, hits, width, label=p)
        axes[1].bar(xs, ttft, width, label=p)
    for ax, title in zip(axes, ("prefix-cache hit tokens (both replicas)", "mean TTFT (ms)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"{e}\n{w}" for e, w in keys], fontsize=7)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"2 replicas behind vllm-router 0.1.17, one core each; load average during the run: {load}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", nargs="+", default=["tinypaged"], choices=["tinypaged", "vllm"])
    ap.add_argument("--policies", nargs="+", default=POLICIES, choices=POLICIES)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sharegpt", type=int, default=16, help="ShareGPT-like requests (0: none)")
    ap.add_argument("--scale", type=float, default=1 / 8, help="ShareGPT-like lengths x this")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--deadline", type=float, default=3600, help="seconds for the whole script")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "fleet_routing.png"))
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--rows-from", default=None, help="start from the rows of an earlier run's --json (another engine)")
    args = ap.parse_args(argv)
    share = args.deadline / len(args.engines)  # each engine gets its share of the time
    loads = [os.getloadavg()[0]]
    rows = json.loads(Path(args.rows_from).read_text())["rows"] if args.rows_from else []
    salt = 7  # each (engine, policy, workload) run's prompts start with their own token
    for engine in args.engines:
        deadline = time.monotonic() + share
        serve_args = [] if engine == "vllm" else ["--max-model-len", "1024"]
        if engine == "vllm" and vllm_side.python() is None:
            print(f"# vllm: skipped: {vllm_side.MISSING}", file=sys.stderr)
            continue
        try:
            fleet = Fleet(2, "round_robin", args.model, serve_args, kv_events=True, engine=engine,
                          startup_timeout=900, vllm_python=vllm_side.python()).start()
        except (RuntimeError, TimeoutError) as exc:  # the other engines' rows still count
            print(f"# {engine}: the fleet did not start: {exc}", file=sys.stderr)
            continue
        with fleet:
            print(f"# {engine}: replicas {fleet.replica_urls} cores {fleet.cores}", file=sys.stderr, flush=True)
            for url in fleet.replica_urls:  # warm-up, straight to each replica: first calls pay one-off costs
                for i in range(2):
                    stream_request(url, fleet.model, [5 + i] * 40, 4, args.request_timeout)
            for policy in args.policies:
                fleet.restart_router(policy)
                for name, waves in workloads(args.sharegpt, args.scale):
                    salt += 1
                    r = run_one(fleet, salt, waves, args.concurrency, args.request_timeout, deadline)
                    loads.append(os.getloadavg()[0])
                    rows.append({"engine": engine, "policy": policy, "workload": name, **r,
                                 "load1": round(loads[-1], 1)})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    loads += [r["load1"] for r in rows if "load1" in r]
    load = f"{min(loads):.1f}-{max(loads):.1f} (1-min, {os.cpu_count()} CPUs)"
    if any("hits" in r and "load1" not in r for r in rows):
        load += "; some merged rows carry no load reading"
    print(f"\nload average {load}; 2 replicas, one core each; hits = prefix-cache hit tokens per replica")
    print(f"{'engine':10} {'policy':16} {'workload':15} {'hits':>13} {'requests':>9} {'balance':>7} "
          f"{'TTFT ms':>8} {'p90':>7} {'tok/s':>6}")
    for r in rows:
        if "hits" not in r:
            print(f"{r['engine']:10} {r['policy']:16} {r['workload']:15} skipped ({r.get('skipped')})")
            continue
        print(f"{r['engine']:10} {r['policy']:16} {r['workload']:15} {str(r['hits']):>13} {str(r['per_replica']):>9} "
              f"{fmt(r['balance'], '{:.2f}'):>7} {fmt(r['ttft_mean_ms']):>8} {fmt(r['ttft_p90_ms']):>7} "
              f"{fmt(r['tok_per_s'], '{:.1f}'):>6}" + (f"  {r['errors']} errors" if r["errors"] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"load": load, "rows": rows}, indent=1))
    if args.plot and rows:
        plot(rows, Path(args.plot), load)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
