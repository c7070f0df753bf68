"""Stage 3: what sharing KV blocks saves (parallel sampling, beam search, shared prompt prefixes).

(a) Blocks with sharing vs without, on ShareGPT-like and Alpaca-like traces (tinypaged.lab.workloads),
    next to the vLLM paper's savings (Fig. 15). Every count is checked against an analytic count.
    * Parallel sampling: the real BlockManager, no model. Each request prefills its prompt, forks
      n samples (the engine's ``_expand_forks``), and each sample appends ``output_len`` tokens one
      step at a time; copy-on-write gives each sample its own copy of the partial prompt block.
      Analytic: with sharing ``floor(p/B) + n * (ceil((p+t)/B) - floor(p/B))`` blocks at step t,
      without ``n * ceil((p+t)/B)``.
    * Beam search: the real ``tinypaged.engine.beam_search`` on the "tiny" model (random weights, so the
      beam dynamics are those of a flat distribution, not of a trained model), ``ignore_eos`` so each
      request runs its trace output length. Lengths are scaled down for the CPU and the block size
      with them (ShareGPT x0.25 with blocks of 4; Alpaca x0.5 with blocks of 8), so blocks per
      sequence match the paper's block size 16 at full length. Analytic: one block per distinct
      (prompt, full-block token prefix) among live beams, plus each beam's private last block.
    Savings are 1 - (block-steps with sharing) / (block-steps without): memory integrated over
    each request's steps, one request at a time.
(b) Shared-prefix translation prompts on SmolLM2-135M (paper Fig. 16: vLLM 1.67x Orca (Oracle)'s throughput with a
    1-shot 80-token prefix, 3.58x with a 5-shot 341-token prefix): the same requests with prefix
    caching off and on, side by side: prefill tokens computed, peak blocks, throughput.

    python benchmarks/bench_sharing.py            # about 2-3 min on 2 CPU cores
    python benchmarks/bench_sharing.py --quick    # about 30 s

Runs on one torch thread by default (--threads): these small models are faster that way on a shared CPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from tinypaged import LLM, SamplingParams
from tinypaged.lab import workloads
from tinypaged.engine.beam_search import beam_search, analytic_shared_blocks
from tinypaged.kv.block_manager import BlockManager
from tinypaged.kv.block_pool import blocks_needed
from tinypaged.sampling_params import BeamSearchParams
from tinypaged.sequence import Sequence

PAPER = {  # Fig. 15, memory saving for n / width 2, 4, 6 (low and high ends as the paper states them)
    ("alpaca", "parallel"): "6.1%-9.8%", ("alpaca", "beam"): "37.6%-55.2%",
    ("sharegpt", "parallel"): "16.2%-30.5%", ("sharegpt", "beam"): "44.3%-66.3%",
}
BEAM_SCALE = {"alpaca": (0.5, 8), "sharegpt": (0.25, 4)}  # (length scale, block size)


cdiv = blocks_needed


# -- (a) parallel sampling: block-level simulation ---------------------------------------------------
def parallel_sampling_blocks(trace, n: int, block_size: int = 16) -> dict:
    """Drive the real BlockManager through each request's fork and appends; count blocks per step."""
    with_s = without = a_with = a_without = 0
    cow = 0
    for req in trace:
        p, o = req.prompt_len, req.output_len
        bm = BlockManager(n * cdiv(p + o, block_size) + 1, block_size)
        seq = Sequence(str(req.request_id), [3] * p, SamplingParams())
        assert bm.allocate_slots(seq, p)
        seq.num_computed_tokens = p
        samples = [seq]
        for k in range(1, n):  # fork at the first sample: everything is shared
            child = seq.fork(k, None)
            bm.fork(seq, child)
            samples.append(child)
        # step t = 0: the prompt's KV (one copy, whatever n); without sharing, n copies
        with_s += bm.num_blocks - bm.num_free_blocks
        without += n * len(bm.block_ids(seq))
        a_with += cdiv(p, block_size)
        a_without += n * cdiv(p, block_size)
        for t in range(1, o):  # each step every sample writes one more token
            for k, s in enumerate(samples):
                s.output_token_ids.append(4 + k)
                assert bm.allocate_slots(s, 1)
                s.num_computed_tokens += 1
            with_s += bm.num_blocks - bm.num_free_blocks
            without += sum(len(bm.block_ids(s)) for s in samples)
            full = p // block_size
            a_with += full + n * (cdiv(p + t, block_size) - full)
            a_without += n * cdiv(p + t, block_size)
        cow += bm.num_cow_copies
        for s in samples:
            bm.free(s)
        assert bm.num_free_blocks == bm.num_blocks
    return {"with": with_s, "without": without, "analytic_with": a_with, "analytic_without": a_without,
            "cow_copies": cow}


# -- (a) beam search: the real beam search on "tiny" ---------------------------------------------------
def beam_search_blocks(llm, trace, width: int, seed: int = 0) -> dict:
    eng = llm.llm_engine
    bs = eng.kv.block_size
    vocab = eng.vocab_size
    with_s = without = a_with = a_without = cow = 0
    mismatches = 0
    for req in trace:
        analytic = []

        def watch(beams_by_prompt):
            analytic.append((eng.kv.num_blocks - eng.kv.num_free_blocks, analytic_shared_blocks(beams_by_prompt, bs),
                             sum(cdiv(len(b), bs) for beams in beams_by_prompt for b in beams)))

        stats = {}
        prompt = {"prompt_token_ids": workloads.prompt_token_ids(req, vocab, seed)}
        beam_search(eng, [prompt], BeamSearchParams(width, req.output_len, ignore_eos=True), stats=stats, on_step=watch)
        with_s += stats["block_steps_used"]
        without += stats["block_steps_unshared"]
        a_with += sum(a for _, a, _ in analytic)
        a_without += sum(u for _, _, u in analytic)
        mismatches += sum(used != a for used, a, _ in analytic)
        cow += stats["cow_copies"]
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
    return {"with": with_s, "without": without, "analytic_with": a_with, "analytic_without": a_without,
            "cow_copies": cow, "step_mismatches": mismatches}


def savings(r: dict) -> float:
    return 100.0 * (1 - r["with"] / r["without"])


def run_part_a(num_parallel: int, num_beam: int) -> list[dict]:
    rows = []
    print("(a) KV blocks with sharing vs without (block-steps summed over each request's steps)")
    print(f"{'trace':9} {'mode':8} {'n/w':>3} {'with':>10} {'analytic':>10} {'without':>10} {'analytic':>10} "
          f"{'CoW':>6} {'saving':>7}  paper (n/w = 2..6)")
    for name in ("alpaca", "sharegpt"):
        trace = workloads.make_trace(name, num_parallel, seed=0)
        for n in (2, 4, 6):
            r = parallel_sampling_blocks(trace, n)
            rows.append(_print_row(name, "parallel", n, r))
        scale, bs = BEAM_SCALE[name]
        llm = LLM(model="tiny", dtype="float32", device="cpu", block_size=bs,
                  num_gpu_blocks_override=4096 // bs * 16)
        btrace = workloads.make_trace(name, num_beam, seed=1, scale=scale)
        for w in (2, 4, 6):
            r = beam_search_blocks(llm, btrace, w)
            rows.append(_print_row(name, "beam", w, r))
    return rows


def _print_row(name, mode, n, r) -> dict:
    assert r["with"] == r["analytic_with"] and r["without"] == r["analytic_without"], r
    assert r.get("step_mismatches", 0) == 0, r
    s = savings(r)
    print(f"{name:9} {mode:8} {n:3d} {r['with']:10,d} {r['analytic_with']:10,d} {r['without']:10,d} "
          f"{r['analytic_without']:10,d} {r['cow_copies']:6,d} {s:6.1f}%  {PAPER[(name, mode)]}")
    return {"trace": name, "mode": mode, "n": n, **r, "saving_pct": round(s, 1)}


# -- (b) shared prefixes on SmolLM2 ------------------------------------------------------------------
EXAMPLES = [
    ("The weather is nice today.", "Il fait beau aujourd'hui."),
    ("Where is the train station, please?", "Où est la gare, s'il vous plaît ?"),
    ("I would like a cup of coffee with milk.", "Je voudrais une tasse de café au lait."),
    ("My brother works in a hospital in Lyon.", "Mon frère travaille dans un hôpital à Lyon."),
    ("We are going to the beach this weekend.", "Nous allons à la plage ce week-end."),
]
INSTRUCTION = ("You are a careful translator. Translate each English sentence into French. Keep the meaning, "
               "the tone and the punctuation of the original, and answer with the French sentence only.")
QUESTIONS = [
    "The cat is sleeping on the sofa.", "How much does this book cost?", "She reads a newspaper every morning.",
    "The museum opens at nine o'clock.", "Can you help me carry these bags?", "It is raining in Paris again.",
    "I forgot my umbrella at the office.", "The children are playing in the garden.",
    "We ate dinner at a small restaurant.", "He has lived in Canada for ten years.",
    "Please close the window, it is cold.", "The bakery sells fresh bread.", "Our flight leaves tomorrow at noon.",
    "I am learning to play the piano.", "The river flows through the old town.", "They bought a new red car.",
]


def few_shot_prefix(shots: int, extra_context: int = 0) -> str:
    """An instruction and ``shots`` worked examples (the paper's translation prompts, in spirit)."""
    parts = [INSTRUCTION]
    parts += [f"English: {en}\nFrench: {fr}" for en, fr in EXAMPLES[:shots]]
    text = "\n\n".join(parts)
    if extra_context:  # a glossary pads the 5-shot prompt to the paper's length
        text += "\n\nGlossary: " + ", ".join(GLOSSARY[:extra_context])
    return text + "\n\n"


GLOSSARY = ["house = maison", "car = voiture", "book = livre", "water = eau", "bread = pain", "friend = ami",
            "school = école", "city = ville", "tree = arbre", "sea = mer", "sun = soleil", "moon = lune",
            "dog = chien", "cat = chat", "window = fenêtre", "door = porte", "street = rue", "garden = jardin",
            "morning = matin", "evening = soir", "week = semaine", "year = année", "work = travail",
            "money = argent", "train = train", "ticket = billet", "market = marché", "cheese = fromage",
            "mountain = montagne", "river = rivière", "kitchen = cuisine", "doctor = médecin", "shop = magasin",
            "holiday = vacances", "newspaper = journal", "umbrella = parapluie", "breakfast = petit déjeuner",
            "key = clé", "chair = chaise", "table = table", "flower = fleur", "bridge = pont", "island = île"]


def build_prompts(tok, shots: int, num_requests: int, target: int | None = None) -> tuple[list[str], int]:
    """Prefix + distinct questions; the glossary grows until the prefix reaches ``target`` tokens."""
    extra = 0
    prefix = few_shot_prefix(shots)
    while target is not None and len(tok.encode(prefix)) < target and extra < len(GLOSSARY):
        extra += 1
        prefix = few_shot_prefix(shots, extra)
    prompts = [prefix + f"English: {q}\nFrench:" for q in QUESTIONS[:num_requests]]
    return prompts, len(tok.encode(prefix))


def shared_prefix_run(llm, prompts, max_tokens: int) -> dict:
    peak = [0]

    def watch(step):
        kv = llm.llm_engine.kv
        peak[0] = max(peak[0], kv.num_blocks - kv.num_free_blocks)

    before = llm.get_metrics()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), on_step=watch)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    m = llm.get_metrics()
    return {"seconds": dt, "cpu_seconds": cpu, "requests_per_s": len(prompts) / dt,
            "prefill_tokens": m["num_prefill_tokens"] - before["num_prefill_tokens"],
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "peak_blocks": peak[0], "hits": m["prefix_cache_hits"] - before["prefix_cache_hits"],
            "queries": m["prefix_cache_queries"] - before["prefix_cache_queries"],
            "texts": [o.outputs[0].text for o in outs]}


def run_part_b(num_requests: int, max_tokens: int, repeats: int = 1) -> list[dict]:
    """Caching off and on, alternated ``repeats`` times (the fastest run of each is kept): wall time
    on a shared CPU is noisy, so CPU seconds of this process are printed too."""
    print(f"\n(b) shared-prefix translation prompts on SmolLM2-135M: {num_requests} requests, "
          f"{max_tokens} new tokens each, greedy, block size 16, cold cache each run")
    cfg = dict(model="smollm2-135m", device="cpu", dtype="float32", block_size=16, kv_cache_tokens=16384, seed=0)
    rows = []
    for label, shots, target, paper in (("1-shot", 1, 80, "1.67x"), ("5-shot", 5, 341, "3.58x")):
        best = {}
        for _ in range(repeats):
            for caching in (False, True):
                llm = LLM(**cfg, enable_prefix_caching=caching)  # a fresh engine: the cache starts cold
                llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up (no shared blocks)
                prompts, prefix_len = build_prompts(llm.get_tokenizer(), shots, num_requests, target)
                r = shared_prefix_run(llm, prompts, max_tokens)
                if caching not in best or r["seconds"] < best[caching]["seconds"]:
                    best[caching] = r
        r_off, r_on = best[False], best[True]
        assert r_on["texts"] == r_off["texts"], "prefix caching changed the output"
        speedup = r_on["requests_per_s"] / r_off["requests_per_s"]
        print(f"{label}: prefix {prefix_len} tokens (paper: {'80' if shots == 1 else '341'}), "
              f"{r_off['prompt_tokens']:,} prompt tokens in all")
        print(f"  {'caching':8} {'prefill tokens':>14} {'peak blocks':>11} {'hit rate':>8} {'req/s':>7} {'CPU s':>7}")
        for name, r in (("off", r_off), ("on", r_on)):
            rate = f"{100 * r['hits'] / r['queries']:.1f}%" if r["queries"] else "-"
            print(f"  {name:8} {r['prefill_tokens']:14,d} {r['peak_blocks']:11,d} {rate:>8} "
                  f"{r['requests_per_s']:7.2f} {r['cpu_seconds']:7.1f}")
        print(f"  with caching: throughput {speedup:.2f}x, CPU time {r_off['cpu_seconds'] / r_on['cpu_seconds']:.2f}x "
              f"less (paper {paper}); prefill tokens {r_off['prefill_tokens'] / r_on['prefill_tokens']:.2f}x fewer")
        rows.append({"prompt": label, "prefix_tokens": prefix_len, "off": r_off, "on": r_on, "speedup": speedup})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (under ~2 minutes on a CPU)")
    ap.add_argument("--skip-model", action="store_true", help="only part (a)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args(argv)
    # Small models on a shared CPU: with several threads every small op waits for busy cores (a
    # "tiny" beam step measured 20x slower with 2 threads than with 1 on a loaded 2-core machine).
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    run_part_a(num_parallel=60 if args.quick else 400, num_beam=4 if args.quick else 32)
    print(f"[part (a): {time.perf_counter() - t0:.0f} s]")
    if not args.skip_model:
        t1 = time.perf_counter()
        run_part_b(num_requests=8 if args.quick else 16, max_tokens=4 if args.quick else 8,
                   repeats=1 if args.quick else 2)
        print(f"[part (b): {time.perf_counter() - t1:.0f} s]")


if __name__ == "__main__":
    main()
