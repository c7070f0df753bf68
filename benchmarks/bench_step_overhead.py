"""Per-step host cost must grow with the batch, not with the size of the KV cache.

    python benchmarks/bench_step_overhead.py

The same workload ("tiny" model, float32, CPU: its forward is cheap, so engine overhead shows) runs
on a cache of 1,000 blocks and one of 200,000 blocks (SmolLM2's block count on an H200 at
gpu_memory_utilization=0.9 is about 185k). Runs alternate, and the best of each is kept. The target:
less than 10% apart. For scale, the last lines time one full scan of every block (``kv.stats()``,
now computed only on demand), which the engine used to do on every step.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from tinypaged import LLM, SamplingParams

logging.getLogger("tinypaged").setLevel(logging.ERROR)


def per_step_ms(llm, prompts, params) -> float:
    before = llm.get_metrics()["num_steps"]
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return (time.perf_counter() - t0) * 1e3 / (llm.get_metrics()["num_steps"] - before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = (1_000, 200_000)
    llms = {n: LLM("tiny", dtype="float32", device="cpu", block_size=16, num_gpu_blocks_override=n,
                   max_num_seqs=32, max_model_len=256) for n in sizes}
    prompts = [{"prompt_token_ids": [(7 * i + j) % 4000 + 3 for j in range(48)]} for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for llm in llms.values():  # warm up
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    best = {n: float("inf") for n in sizes}
    for _ in range(args.repeats):
        for n, llm in llms.items():
            best[n] = min(best[n], per_step_ms(llm, prompts, params))
    print("per-step host time, 32 requests x (48 prompt + 48 output tokens), tiny model, best of", args.repeats)
    for n in sizes:
        print(f"  {n:>7,} blocks: {best[n]:.3f} ms per step")
    ratio = best[sizes[1]] / best[sizes[0]]
    print(f"  ratio 200,000 / 1,000 blocks: {ratio:.3f}  (target < 1.10: {'met' if ratio < 1.10 else 'MISSED'})")
    for n, llm in llms.items():
        t0 = time.perf_counter()
        llm.llm_engine.kv.stats()
        print(f"  one full scan (kv.stats(), on demand only) at {n:>7,} blocks: {(time.perf_counter() - t0) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
