"""Stage 6 benchmark: serving under load, every system side by side, the simulator checked against
the engine, and the paper's Figure 12 at OPT-13B scale by simulation.

    python benchmarks/bench_serving.py                 # about 10-15 minutes on a 2-core CPU
    python benchmarks/bench_serving.py --quick         # about 4 minutes (ShareGPT only, 2 s per rate)
    python benchmarks/bench_serving.py --engine vllm   # the real vLLM (CPU build, .venv-vllm) beside tinypaged

Part 1, real time (tinypaged): Poisson arrivals replayed on the wall clock through the real engine,
  for five systems at equal KV memory, equal max_num_seqs and the same model: static batching with
  contiguous Max reservation; continuous batching with contiguous Max / Pow2 / Oracle reservation
  (the paper's Orca baselines); continuous batching over paged KV (vLLM). Lengths follow the
  paper's ShareGPT and Alpaca statistics scaled down to fit a CPU, and the 2048-token cap and the
  paper's KV budget (15.7K token slots, OPT-13B on an A100-40GB) are scaled by the same factor, so
  each reservation policy fits as many requests at once as it did in the paper. The rates come from
  a step-time model fitted on this machine first (runs of other requests): seven rates, evenly spaced
  from half the simulator's predicted knee of Orca (Max) to twice vLLM's. Each rate replays the same
  span of traffic (--seconds, at least --requests requests), long enough for queues to build.
Part 2, the simulator against the engine: at three rates, a real-time vLLM run between two
  calibration runs of other requests at the same rate; the simulator, with the model fitted on those,
  predicts the run's mean normalized latency (same requests, same arrival times), printed next to the
  measurement. The other systems are checked against their Part-1 runs with the same models.
Part 3, the paper's scale: the same systems simulated with a roofline cost model of OPT-13B (fp16)
  on one A100-40GB and the paper's KV budget: normalized latency against request rate (Figure 12),
  the highest rate each system sustains under a latency threshold, and requests batched at once
  (Figure 13), next to the paper's figures.

With ``--engine vllm`` the Part-1 experiment runs on the real vLLM (its CPU build, from ``.venv-vllm``, made
by ``scripts/vllm_env.sh``; in a subprocess) beside tinypaged's paged system: both on SmolLM2-135M float32
(the tiny model's heads are too small for vLLM's CPU attention), block 32, the same KV blocks, the same
requests at the same Poisson arrival times, the same span of traffic per rate (--seconds, default 30, at
least --requests, default 16), and the same --cores; one table, and each engine's sustainable rate.
Elsewhere it says in one line how to get the vLLM environment.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from tinypaged.lab.serving import (PAPER_BATCHED, PAPER_RATE_RATIOS, SYSTEM_NAMES, format_table, get_system, quiet,
                               rate_ratios, replay, serve_systems, serving_table, serving_trace, shared_weights,
                               sustainable_rate, system_config, with_rate)
from tinypaged.lab.simulator import (OPT13B_A100, StepCostModel, calibration_steps, check_against, knee_rates,
                                 paper_setup, sweep, validate)
from tinypaged.lab.workloads import summarize

THRESHOLD_FACTOR = 5  # a system "sustains" a rate while its mean normalized latency stays under 5x the idle one
NUM_RATES = 7  # real-time rates per dataset
LONG_TRACE = 4000  # requests drawn for the knee search; a rate's run replays rate x --seconds of them
VALIDATION_ATTEMPTS, MAX_STEP_ERROR = 5, 0.05  # re-measure a rate whose calibration missed its steps by > 5%
VALIDATION_REQUESTS = 100  # at least this many requests per validation run, --quick included

# Per dataset: length scale for the CPU, real-time rates (req/s) for the tiny model, OPT-13B simulated rates.
# Per dataset: length scale for the CPU; OPT-13B simulation: seconds of traffic per rate, static batching's
# rates, the other systems' rates.
DATASETS = {
    "sharegpt": dict(scale=1 / 8, paper_seconds=200, slow_rates=[0.2, 0.3, 0.5, 0.75, 1],
                     paper_rates=[1, 1.5, 2, 2.5, 3, 4, 5, 6, 8]),
    "alpaca": dict(scale=1 / 2, paper_seconds=20, slow_rates=[1, 2, 3, 5],
                   paper_rates=[5, 10, 25, 50, 75, 100, 150, 200, 250, 300]),
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


# -- parts 1 and 2 ---------------------------------------------------------------------------------------
def realtime(args, dataset):
    """Part 1 and Part 2 on one dataset: calibrate, pick the rates, replay every system, validate."""
    from tinypaged import LLM

    cfg = DATASETS[dataset]
    scale = cfg["scale"]
    common = paper_setup(scale, max_num_seqs=args.max_num_seqs)
    trace = serving_trace(dataset, args.requests, None, seed=0, scale=scale)
    calibration = serving_trace(dataset, args.requests, None, seed=1, scale=scale)
    s = summarize(trace)
    say(f"\n== Part 1 ({dataset}): real-time replay on {args.model!r} ({args.device}), {args.requests} requests ==")
    say(f"Lengths x{scale:g} (mean input {s['mean_input']:.1f}, output {s['mean_output']:.1f}, longest "
        f"{s['max_total']}); max_model_len {common['max_model_len']} (2048 x{scale:g}); KV cache "
        f"{common['kv_cache_tokens']} tokens for every system (15.7K x{scale:g}); max_num_seqs {args.max_num_seqs}; "
        f"block 16; output lengths forced; Poisson arrivals.")
    # knees are searched on the span of traffic every rate replays (a trace far longer than any rate needs)
    long_trace = serving_trace(dataset, max(args.requests, LONG_TRACE), None, seed=0, scale=scale)
    knees_of = lambda m: knee_rates(m, long_trace, num=2, duration=args.seconds,  # noqa: E731
                                    min_requests=args.requests, **common)  # [Orca (Max)'s knee, vLLM's]
    with quiet(), shared_weights():
        llm = LLM(args.model, device=args.device, dtype="float32", seed=0, **system_config("vllm", **common))
        replay(llm, with_rate(calibration[:4], 1000.0), "vllm")
        closed = calibration_steps(llm, calibration)  # every batch size, but faster than under arrivals
        model = StepCostModel.fit(closed)
        if not args.rates:  # add the steps of a real-time run at half the predicted knee: small batches, true speed
            probe = knees_of(model)[-1] / 2
            model = StepCostModel.fit(closed + replay(llm, with_rate(calibration, probe, 99), "vllm", probe).steps)
    say(f"Step-time model fitted on runs of {len(calibration)} other requests: {model.describe()}")
    knees = knees_of(model)
    if args.rates:
        rates = sorted(args.rates)
    else:  # evenly spaced (geometrically) from half the lower knee to twice vLLM's: light load to overload
        lo, hi = min(knees) / 2, 2 * max(knees)
        rates = [round(lo * (hi / lo) ** (i / (NUM_RATES - 1)), 1) for i in range(NUM_RATES)]
    say(f"Rates (req/s): {rates} (from half of the lower of the calibrated simulator's knees, Orca (Max) "
        f"{knees[0]:g} and vLLM {knees[-1]:g}, to twice vLLM's); {args.seconds:g} s of Poisson traffic per rate "
        f"(at least {args.requests} requests)")
    long_trace = long_trace[:max(args.requests, math.ceil(max(rates) * args.seconds))]
    exp = serve_systems(args.model, long_trace, common, rates=rates, device=args.device, log=say,
                        seconds=args.seconds, min_requests=args.requests)
    # the step costs of this period: vLLM's real-time runs, measured interleaved with the other systems'
    period = StepCostModel.fit([st for r in rates for st in exp.runs[("vllm", r)].steps])
    say(f"Step-time model of vLLM's real-time runs above: {period.describe()}")
    say(f"\nThe first {args.requests} requests queued at t=0 (closed loop, no timing involved): " + ", ".join(
        f"{get_system(n).label} {len(exp.runs[(n, None)].steps)} steps / largest batch "
        f"{max(st.num_seqs for st in exp.runs[(n, None)].steps)}" for n in SYSTEM_NAMES))
    say("\n" + serving_table({k: v for k, v in exp.runs.items() if k[1] is not None}))
    th = threshold_of(exp.latency("vllm")[0])
    sustained = {n: sustainable_rate(rates, exp.latency(n), th) for n in SYSTEM_NAMES}
    predicted = sweep(long_trace, period, rates, SYSTEM_NAMES, duration=args.seconds, min_requests=args.requests,
                      **common)
    say(f"\nSustainable rate (mean normalized latency <= {th:.4f} s/token = {THRESHOLD_FACTOR}x vLLM's measured at "
        f"{rates[0]:g} req/s):")
    say("  measured:  " + ", ".join(f"{get_system(n).label} {v:.1f}" for n, v in sustained.items()) + " req/s")
    say("  simulated: " + ", ".join(f"{get_system(n).label} {v:.1f}" for n, v in predicted.sustainable(th).items())
        + " req/s (the step-time model of vLLM's runs)")
    for line in ratio_lines(sustained):
        say(line)
    top = rates[-1]
    say(f"Requests batched at once at {top:g} req/s: " + ", ".join(
        f"{get_system(n).label} {exp.runs[(n, top)].summary()['batched']:.2f}" for n in SYSTEM_NAMES)
        + f"  (paper, OPT-13B ShareGPT: vLLM {PAPER_BATCHED['vllm']}, Oracle {PAPER_BATCHED['orca-oracle']}, "
          f"Pow2 {PAPER_BATCHED['orca-pow2']}, Max {PAPER_BATCHED['orca-max']})")
    say(f"Mean step time at {top:g} req/s (busier, not faster): " + ", ".join(
        f"{get_system(n).label} {1e3 * exp.runs[(n, top)].summary()['step_time']:.1f} ms" for n in SYSTEM_NAMES)
        + f"; useful share of static batching's slots {exp.runs[('static', top)].summary()['useful_slot_share']:.0%}")

    say(f"\n== Part 2 ({dataset}): the simulator against the engine ==")
    val_rates = rates[:3] if args.rates else [round(f * knees[-1], 1) for f in (0.4, 0.6, 0.8)]
    say(f"vLLM at {val_rates} req/s (0.4, 0.6, 0.8 x its predicted knee; near the knee any error in step costs is "
        f"multiplied by queueing). At each rate: a real-time run of the other requests at that rate, the measured "
        f"run, another run of the other requests; the model is fitted on those two. Measured again (up to "
        f"{VALIDATION_ATTEMPTS} times) when that model misjudges the measured run's own steps by over "
        f"{MAX_STEP_ERROR:.0%} (the machine's speed changed in between: the simulator's input, not the simulator, "
        f"was wrong); every attempt is printed. 'own steps' refits on the measured run's steps: the error left is "
        f"the simulator's.")
    n = max(args.requests, VALIDATION_REQUESTS)  # fewer make one run's mean latency too noisy for a 15% check
    if n > len(trace):
        trace = serving_trace(dataset, n, None, seed=0, scale=scale)
        calibration = serving_trace(dataset, n, None, seed=1, scale=scale)
    say(f"{n} requests per run.")
    with quiet(), shared_weights():
        checks = validate(llm, calibration, trace, val_rates, attempts=VALIDATION_ATTEMPTS,
                          max_step_error=MAX_STEP_ERROR, **common)
    rows = [[f"{v.rate:g}", v.attempt, f"{v.measured:.4f}", f"{v.predicted:.4f}", f"{100 * v.error:+.1f}%",
             f"{100 * v.step_model_error:+.1f}%", f"{100 * v.own_steps_error:+.1f}%"] for v in checks]
    say(format_table(["rate req/s", "attempt", "measured s/token", "simulated s/token", "error", "step model",
                      "own steps"], rows))
    final = [v for i, v in enumerate(checks) if i + 1 == len(checks) or checks[i + 1].rate != v.rate]
    worst = max(abs(v.error) for v in final)
    say(f"worst error at the three rates (last attempt each): {100 * worst:.1f}% "
        f"({'within' if worst <= 0.15 else 'OUTSIDE'} the 15% bound)")
    rows = []
    for name in SYSTEM_NAMES:
        if name == "vllm":
            continue
        for v in check_against(period, {r: exp.runs[(name, r)] for r in rates[:3]}, name, **common):
            rows.append([get_system(name).label, f"{v.rate:g}", f"{v.measured:.4f}", f"{v.predicted:.4f}",
                         f"{100 * v.error:+.1f}%", f"{100 * v.own_steps_error:+.1f}%"])
    say("The other systems' Part-1 runs, predicted with the step-time model of vLLM's runs of the same period:")
    say(format_table(["system", "rate req/s", "measured s/token", "simulated s/token", "error", "own steps"], rows))


# -- part 3 ----------------------------------------------------------------------------------------------
def paper_scale(args, dataset):
    cfg = DATASETS[dataset]
    seconds = cfg["paper_seconds"] // (3 if args.quick else 1)
    rates = {s: cfg["slow_rates"] if s == "static" else cfg["paper_rates"] for s in SYSTEM_NAMES}
    setup = paper_setup(1.0)
    trace = serving_trace(dataset, round(max(cfg["paper_rates"]) * seconds), None, seed=0)
    t = time.perf_counter()
    sw = sweep(trace, OPT13B_A100, rates, SYSTEM_NAMES, duration=seconds, min_requests=100, **setup)
    say(f"\n== Part 3 ({dataset}): {OPT13B_A100.name}, {seconds} s of Poisson traffic per rate (at least 100 "
        f"requests), KV {setup['kv_cache_tokens']} tokens, max_num_seqs {setup['max_num_seqs']}, block 16 "
        f"({time.perf_counter() - t:.1f} s to simulate) ==")
    say("Mean normalized latency (s/token), Figure 12's y axis:")
    for s in SYSTEM_NAMES:
        say(f"  {get_system(s).label:14s} " + "  ".join(f"{r:g}: {lat:.3f}" for r, lat in zip(sw.rates[s], sw.latency[s])))
    th = threshold_of(sw.latency["vllm"][0])
    sustained = sw.sustainable(th)
    say(f"Sustainable rate (<= {th:.4f} s/token = {THRESHOLD_FACTOR}x vLLM's at {sw.rates['vllm'][0]:g} req/s): "
        + ", ".join(f"{get_system(s).label} {v:.2f}" for s, v in sustained.items()) + " req/s")
    for line in ratio_lines(sustained):
        say(line)
    say(f"Requests batched at once near {sustained['vllm']:.2f} req/s: " + ", ".join(
        f"{get_system(s).label} {sw.at(s, sustained['vllm']):.2f}" for s in SYSTEM_NAMES)
        + f"  (paper, ShareGPT 2 req/s: vLLM {PAPER_BATCHED['vllm']}, Oracle {PAPER_BATCHED['orca-oracle']}, "
          f"Pow2 {PAPER_BATCHED['orca-pow2']}, Max {PAPER_BATCHED['orca-max']})")


# -- vLLM ------------------------------------------------------------------------------------------------
def vllm_run(result: dict, trace, rate: float, max_num_seqs: int):
    """A ServingRun from one realtime experiment of ``tinypaged.lab.vllm_side`` (vLLM's own step records)."""
    from tinypaged.lab.serving import BatchShape, RequestRecord, ServingRun, StepRecord

    requests = [RequestRecord(r.request_id, r.prompt_len, r.output_len, a, f, e)
                for r, a, f, e in zip(trace, result["arrival"], result["first_token"], result["finished"])]
    steps = [StepRecord(st["start"], st["end"], BatchShape(st["batch"], st["prefill_tokens"], st["decode_tokens"]),
                        st["batch"]) for st in result["steps"] if st.get("batch")]
    return ServingRun("vLLM (real)", rate, sorted(requests, key=lambda r: r.arrival), steps, max_num_seqs,
                      result["num_preemptions"])


def run_vllm(args):
    """Part 1's experiment on the real vLLM (CPU build, compiled graph) beside tinypaged's paged system, both
    on SmolLM2-135M float32, the same requests at the same arrival times, block 32 and the same KV blocks."""
    from tinypaged import LLM
    from tinypaged.lab import vllm_side
    from tinypaged.lab.workloads import prompt_token_ids

    if not vllm_side.available():
        say(f"The vLLM run is skipped: {vllm_side.MISSING}")
        return 0
    bs = vllm_side.CPU_BLOCK_SIZE
    for dataset in args.datasets:
        cfg = DATASETS[dataset]
        common = paper_setup(cfg["scale"], max_num_seqs=args.max_num_seqs)
        blocks = common["kv_cache_tokens"] // bs
        rates = sorted(args.rates or [0.25, 0.5, 1.0, 2.0])
        count = {r: max(args.requests, math.ceil(r * args.seconds)) for r in rates}  # the same span per rate
        trace = serving_trace(dataset, max(count.values()), None, seed=0, scale=cfg["scale"])
        say(f"\n== vLLM beside tinypaged ({dataset}): SmolLM2-135M float32, KV {blocks} blocks of {bs} "
            f"({blocks * bs} tokens; vLLM gets one more, its null block), max_num_seqs {common['max_num_seqs']}, "
            f"max_model_len {common['max_model_len']}, {args.seconds:g} s of Poisson traffic per rate (at least "
            f"{args.requests} requests), {args.cores} core(s) each ==")
        engine = dict(num_gpu_blocks_override=blocks + 1, block_size=bs, max_num_seqs=common["max_num_seqs"],
                      max_model_len=common["max_model_len"], max_num_batched_tokens=512)
        moved = {r: with_rate(trace[:count[r]], r, seed=0) for r in rates}
        vocab = 49152

        def reqs(tr):
            return [vllm_side.request(prompt_token_ids(r, vocab, 0), r.output_len, arrival=r.arrival_time) for r in tr]

        t0 = time.perf_counter()
        exps = [dict(engine=engine, requests=reqs(with_rate(trace[:4], 1000.0)))]  # warm-up
        exps += [dict(engine=engine, requests=reqs(moved[r]), realtime=True) for r in rates]
        res = vllm_side.run(exps, cores=args.cores, timeout=7200)
        say(f"vLLM: {time.perf_counter() - t0:.0f} s in its subprocess (engine start-up and compile "
            f"{res[0]['engine_start_s']:.0f} s)")
        runs = {("vLLM (real)", r): vllm_run(x, moved[r], r, common["max_num_seqs"]) for r, x in zip(rates, res[1:])}
        import torch

        torch.set_num_threads(args.cores)
        with quiet():
            llm = LLM("smollm2-135m", device="cpu", dtype="float32", seed=0, scheduling_policy="fcfs", kv_cache_manager="paged",
                      block_size=bs, num_gpu_blocks_override=blocks, max_num_seqs=common["max_num_seqs"],
                      max_model_len=common["max_model_len"], max_num_batched_tokens=512)
            replay(llm, with_rate(trace[:4], 1000.0), "vllm")  # warm-up
            for r in rates:
                runs[("vllm", r)] = replay(llm, moved[r], "vllm", r)
        say(serving_table(runs, systems=["vllm", "vLLM (real)"]))
        th = threshold_of(runs[("vLLM (real)", rates[0])].summary()["normalized_latency"])
        sus = {name: sustainable_rate(rates, [runs[(name, r)].summary()["normalized_latency"] for r in rates], th)
               for name in ("vllm", "vLLM (real)")}
        say(f"Sustainable rate (mean normalized latency <= {th:.4f} s/token = {THRESHOLD_FACTOR}x the real vLLM's at "
            f"{rates[0]:g} req/s): tinypaged (paged) {sus['vllm']:.2f}, vLLM {sus['vLLM (real)']:.2f} req/s")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["tinypaged", "vllm"], default="tinypaged")
    ap.add_argument("--model", default=None, help="tinypaged: 'tiny' (default) or 'smollm2-135m'; vllm: a model name")
    ap.add_argument("--datasets", nargs="+", default=["sharegpt", "alpaca"], choices=sorted(DATASETS))
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per calibration and validation run, and the least per rate (default 100, quick 48)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="seconds of Poisson traffic per real-time rate (default 6, quick 2)")
    ap.add_argument("--device", default="cpu", help="tinypaged's device: cpu (default) or cuda")
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="real-time rates in req/s")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier step times on a shared CPU, which the simulator fits)")
    ap.add_argument("--cores", type=int, default=2, help="--engine vllm: CPU cores for each engine")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", nargs="*", default=[], choices=["realtime", "paper"])
    args = ap.parse_args(argv)
    if args.engine == "vllm":
        if args.model not in (None, "smollm2-135m"):
            ap.error("--engine vllm runs SmolLM2-135M on both engines (the 'tiny' model's 16-wide heads are too "
                     "small for vLLM's CPU attention)")
        args.seconds = args.seconds if args.seconds is not None else 30.0
        args.requests = args.requests if args.requests is not None else 16
        if args.datasets == ["sharegpt", "alpaca"]:
            args.datasets = ["sharegpt"]
        return run_vllm(args)
    args.requests = args.requests or (48 if args.quick else 100)
    args.seconds = args.seconds or (2.0 if args.quick else 6.0)
    import torch

    torch.set_num_threads(args.threads)
    args.model = args.model or "tiny"
    if args.quick and args.rates is None:
        args.datasets = args.datasets[:1]
    t0 = time.perf_counter()
    for dataset in args.datasets:
        if "realtime" not in args.skip:
            realtime(args, dataset)
    if "paper" not in args.skip:
        for dataset in args.datasets:
            paper_scale(args, dataset)
    say(f"\n(total benchmark time {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
