"""Stage 6 benchmark: serving under load, every system side by side, the simulator checked against
the engine, and the paper's Figure 12 at OPT-13B scale by simulation.

    python benchmarks/bench_serving.py                 # about 6-8 minutes on a 2-core CPU
    python benchmarks/bench_serving.py --quick         # about 2 minutes
    python benchmarks/bench_serving.py --engine vllm --model facebook/opt-125m   # on a GPU with vLLM

Part 1, real time (tinypaged): Poisson arrivals replayed on the wall clock through the real engine,
  for five systems at equal KV memory, equal max_num_seqs and the same model: static batching with
  contiguous Max reservation; continuous batching with contiguous Max / Pow2 / Oracle reservation
  (the paper's Orca baselines); continuous batching over paged KV (vLLM). Lengths follow the
  paper's ShareGPT and Alpaca statistics scaled down to fit a CPU, and the 2048-token cap and the
  paper's KV budget (15.7K token slots, OPT-13B on an A100-40GB) are scaled by the same factor, so
  each reservation policy fits as many requests at once as it did in the paper.
Part 2, the simulator against the engine: a step-time model is fitted to steps measured on this
  machine (a calibration trace, other requests), then the simulator predicts the mean normalized
  latency at three rates of the Part-1 trace, next to a fresh real-time measurement.
Part 3, the paper's scale: the same systems simulated with a roofline cost model of OPT-13B (fp16)
  on one A100-40GB and the paper's KV budget: normalized latency against request rate (Figure 12),
  the highest rate each system sustains under a latency threshold, and requests batched at once
  (Figure 13), next to the paper's figures.

With ``--engine vllm`` the Part-1 experiment runs on vLLM itself (paged KV only) where vLLM is
installed, and prints the same table; elsewhere it says why it is skipped.
"""

from __future__ import annotations

import argparse
import sys
import time

from tinypaged.serving import (PAPER_BATCHED, PAPER_RATE_RATIOS, SYSTEM_NAMES, format_table, get_system, quiet,
                               rate_ratios, replay, serving_table, serving_trace, shared_weights, sustainable_rate,
                               system_config, vllm_available, with_rate)
from tinypaged.simulator import OPT13B_A100, LinearCostModel, paper_setup, simulate, sweep
from tinypaged.workloads import summarize

THRESHOLD_FACTOR = 5  # a system "sustains" a rate while its mean normalized latency stays under 5x the idle one

# Per dataset: length scale for the CPU, real-time rates (req/s) for the tiny model, OPT-13B simulated rates.
DATASETS = {
    "sharegpt": dict(scale=1 / 8, rates=[10, 20, 40, 60, 80, 120], paper_rates=[0.25, 0.5, 1, 1.5, 2, 3, 4, 5, 6, 8],
                     paper_requests=400),
    "alpaca": dict(scale=1 / 2, rates=[10, 20, 40, 60, 80, 120], paper_rates=[2, 5, 10, 20, 40, 60, 80, 100, 150, 200],
                   paper_requests=800),
}


def say(*a):
    print(*a, flush=True)


def threshold_of(latencies_at_lowest_rate: float) -> float:
    return THRESHOLD_FACTOR * latencies_at_lowest_rate


def ratio_lines(sustained: dict[str, float]) -> list[str]:
    lines = []
    for s, r in rate_ratios(sustained).items():
        paper = PAPER_RATE_RATIOS.get(s)
        ref = f"  (paper, ShareGPT: {paper[0]}-{paper[1]}x)" if paper else ""
        val = "inf (it sustains none of the rates)" if r == float("inf") else f"{r:.2f}x"
        lines.append(f"  vLLM / {get_system(s).label}: {val}{ref}")
    return lines


# -- part 1 ----------------------------------------------------------------------------------------------
def common_knobs(scale, max_num_seqs):
    return paper_setup(scale, max_num_seqs=max_num_seqs)


def realtime(args, dataset):
    from tinypaged import LLM

    cfg = DATASETS[dataset]
    scale, rates = cfg["scale"], args.rates or cfg["rates"]
    common = common_knobs(scale, args.max_num_seqs)
    trace = serving_trace(dataset, args.requests, None, seed=0, scale=scale)
    s = summarize(trace)
    say(f"\n== Part 1 ({dataset}): real-time replay on {args.model!r}, {args.requests} requests per rate ==")
    say(f"Lengths x{scale:g} (mean input {s['mean_input']:.1f}, output {s['mean_output']:.1f}, longest "
        f"{s['max_total']}); max_model_len {common['max_model_len']} (2048 x{scale:g}); KV cache "
        f"{common['kv_cache_tokens']} tokens for every system (15.7K x{scale:g}); max_num_seqs {args.max_num_seqs}; "
        f"block 16; output lengths forced; Poisson arrivals at each rate.")
    runs = {}
    with quiet(), shared_weights():
        for name in SYSTEM_NAMES:
            llm = LLM(args.model, device="cpu", dtype="float32", seed=0, **system_config(name, **common))
            replay(llm, with_rate(trace[:4], 1000.0), name)  # warm-up
            for rate in rates:
                t = time.perf_counter()
                runs[(name, rate)] = replay(llm, with_rate(trace, rate, seed=0), name, rate)
                say(f"  {get_system(name).label:14s} {rate:6g} req/s: {time.perf_counter() - t:5.1f} s wall")
    say("\n" + serving_table(runs))
    lat = {n: [runs[(n, r)].summary()["normalized_latency"] for r in rates] for n in SYSTEM_NAMES}
    th = threshold_of(lat["vllm"][0])
    sustained = {n: sustainable_rate(rates, lat[n], th) for n in SYSTEM_NAMES}
    say(f"\nSustainable rate (mean normalized latency <= {th:.4f} s/token = {THRESHOLD_FACTOR}x vLLM's at "
        f"{rates[0]:g} req/s):")
    say("  " + ", ".join(f"{get_system(n).label} {v:.1f}" for n, v in sustained.items()) + " req/s")
    for line in ratio_lines(sustained):
        say(line)
    top = rates[-1]
    say(f"Requests batched at once at {top:g} req/s: " + ", ".join(
        f"{get_system(n).label} {runs[(n, top)].summary()['batched']:.2f}" for n in SYSTEM_NAMES)
        + f"  (paper, OPT-13B ShareGPT: vLLM {PAPER_BATCHED['vllm']}, Oracle {PAPER_BATCHED['orca-oracle']}, "
          f"Pow2 {PAPER_BATCHED['orca-pow2']}, Max {PAPER_BATCHED['orca-max']})")
    say(f"Mean step time at {top:g} req/s (busier, not faster): " + ", ".join(
        f"{get_system(n).label} {1e3 * runs[(n, top)].summary()['step_time']:.1f} ms" for n in SYSTEM_NAMES)
        + f"; useful share of static batching's slots {runs[('static', top)].summary()['useful_slot_share']:.0%}")
    return trace, common, runs


# -- part 2 ----------------------------------------------------------------------------------------------
def validate(args, dataset, trace, common, runs):
    from tinypaged import LLM

    cfg = DATASETS[dataset]
    rates = args.rates or cfg["rates"]
    val_rates = [rates[1], rates[len(rates) // 2], rates[-2]]
    say(f"\n== Part 2 ({dataset}): the simulator against the engine ==")
    cal = serving_trace(dataset, args.requests, None, seed=1, scale=cfg["scale"])
    with quiet(), shared_weights():
        llm = LLM(args.model, device="cpu", dtype="float32", seed=0, **system_config("vllm", **common))
        replay(llm, with_rate(cal[:4], 1000.0), "vllm")
        steps = replay(llm, cal, "vllm").steps  # closed loop: every batch size from full to one
        steps += replay(llm, with_rate(cal, rates[len(rates) // 2], seed=7), "vllm").steps
        model = LinearCostModel.fit(steps)
        say(f"Calibrated on {len(steps)} steps of other requests (seed 1): {model.describe()}")
        rows, worst = [], 0.0
        for rate in val_rates:
            moved = with_rate(trace, rate, seed=0)
            real = replay(llm, moved, "vllm", rate).summary()["normalized_latency"]
            pred = simulate(moved, model, "vllm", rate, **common).summary()["normalized_latency"]
            err = pred / real - 1
            worst = max(worst, abs(err))
            rows.append([f"{rate:g}", f"{real:.4f}", f"{pred:.4f}", f"{100 * err:+.1f}%"])
    say(format_table(["rate req/s", "measured s/token", "simulated s/token", "error"], rows))
    say(f"vLLM system, mean normalized latency: worst error {100 * worst:.1f}% "
        f"({'within' if worst <= 0.15 else 'OUTSIDE'} the 15% bound)")
    # the other systems, against their Part-1 measurements (same trace and arrivals)
    rows = []
    for name in SYSTEM_NAMES:
        if name == "vllm":
            continue
        for rate in val_rates:
            real = runs[(name, rate)].summary()["normalized_latency"]
            pred = simulate(with_rate(trace, rate, seed=0), model, name, rate, **common).summary()["normalized_latency"]
            rows.append([get_system(name).label, f"{rate:g}", f"{real:.4f}", f"{pred:.4f}", f"{100 * (pred / real - 1):+.1f}%"])
    say("Other systems with the same calibration, against their Part-1 runs:")
    say(format_table(["system", "rate req/s", "measured s/token", "simulated s/token", "error"], rows))


# -- part 3 ----------------------------------------------------------------------------------------------
def paper_scale(args, dataset):
    cfg = DATASETS[dataset]
    n, rates = cfg["paper_requests"] // (2 if args.quick else 1), cfg["paper_rates"]
    setup = paper_setup(1.0)
    trace = serving_trace(dataset, n, None, seed=0)
    t = time.perf_counter()
    sw = sweep(trace, OPT13B_A100, rates, SYSTEM_NAMES, **setup)
    say(f"\n== Part 3 ({dataset}): {OPT13B_A100.name}, {n} requests, KV {setup['kv_cache_tokens']} tokens, "
        f"max_num_seqs {setup['max_num_seqs']}, block 16 ({time.perf_counter() - t:.1f} s to simulate) ==")
    header = ["rate req/s"] + [get_system(s).label for s in SYSTEM_NAMES]
    rows = [[f"{r:g}"] + [f"{sw.latency[s][i]:.3f}" for s in SYSTEM_NAMES] for i, r in enumerate(rates)]
    say("Mean normalized latency (s/token), Figure 12's y axis:")
    say(format_table(header, rows))
    th = threshold_of(sw.latency["vllm"][0])
    sustained = sw.sustainable(th)
    say(f"Sustainable rate (<= {th:.4f} s/token = {THRESHOLD_FACTOR}x vLLM's at {rates[0]:g} req/s): "
        + ", ".join(f"{get_system(s).label} {v:.2f}" for s, v in sustained.items()) + " req/s")
    for line in ratio_lines(sustained):
        say(line)
    at = min(rates, key=lambda r: abs(r - sustained["vllm"]))
    i = rates.index(at)
    say(f"Requests batched at once at {at:g} req/s: " + ", ".join(
        f"{get_system(s).label} {sw.batched[s][i]:.2f}" for s in SYSTEM_NAMES)
        + f"  (paper, ShareGPT 2 req/s: vLLM {PAPER_BATCHED['vllm']}, Oracle {PAPER_BATCHED['orca-oracle']}, "
          f"Pow2 {PAPER_BATCHED['orca-pow2']}, Max {PAPER_BATCHED['orca-max']})")


# -- vLLM ------------------------------------------------------------------------------------------------
def run_vllm(args):
    if not vllm_available():
        say("vLLM is not installed here, so the vLLM run is skipped (vLLM needs a CUDA GPU; install it there and "
            "rerun with --engine vllm --model <a Hugging Face model>). The tinypaged experiment runs with "
            "`python benchmarks/bench_serving.py`.")
        return 0
    from vllm import EngineArgs, LLMEngine, SamplingParams

    from tinypaged.serving import replay_vllm

    for dataset in args.datasets:
        cfg = DATASETS[dataset]
        common = common_knobs(cfg["scale"], args.max_num_seqs)
        trace = serving_trace(dataset, args.requests, None, seed=0, scale=cfg["scale"])
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=args.model, max_num_seqs=common["max_num_seqs"], block_size=16, max_model_len=common["max_model_len"],
            num_gpu_blocks_override=common["kv_cache_tokens"] // 16, enable_prefix_caching=False, seed=0))
        runs = {}
        for rate in args.rates or cfg["rates"]:
            runs[("vLLM (real)", rate)] = replay_vllm(engine, with_rate(trace, rate, seed=0), SamplingParams, rate,
                                                      max_num_seqs=common["max_num_seqs"])
        say(f"\n== vLLM {dataset}: {args.model}, KV {common['kv_cache_tokens']} tokens, max_num_seqs "
            f"{common['max_num_seqs']} ==")
        say(serving_table(runs))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["tinypaged", "vllm"], default="tinypaged")
    ap.add_argument("--model", default=None, help="tinypaged: 'tiny' (default) or 'smollm2-135m'; vllm: a model name")
    ap.add_argument("--datasets", nargs="+", default=["sharegpt", "alpaca"], choices=sorted(DATASETS))
    ap.add_argument("--requests", type=int, default=None, help="requests per real-time run (default 80, quick 40)")
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="real-time rates in req/s")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier step times on a shared CPU, which the simulator fits)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", nargs="*", default=[], choices=["realtime", "validate", "paper"])
    args = ap.parse_args(argv)
    args.requests = args.requests or (40 if args.quick else 80)
    if args.engine == "vllm":
        if args.model is None:
            ap.error("--engine vllm needs --model (a model vLLM can load)")
        return run_vllm(args)
    import torch

    torch.set_num_threads(args.threads)
    args.model = args.model or "tiny"
    if args.quick and args.rates is None:
        args.datasets = args.datasets[:1]
    t0 = time.perf_counter()
    for dataset in args.datasets:
        if "realtime" not in args.skip:
            trace, common, runs = realtime(args, dataset)
            if "validate" not in args.skip:
                validate(args, dataset, trace, common, runs)
    if "paper" not in args.skip:
        for dataset in args.datasets:
            paper_scale(args, dataset)
    say(f"\n(total benchmark time {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
