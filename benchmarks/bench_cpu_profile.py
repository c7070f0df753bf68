"""Where a CPU engine step goes: projections, attention, norms/RoPE, sampling and host overhead.

    python benchmarks/bench_cpu_profile.py              # SmolLM2-135M, 32 requests, max_num_seqs 16 (~1-2 min)
    python benchmarks/bench_cpu_profile.py --vllm       # also one row for the real vLLM (total step time only)

The workload is bench_throughput.py's part 1 (ShareGPT-like requests, lengths x 1/8, forced output
lengths, all arriving at t=0, max_num_seqs 16), so most steps decode a full batch of 16.

Method: explicit wall-clock timers around module calls (``tinypaged.lab.step_profile``, whose docstring
says what each category holds), no profiler. vLLM runs in its own process: its per-step time is
observable (wall / steps), its split is not.
"""

from __future__ import annotations

import argparse
import logging

import torch

from tinypaged import LLM, SamplingParams
from tinypaged.lab.step_profile import CATEGORIES, profile_generate
from tinypaged.lab.workloads import prompt_token_ids, sharegpt_like

logging.getLogger("tinypaged").setLevel(logging.ERROR)


def workload(n, scale):
    trace = sharegpt_like(n, seed=0, scale=scale)
    return [prompt_token_ids(r, 49152, 0) for r in trace], [r.output_len for r in trace]


def profile_tinypaged(prompts, outs, batch, **knobs) -> dict:
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=batch, kv_cache_tokens=8192,
              block_size=16, max_model_len=512, max_num_batched_tokens=512, **knobs)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    warm = prompts[:batch]  # warm-up: the first calls pay one-off allocation (and weight packing) costs
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    return dict(profile_generate(llm, [{"prompt_token_ids": p} for p in prompts], params), tokens=sum(outs))


def profile_vllm(prompts, outs, batch, cores) -> dict | None:
    from tinypaged.lab import vllm_side

    if not vllm_side.available():
        print(f"vLLM row skipped: {vllm_side.MISSING}")
        return None
    reqs = [vllm_side.request(p, o) for p, o in zip(prompts, outs)]
    engine = dict(max_num_seqs=batch, block_size=vllm_side.CPU_BLOCK_SIZE, max_model_len=512,
                  max_num_batched_tokens=512, num_gpu_blocks_override=8192 // vllm_side.CPU_BLOCK_SIZE + 1)
    _, v = vllm_side.run([dict(engine=engine, requests=reqs[:batch]), dict(engine=engine, requests=reqs)],
                         cores=cores, timeout=3600)
    return {"total": v["wall"], "steps": v["num_steps"], "tokens": sum(outs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--scale", type=float, default=1 / 8, help="ShareGPT lengths are multiplied by this")
    ap.add_argument("--batch", type=int, default=16, help="max_num_seqs")
    ap.add_argument("--vllm", action="store_true", help="add the real vLLM's per-step time (minutes: it compiles)")
    ap.add_argument("--cores", type=int, default=2, help="--vllm: CPU cores vLLM binds")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts, outs = workload(args.requests, args.scale)
    print(f"SmolLM2-135M float32 on CPU ({torch.get_num_threads()} torch threads), {len(prompts)} requests, "
          f"{sum(outs)} output tokens, max_num_seqs {args.batch}; ms per engine step (share of the step)", flush=True)
    runs = {"tinypaged, attention_backend='torch'": profile_tinypaged(prompts, outs, args.batch,
                                                                    attention_backend="torch"),
            "tinypaged (default)": profile_tinypaged(prompts, outs, args.batch)}
    rows = []
    for name, r in runs.items():
        ms = lambda sec: 1e3 * sec / r["steps"]  # noqa: E731
        cells = [f"{ms(r[c]):.1f} ({100 * r[c] / r['total']:.0f}%)" for c in CATEGORIES]
        rows.append([name, r["steps"], r["decode_only"], *cells, f"{ms(r['total']):.1f}",
                     f"{r['tokens'] / r['total']:.1f}"])
    if args.vllm and (v := profile_vllm(prompts, outs, args.batch, args.cores)):
        rows.append(["vLLM CPU build (compiled)", v["steps"], "?", *["not observable"] * len(CATEGORIES),
                     f"{1e3 * v['total'] / v['steps']:.1f}", f"{v['tokens'] / v['total']:.1f}"])
    header = ["engine", "steps", "decode-only", *CATEGORIES, "step ms", "tokens/s"]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for i, row in enumerate([header, *rows]):
        print("  " + "  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
