"""Stage 4 benchmark: static vs continuous batching, side by side, on one ShareGPT-like trace.

    python benchmarks/bench_throughput.py           # 64 requests, lengths x 1/8, batch 16 (several minutes on CPU)
    python benchmarks/bench_throughput.py --quick   # 32 requests, lengths x 1/16 (2-3 minutes)

Part 1 (SmolLM2-135M, float32, CPU, the same requests for every system, all arriving at t=0):
  tinypaged static, tinypaged continuous (its one forward, and with attention_backend="torch", the
  reference attention of lessons 2-3), transformers `generate` on left-padded static batches
  of the same size, and transformers' own paged continuous batching (the manager behind
  `generate_batch`). Output lengths are forced (ignore_eos + max_tokens) so every system does the
  same useful work. Then the continuous run's exact batches are replayed through the bare model
  forward, with no engine around it: the engine's share of that raw speed is its overhead.
Part 1b (where the vLLM environment exists, `bash scripts/vllm_env.sh`): the same requests on the real
  vLLM (its CPU build, compiled graph, in a subprocess) and on tinypaged continuous, both with
  max_num_seqs = --batch, block_size 32 (the smallest vLLM's CPU attention takes) and the same --cores
  CPU cores (vLLM: VLLM_CPU_OMP_THREADS_BIND=0-(N-1); tinypaged's one eager forward (a CPU has no CUDA graphs),
  its threads and binding chosen as vLLM's CPU backend does
  (tinypaged.model.cpu_threads, auto: the given cores less any another process keeps busy; --bind to
  override)); tokens/s, the ratio tinypaged / vLLM, how each side was bound, warm-up (compile) apart, and
  whether the greedy tokens are equal. --neighbour keeps the last core busy with a bounded burner process
  for the whole part (both engines beside it), as a learner's browser or JupyterLab would:
    python benchmarks/bench_throughput.py --quick --skip-part1 --skip-part2 [--neighbour]
Summary (printed last): tinypaged's tokens/s against vLLM's (part 1b) and transformers' continuous
  batching (part 1), the two ratios, and the engine / bare-forward ratio.
Part 2 ("tiny" model, to keep CPU time sane): sweeps of max_num_seqs and max_num_batched_tokens,
  and the cost of recompute vs swap preemption at a few block sizes.

Throughput counts output tokens each request asked for (padding and tokens past a request's own
length, which static batches compute anyway, do not count).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import transformers

from tinypaged import LLM, SamplingParams
from tinypaged.lab.workloads import prompt_token_ids, sharegpt_like, summarize

logging.getLogger("tinypaged").setLevel(logging.ERROR)  # no per-preemption warnings in the tables
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()


def table(title, header, rows):
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for i, r in enumerate([header, *rows]):
        print("  " + "  ".join(str(x).rjust(w) for x, w in zip(r, widths)))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


def make_requests(n, scale, vocab, seed=0):
    trace = sharegpt_like(n, seed=seed, scale=scale)  # the 2048-token cap applies before scaling
    prompts = [prompt_token_ids(r, vocab, seed) for r in trace]
    outs = [r.output_len for r in trace]
    return trace, prompts, outs


# -- tinypaged -------------------------------------------------------------------------------------
class TinypagedRun:
    """One tinypaged engine and its timed passes. ``warm_up`` = (prompts, outs) first runs on the same engine,
    untimed (as vLLM's side warms its engine: the first steps of an engine pay one-off costs such as packing the
    weights for oneDNN and first touches of the KV cache); ``timed_pass`` then runs the same requests again each time
    it is called (no prefix caching: nothing is reused between passes)."""

    def __init__(self, model, warm_up=None, **kw):
        self.llm = LLM(model, device="cpu", dtype="float32", **kw)
        self.warm_s = None
        if warm_up is not None:
            t0 = time.perf_counter()
            self.llm.generate([{"prompt_token_ids": p} for p in warm_up[0]],
                              [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in warm_up[1]])
            self.warm_s = time.perf_counter() - t0
        self.steps0 = self.llm.get_metrics()["num_steps"]
        self.walls, self.outputs = [], None

    def timed_pass(self, prompts, outs) -> float:
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
        t0 = time.perf_counter()
        res = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        self.walls.append(time.perf_counter() - t0)
        assert [len(r.outputs[0].token_ids) for r in res] == outs
        self.outputs = res
        return self.walls[-1]

    def result(self, outs) -> dict:
        """``wall``: the median pass (the only one after a single pass); ``metrics["num_steps"]``: one pass's."""
        res = self.outputs
        metrics = self.llm.get_metrics()
        metrics["num_steps"] = (metrics["num_steps"] - self.steps0) // len(self.walls)
        return {"wall": statistics.median(self.walls), "walls": self.walls, "tokens": sum(outs),
                "latency": sum(r.metrics.e2e_latency for r in res) / len(res), "metrics": metrics, "llm": self.llm,
                "outputs": res, "warm_s": self.warm_s}


def run_tinypaged(model, prompts, outs, record=None, warm_up=None, **kw):
    """One engine, one timed pass on ``prompts`` after ``warm_up`` (``TinypagedRun``); ``record`` keeps every
    prepared batch of the timed pass (ids, positions, attention context, logits rows)."""
    run = TinypagedRun(model, warm_up, **kw)
    if record is not None:
        prepare = run.llm.llm_engine.runner.prepare
        run.llm.llm_engine.runner.prepare = lambda sched: record.append(prepare(sched)) or record[-1]
    run.timed_pass(prompts, outs)
    return run.result(outs)


def replay_raw(model, recorded):
    """The same batches through the bare model forward: no scheduling, no input building, no sampling."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids, pos, ctx, rows, _ in recorded:
            model(ids, pos, ctx, logits_indices=torch.tensor(rows, dtype=torch.long))
    return time.perf_counter() - t0


# -- transformers ----------------------------------------------------------------------------------
def run_hf_static(hf, prompts, outs, batch, pad_id):
    """`generate` on batches of `batch` requests in arrival order, left-padded; each batch runs until
    its longest member is done (min_new_tokens = max_new_tokens forces the length, as ignore_eos)."""
    t0 = time.perf_counter()
    lat, total = [], 0
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i:i + batch], outs[i:i + batch]
        width = max(map(len, ps))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        n = max(os_)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=pad_id)
        lat += [time.perf_counter() - t0] * len(ps)
    wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": sum(outs), "latency": sum(lat) / len(lat)}


def run_hf_continuous(hf, prompts, outs, batch):
    """transformers' paged continuous batching (the manager `generate_batch` drives). generate_batch
    takes one max_new_tokens for every request, so we submit through the same manager's
    add_request(max_new_tokens=...) to give each request its own length, EOS off (eos_token_id=-1)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1)
    cb = ContinuousBatchingConfig(max_requests_per_batch=batch)
    results, lat = {}, []
    with hf.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                block=True, timeout=5) as manager:
        t0 = time.perf_counter()
        for i, (p, o) in enumerate(zip(prompts, outs)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
        while len(results) < len(prompts):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
                lat.append(time.perf_counter() - t0)
            elif r is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        wall = time.perf_counter() - t0
    got = [len(results[f"r{i}"].generated_tokens) for i in range(len(prompts))]
    return {"wall": wall, "tokens": sum(min(g, o) for g, o in zip(got, outs)), "latency": sum(lat) / len(lat),
            "lengths_match": got == outs}


# -- part 1 ----------------------------------------------------------------------------------------
def part1(args):
    from transformers import AutoModelForCausalLM

    from tinypaged.model.loader import smollm2_folder

    torch.manual_seed(0)
    B = args.batch
    trace, prompts, outs = make_requests(args.num_requests, args.scale, 49152)
    s = summarize(trace)
    print(f"Trace: {s['requests']} ShareGPT-like requests (the paper's means 161.31 in / 337.99 out tokens), "
          f"lengths scaled x{args.scale:g} to fit a CPU: mean input {s['mean_input']:.1f}, mean output "
          f"{s['mean_output']:.1f}, longest request {s['max_total']} tokens. Output lengths forced "
          f"(ignore_eos + max_tokens). All requests arrive at t=0. Batch size (max_num_seqs) {B}.")
    common = dict(max_num_seqs=B, kv_cache_tokens=8192, block_size=16, max_model_len=512)
    # warm up (first calls pay one-off allocation costs)
    run_tinypaged("smollm2-135m", prompts[:2], [2, 2], **common)
    static = run_tinypaged("smollm2-135m", prompts, outs, scheduler_cls="static", **common)
    recorded = []
    cont = run_tinypaged("smollm2-135m", prompts, outs, record=recorded, max_num_batched_tokens=512, **common)
    raw = replay_raw(cont["llm"].llm_engine.model, recorded)
    del recorded
    reference = run_tinypaged("smollm2-135m", prompts, outs, max_num_batched_tokens=512, attention_backend="torch",
                              **common)

    hf = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()
    hf_static = run_hf_static(hf, prompts, outs, B, pad_id=2)
    try:
        hf_cb = run_hf_continuous(hf, prompts, outs, B)
    except Exception as e:  # keep the rest of the report if transformers' CB fails on this machine
        print(f"transformers continuous batching failed: {type(e).__name__}: {e}")
        hf_cb = None

    def row(name, r, steps="", note=""):
        return [name, r["tokens"], f"{r['wall']:.1f}", f"{r['tokens'] / r['wall']:.1f}", f"{r['latency']:.1f}",
                steps, note]

    rows = [row("tinypaged static", static, static["metrics"]["num_steps"],
                f"idle slots {100 * static['metrics']['idle_slot_fraction']:.1f}%"),
            row("tinypaged continuous", cont, cont["metrics"]["num_steps"], "default (sdpa attention)"),
            row("tinypaged continuous, attention_backend='torch'", reference, reference["metrics"]["num_steps"],
                "the lessons' reference attention"),
            row("transformers generate (padded static)", hf_static)]
    if hf_cb:
        rows.append(row("transformers continuous (generate_batch's manager)", hf_cb, "",
                        "lengths match" if hf_cb["lengths_match"] else "lengths differ"))
    table("Part 1: SmolLM2-135M float32 on CPU, same requests",
          ["system", "out tokens", "wall s", "tokens/s", "mean latency s", "steps", ""], rows)
    tput = lambda r: r["tokens"] / r["wall"]  # noqa: E731
    print(f"\n  continuous / static (tinypaged):        {tput(cont) / tput(static):.2f}x throughput, "
          f"{static['latency'] / cont['latency']:.2f}x lower mean latency (target >= 2x)")
    steps_ratio = static["metrics"]["num_steps"] / cont["metrics"]["num_steps"]
    print(f"  static / continuous step count:          {steps_ratio:.2f}x (the throughput ratio if a step cost "
          f"the same at any batch size, as decode roughly does on a GPU; on this CPU a fuller step costs more)")
    print(f"  tinypaged continuous / transformers generate: {tput(cont) / tput(hf_static):.2f}x")
    if hf_cb:
        print(f"  tinypaged continuous / transformers CB:       {tput(cont) / tput(hf_cb):.2f}x")
    print(f"  static batching idle-slot fraction: {100 * static['metrics']['idle_slot_fraction']:.1f}% "
          f"(slot-steps where a finished request waits for its batch)")
    print(f"  default / torch attention (tinypaged continuous): {tput(cont) / tput(reference):.2f}x")
    print(f"  raw model limit: the continuous run's {cont['metrics']['num_steps']} batches through the bare forward "
          f"take {raw:.1f} s vs {cont['wall']:.1f} s in the engine: engine = {100 * raw / cont['wall']:.1f}% "
          f"of the raw model throughput (target >= 95%)")
    return {"tinypaged": tput(cont), "reference": tput(reference), "hf_cb": tput(hf_cb) if hf_cb else None,
            "engine_over_bare": raw / cont["wall"]}


# -- part 1b: the real vLLM -------------------------------------------------------------------------
def part1b(args):
    import contextlib
    import os

    from tinypaged.lab import vllm_side
    from tinypaged.model.cpu_threads import apply_cpu_threads, busy_neighbour, plan_cpu_threads

    if not vllm_side.available():
        print(f"\nPart 1b skipped: {vllm_side.MISSING}")
        return {}
    cores = args.cores
    trace, prompts, outs = make_requests(args.num_requests, args.scale, 49152)
    B, tokens = args.batch, sum(outs)
    common = dict(max_num_seqs=B, block_size=vllm_side.CPU_BLOCK_SIZE, max_model_len=512, max_num_batched_tokens=512)
    blocks = 8192 // vllm_side.CPU_BLOCK_SIZE
    reqs = [vllm_side.request(p, o) for p, o in zip(prompts, outs)]
    engine = dict(common, num_gpu_blocks_override=blocks + 1)  # + vLLM's null block
    # --neighbour: a bounded burner process spins on the last of the given cores for the whole of part 1b
    # (both engines run beside it), killed at the end
    neighbour = busy_neighbour(cores - 1, 3600) if args.neighbour else contextlib.nullcontext()
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with neighbour:
        if args.neighbour:
            time.sleep(0.5)  # let it take its core before anyone looks at the load
        # vLLM warms up first (the engine compiles at start-up; the first steps of each batch shape still pay
        # one-off costs), then tinypaged warms up on its engine, and then the timed passes alternate: vLLM, tinypaged,
        # vLLM, ... (``between`` runs while vLLM's engine waits, idle), so a drift in the machine's speed over the
        # minutes of the run slows both alike
        state: dict = {}
        # tinypaged: the same cores; threads and binding as vLLM's CPU backend chooses them
        # (tinypaged.model.cpu_threads: TINYPAGED_CPU_OMP_THREADS_BIND, default auto); chosen once vLLM waits
        kw = dict(common, num_gpu_blocks_override=blocks)

        def between(n):
            if n == 0:
                state["plan"] = plan = plan_cpu_threads(bind=args.bind, allowed=range(cores))
                apply_cpu_threads(plan)
                # warm-up on the same engine, as vLLM's (compiles or reads the cache; packs the weights)
                state["run"] = TinypagedRun("smollm2-135m", warm_up=(prompts[:B], outs[:B]), **kw)
            else:
                state["run"].timed_pass(prompts, outs)

        t0 = time.perf_counter()
        try:
            warm, *vs = vllm_side.run([dict(engine=engine, requests=reqs[:B])]
                                      + [dict(engine=engine, requests=reqs)] * args.repeat, cores=cores,
                                      timeout=3600, between=between)
        finally:
            os.sched_setaffinity(0, affinity)
            torch.set_num_threads(threads)
        v_total = time.perf_counter() - t0
        plan, tp = state["plan"], state["run"].result(outs)
        t_warm = tp["warm_s"]
        ours = [list(o.outputs[0].token_ids) for o in tp["outputs"]]
    # each engine ran the same requests args.repeat times, the passes alternating: the median pass stands for each
    # (the machine's speed drifts by 10-20% within minutes; every pass is printed below)
    v = dict(vs[0], wall=statistics.median(x["wall"] for x in vs))
    same = min(sum(a == b for a, b in zip(ours, x["tokens"])) for x in vs)
    v_lat = sum(f - a for f, a in zip(v["finished"], v["arrival"])) / len(outs)
    mode = "one eager forward"
    rows = [[f"tinypaged continuous, {mode}", tokens, f"{tp['wall']:.1f}", f"{tokens / tp['wall']:.1f}",
             f"{tp['latency']:.1f}", tp["metrics"]["num_steps"]],
            ["vLLM 0.32.0 (CPU build, compiled)", tokens, f"{v['wall']:.1f}", f"{tokens / v['wall']:.1f}", f"{v_lat:.1f}",
             v["num_steps"]]]
    beside = f", core {cores - 1} kept busy by a burner process" if args.neighbour else ", no neighbour started"
    table(f"Part 1b: tinypaged vs vLLM, SmolLM2-135M float32, same {len(outs)} requests, max_num_seqs {B}, "
          f"block 32, {cores} core(s) each{beside}", ["system", "out tokens", "wall s", "tokens/s", "mean latency s",
                                                       "steps"], rows)
    print(f"\n  tinypaged / vLLM throughput: {(tokens / tp['wall']) / (tokens / v['wall']):.2f}x; greedy tokens equal "
          f"for {same}/{len(outs)} requests")
    if args.repeat > 1:
        ours_s = ", ".join(f"{tokens / w:.1f}" for w in tp["walls"])
        theirs_s = ", ".join(f"{tokens / x['wall']:.1f}" for x in vs)
        print(f"  passes (tokens/s, alternating, vLLM first): tinypaged {ours_s}; vLLM {theirs_s}; ratio of the "
              f"best passes {min(x['wall'] for x in vs) / min(tp['walls']):.2f}x")
    print(f"  binding: vLLM VLLM_CPU_OMP_THREADS_BIND=0-{cores - 1} ({cores} OpenMP threads, none reserved); "
          f"tinypaged {plan.describe()}")
    print(f"  warm-up, not timed: vLLM start-up (load + compile) {warm['engine_start_s']:.0f} s in its subprocess "
          f"(warm-up run {warm['wall']:.1f} s; part 1b took {v_total:.0f} s in all); tinypaged warm-up run "
          f"{t_warm:.1f} s on the timed "
          f"engine (weights packed for oneDNN, "
          f"{B} requests)")
    print(f"  load average while it ran (1 min): {os.getloadavg()[0]:.2f}")
    return {"tinypaged_pinned": tokens / tp["wall"], "vllm": tokens / v["wall"], "cores": cores,
            "neighbour": args.neighbour, "same": same, "n": len(outs)}


def summary(p1: dict, p1b: dict) -> None:
    """The issue's figures in one place: tinypaged against vLLM and transformers, from this very run."""
    def line(label, value):
        print(f"  {label + ':':44s}{value}")

    print("\nSummary (tinypaged = continuous batching, its defaults; output tokens/s)")
    if p1:
        line("tinypaged (part 1)", f"{p1['tinypaged']:.1f}  (reference path {p1['reference']:.1f})")
    if p1b:
        busy = ", one kept busy" if p1b["neighbour"] else ""
        line(f"tinypaged (part 1b, {p1b['cores']} cores{busy}, block 32)", f"{p1b['tinypaged_pinned']:.1f}")
        line("vLLM CPU build (part 1b, same cores)", f"{p1b['vllm']:.1f}")
        goal = "0.9x" if p1b["neighbour"] else "1.0x"
        line("tinypaged / vLLM", f"{p1b['tinypaged_pinned'] / p1b['vllm']:.2f}x  (goal >= {goal}; greedy tokens equal "
             f"{p1b['same']}/{p1b['n']})")
    if p1 and p1["hf_cb"]:
        line("transformers CB (part 1)", f"{p1['hf_cb']:.1f}")
        line("tinypaged / transformers CB", f"{p1['tinypaged'] / p1['hf_cb']:.2f}x  (goal >= 1.5x)")
    if p1:
        line("engine / bare forward", f"{p1['engine_over_bare']:.2f}  (goal >= 0.95)")
    if not p1 and not p1b:
        print("  (parts 1 and 1b were skipped)")


# -- part 2 ----------------------------------------------------------------------------------------
def part2(args):
    n = args.sweep_requests
    trace, prompts, outs = make_requests(n, 1 / 8, 49152, seed=1)
    print(f"\nPart 2: 'tiny' model (2 layers, float32), {n} ShareGPT-like requests scaled x1/8 "
          f"(mean in {summarize(trace)['mean_input']:.1f}, out {summarize(trace)['mean_output']:.1f})")
    run_tinypaged("tiny", prompts[:2], [2, 2], kv_cache_tokens=1024)  # warm-up
    rows = []
    for s in args.seqs_sweep:
        r = run_tinypaged("tiny", prompts, outs, max_num_seqs=s, max_num_batched_tokens=max(512, s),
                          kv_cache_tokens=16384)
        rows.append([s, r["metrics"]["num_steps"], f"{r['tokens'] / r['wall']:.0f}", f"{r['latency']:.2f}"])
    table("max_num_seqs sweep (budget 512 tokens, ample KV cache)",
          ["max_num_seqs", "steps", "tokens/s", "mean latency s"], rows)
    rows = []
    for b in args.budget_sweep:
        r = run_tinypaged("tiny", prompts, outs, max_num_seqs=8, max_num_batched_tokens=b, kv_cache_tokens=16384)
        hist = r["llm"].llm_engine.history
        rows.append([b, r["metrics"]["num_steps"], f"{r['tokens'] / r['wall']:.0f}", f"{r['latency']:.2f}",
                     max(h["num_prefill_tokens"] + h["num_decode_tokens"] for h in hist)])
    table("max_num_batched_tokens sweep (max_num_seqs 8, chunked prefill)",
          ["budget", "steps", "tokens/s", "mean latency s", "largest step"], rows)
    rows = []
    cap = args.preempt_cache_tokens
    for bs in args.block_sizes:
        for mode in ("recompute", "swap"):
            r = run_tinypaged("tiny", prompts, outs, max_num_seqs=16, max_num_batched_tokens=512,
                              kv_cache_tokens=cap, block_size=bs, preemption_mode=mode, swap_space=0.05)
            m = r["metrics"]
            recomputed = m["num_prefill_tokens"] - sum(len(p) for p in prompts)
            rows.append([bs, mode, m["num_preemptions"], recomputed, m["num_steps"],
                         f"{r['wall']:.2f}", f"{r['latency']:.2f}"])
    table(f"Preemption cost: KV cache of {cap} tokens, max_num_seqs 16 (recomputed = prefill tokens beyond prompts)",
          ["block size", "mode", "preemptions", "recomputed tokens", "steps", "wall s", "mean latency s"], rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller run (about 3 minutes on a 2-core CPU)")
    ap.add_argument("--skip-part1", action="store_true")
    ap.add_argument("--skip-part2", action="store_true")
    ap.add_argument("--batch", type=int, default=16, help="max_num_seqs, and the static batch size")
    ap.add_argument("--requests", type=int, default=None, help="number of requests in part 1")
    ap.add_argument("--repeat", type=int, default=5, help="part 1b: timed passes per engine (the median counts)")
    ap.add_argument("--cores", type=int, default=2, help="part 1b: CPU cores given to each of tinypaged and vLLM")
    ap.add_argument("--skip-vllm", action="store_true", help="skip part 1b (the real vLLM)")
    ap.add_argument("--neighbour", action="store_true",
                    help="part 1b: keep the last of --cores busy with a bounded burner process (a busy laptop)")
    ap.add_argument("--bind", default=None, help="part 1b: tinypaged's TINYPAGED_CPU_OMP_THREADS_BIND (auto, nobind, "
                                                 "0-1, ...; default: the environment's, else auto)")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.scale, args.sweep_requests = 32, 1 / 16, 24
        args.seqs_sweep, args.budget_sweep, args.block_sizes = [2, 8, 32], [16, 64, 512], [4, 16]
    else:
        args.num_requests, args.scale, args.sweep_requests = 64, 1 / 8, 48
        args.seqs_sweep, args.budget_sweep, args.block_sizes = [1, 2, 4, 8, 16, 32], [8, 16, 32, 64, 256, 512], [4, 8, 16, 32]
    args.num_requests = args.requests or args.num_requests
    args.preempt_cache_tokens = 512
    t0 = time.perf_counter()
    p1 = part1(args) if not args.skip_part1 else {}
    p1b = part1b(args) if not args.skip_vllm else {}
    if not args.skip_part2:
        part2(args)
    summary(p1, p1b)
    print(f"\n(total benchmark time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
