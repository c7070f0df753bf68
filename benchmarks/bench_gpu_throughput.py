"""The engine's speed on a GPU: tinypaged against transformers' ``generate_batch`` on the same device.

    python benchmarks/bench_gpu_throughput.py             # SmolLM2-1.7B's shapes, bfloat16, CUDA (about a minute):
                                                          # eager Triton, Triton with CUDA-graph decode, transformers
    python benchmarks/bench_gpu_throughput.py --small     # a tiny Llama, float32, on the CPU (the smoke test)
    ... --small --skip-hf                                 # seconds: transformers' manager alone takes about a
                                                          # minute to start and run on a CPU
    ... --json FILE                                       # every figure, for RESULTS.md

Speed does not depend on the weights' values, so the model is a randomly initialised Llama built from
a config (SmolLM2-1.7B's shapes: 24 layers, hidden 2048, 32 heads, no grouped KV, MLP 8192, vocabulary
49,152, tied embeddings), saved once as safetensors in a temporary folder, and loaded by both systems:
no download. Every request has the same prompt length and is forced to the same output length
(ignore_eos; transformers with no EOS), all arriving at t=0; each batch size gets twice its size in requests,
so continuous batching refills the batch once.

Reported per system: output tokens/s. For tinypaged, the step breakdown of decode-only steps (median ms):
  prepare   building the inputs on the host (token ids, positions, slots, block tables) and copying them over
  forward   the model's forward, synchronised on both sides (host launches + device work)
  rest      scheduling, sampling (one device-to-host copy of the next tokens) and bookkeeping
  gpu busy  device time of the forward's kernels and copies (torch.profiler, CUDA only)
and the CUDA-graph estimate: a decode graph replays the forward's kernels without launching them from
Python, so it can save at most the forward's idle gap (forward - gpu busy) per step; prepare and rest stay.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from tinypaged import LLM, SamplingParams

logging.getLogger("tinypaged").setLevel(logging.ERROR)
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

# SmolLM2-1.7B's config.json (HuggingFaceTB/SmolLM2-1.7B): the shapes that set the cost of a step.
SMOLLM2_1_7B = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192,
                    rope_theta=130000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
SMALL = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
GRAPH_WORTH_IT = 0.10  # a saving under 10% of a decode step is not worth capturing graphs for


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_llama(shapes: dict, dtype: torch.dtype, device: torch.device, folder: Path):
    """A seeded random Llama with these shapes, on the device, also saved in ``folder`` for tinypaged."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shapes, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the benchmark's dtype: no float32 copy of a large model
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    hf.save_pretrained(folder)
    return hf


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


# -- tinypaged ---------------------------------------------------------------------------------------
class StepTimer:
    """Wraps one engine's step, the runner's prepare and its execute (on the instances) to time each decode step.
    ``forward`` is execute minus prepare: the eager forward, or the copy into a CUDA graph's inputs and its replay."""

    def __init__(self, llm: LLM):
        engine = llm.llm_engine
        self.device, self.rows = engine.device, []
        runner = engine.runner
        step, prepare, execute = engine.step, runner.prepare, runner.execute
        current = {}

        def timed_prepare(scheduled):
            t0 = time.perf_counter()
            out = prepare(scheduled)
            current["prepare"] = time.perf_counter() - t0
            return out

        def timed_execute(*args, **kwargs):
            sync(self.device)
            t0 = time.perf_counter()
            out = execute(*args, **kwargs)
            sync(self.device)
            current["forward"] = time.perf_counter() - t0 - current.get("prepare", 0.0)
            return out

        def timed_step(*args, **kwargs):
            current.clear()
            sync(self.device)
            t0 = time.perf_counter()
            result = step(*args, **kwargs)
            sync(self.device)
            total = time.perf_counter() - t0
            if result.scheduled and all(not s.is_prefill for s in result.scheduled) and "forward" in current:
                self.rows.append({"batch": len(result.scheduled), "step": total, "prepare": current["prepare"],
                                  "forward": current["forward"]})
            return result

        engine.step, runner.prepare, runner.execute = timed_step, timed_prepare, timed_execute

    def medians(self) -> dict:
        if not self.rows:
            return {}
        for r in self.rows:
            r["rest"] = r["step"] - r["prepare"] - r["forward"]
        med = {k: statistics.median(r[k] for r in self.rows) * 1e3 for k in ("step", "prepare", "forward", "rest")}
        med["batch"] = statistics.median(r["batch"] for r in self.rows)
        med["decode_steps"] = len(self.rows)
        return med


def forward_device_ms(llm: LLM, prompts, params, steps: int) -> dict:
    """Device time (kernels and copies) of the forward in full decode steps, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    engine = llm.llm_engine
    runner, model = engine.runner, engine.runner.model

    def marked_forward(*args, **kwargs):
        with record_function("tinypaged.forward"):
            return model(*args, **kwargs)

    ids = [f"prof{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():  # past the prefills: every sequence decodes
        r = engine.step()
        if r.scheduled and all(not s.is_prefill for s in r.scheduled):
            break
    runner.model = marked_forward
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            sync(engine.device)
    finally:
        runner.model = model
        engine.abort_request(ids)
    events = prof.key_averages()
    self_us = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    total_us = lambda e: getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)  # noqa: E731
    # Kernels and copies; the range's own GPU-side span (a "user annotation", idle gaps included) is left out.
    device = [e for e in events if e.device_type == DeviceType.CUDA and e.key != "tinypaged.forward"]
    step_device = sum(self_us(e) for e in device)
    # The forward's share: the device time of what ran inside the host-side range.
    host_range = [e for e in events if e.key == "tinypaged.forward" and e.device_type == DeviceType.CPU]
    fwd_device = total_us(host_range[0]) if host_range else 0
    out = {"step_gpu_busy": step_device / steps / 1e3, "kernels_per_step": sum(e.count for e in device) / steps}
    if fwd_device:
        out["forward_gpu_busy"] = min(fwd_device, step_device) / steps / 1e3
    else:  # no attribution to the range: the whole step's device time bounds the forward's
        out["forward_gpu_busy"] = out["step_gpu_busy"]
        out["forward_gpu_busy_is_step"] = True
    return out


def run_tinypaged(folder: Path, prompts, out_len: int, batch: int, args, device, backend: str) -> dict:
    """``backend``: an attention backend's name, "+graphs" after it for CUDA-graph decode (enforce_eager=False)."""
    longest = len(prompts[0]) + out_len
    name, graphs = backend.removesuffix("+graphs"), backend.endswith("+graphs")
    t_start = time.perf_counter()
    llm = LLM(str(folder), dtype=args.dtype, device=str(device), max_num_seqs=batch, block_size=16,
              max_model_len=longest, kv_cache_tokens=batch * (longest + 16), attention_backend=name,
              enforce_eager=not graphs)
    start_s = time.perf_counter() - t_start  # loading the weights, sizing the cache, capturing graphs
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=4,
                                                                                ignore_eos=True))  # warm-up
    sync(device)
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    sync(device)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.outputs[0].token_ids) for r in res)
    steps = llm.get_metrics()["num_steps"]
    timer = StepTimer(llm)  # a second, timed pass: the synchronisations would slow the first
    llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params)
    row = {"system": f"tinypaged ({backend})", "batch": batch, "requests": len(prompts), "tokens": tokens,
           "wall_s": wall, "tokens_per_s": tokens / wall, "steps": steps, "breakdown_ms": timer.medians(),
           "start_s": start_s}
    if device.type == "cuda" and not args.no_profile and not graphs:
        try:
            row["breakdown_ms"].update(forward_device_ms(llm, prompts[:batch], params, steps=8))
        except Exception as e:  # the profiler is a measuring aid: its failure must not hide the throughput
            row["profile_error"] = f"{type(e).__name__}: {e}"
    del llm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def bandwidth_limit(model, device) -> dict:
    """The decode-step bound: every weight read once per step, at the device-to-device copy rate measured here."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    src = torch.empty(2**28, dtype=torch.float32, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    copy_gb_s = 10 * 2 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9  # read + write
    del src, dst
    return {"weight_bytes": weight_bytes, "copy_gb_s": copy_gb_s, "steps_per_s": copy_gb_s * 1e9 / weight_bytes}


# -- transformers ------------------------------------------------------------------------------------
def run_generate_batch(hf, prompts, out_len: int, batch: int) -> dict:
    """transformers' continuous batching through ``generate_batch`` (EOS off, one length for all)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kwargs = {}
    if "continuous_batching_config" in inspect.signature(hf.generate_batch).parameters:
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(max_requests_per_batch=batch)
        except (ImportError, TypeError):  # older transformers: its own batch sizing
            pass
    hf.generate_batch(inputs=prompts[:2], generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0), **kwargs)  # warm-up
    device = hf.device
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate_batch(inputs=prompts, generation_config=gen, **kwargs)
    sync(device)
    wall = time.perf_counter() - t0
    got = [len(o.generated_tokens) for o in out.values()]
    tokens = sum(min(g, out_len) for g in got)
    return {"system": "transformers generate_batch", "batch": batch, "requests": len(prompts), "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall, "lengths_match": got == [out_len] * len(prompts)}


# -- report ------------------------------------------------------------------------------------------
def graph_estimate(b: dict) -> dict | None:
    """What CUDA graphs for decode could save: the forward's idle gap, at most, per decode step."""
    if "forward_gpu_busy" not in b:
        return None
    gap = max(0.0, b["forward"] - b["forward_gpu_busy"])
    with_graphs = b["step"] - gap
    return {"forward_gap_ms": gap, "step_ms": b["step"], "step_with_graphs_ms": with_graphs,
            "speedup_bound": b["step"] / with_graphs if with_graphs > 0 else float("inf"),
            "host_only_ms": b["step"] - b["step_gpu_busy"], "pays_off": gap / b["step"] >= GRAPH_WORTH_IT}


def print_report(env: dict, rows: list[dict]) -> None:
    print(f"\n{env['model']}, {env['dtype']} on {env['device_name']} | torch {env['torch']} | "
          f"transformers {env['transformers']}")
    print(f"each batch size B: 2*B requests of {env['prompt_len']} prompt + {env['output_len']} output tokens, "
          f"all at t=0, output lengths forced")
    print(f"\n  {'system':<30} {'B':>3} {'tokens':>7} {'wall s':>7} {'tokens/s':>9}")
    for r in rows:
        if "error" in r:
            print(f"  {r['system']:<30} {r['batch']:>3}  failed: {r['error']}")
        else:
            print(f"  {r['system']:<30} {r['batch']:>3} {r['tokens']:>7} {r['wall_s']:>7.2f} {r['tokens_per_s']:>9.1f}"
                  + ("" if r.get("lengths_match", True) else "  (some stopped early)"))
    print("\n  tinypaged decode step, median ms (each a median of its own, so they add up only roughly); "
          "gpu busy = the forward's device time")
    for r in rows:
        b = r.get("breakdown_ms")
        if not b:
            continue
        busy = f"{b['forward_gpu_busy']:.2f}" if "forward_gpu_busy" in b else "n/a"
        print(f"  {r['system']:<22} B={r['batch']:<3} step {b['step']:.2f} | prepare {b['prepare']:.2f} | "
              f"forward {b['forward']:.2f} | rest {b['rest']:.2f} | gpu busy {busy}"
              + (f" | {b['kernels_per_step']:.0f} kernels+copies per step" if "kernels_per_step" in b else ""))
        g = graph_estimate(b)
        if g:
            print(f"    CUDA graphs for decode: the forward idles the GPU {g['forward_gap_ms']:.2f} ms of its "
                  f"{b['forward']:.2f} ms; a graph could bring the step from {g['step_ms']:.2f} to about "
                  f"{g['step_with_graphs_ms']:.2f} ms (at most {g['speedup_bound']:.2f}x); "
                  f"{'worth it' if g['pays_off'] else 'not worth it'} (threshold {GRAPH_WORTH_IT:.0%} of a step); "
                  f"host-only time per step {g['host_only_ms']:.2f} ms")
        elif "profile_error" in r:
            print(f"    (no device time: {r['profile_error']})")
        else:
            print("    (CUDA graphs: n/a on the CPU, where the host is the device)")
    hf = {r["batch"]: r for r in rows if r["system"].startswith("transformers") and "error" not in r}
    limit = env.get("bandwidth_limit")
    print()
    for r in rows:
        if not r["system"].startswith("tinypaged") or "error" in r:
            continue
        parts = [f"  {r['system']:<30} B={r['batch']:<3} {r['tokens_per_s']:9.1f} tokens/s"]
        if r["batch"] in hf:
            parts.append(f"{r['tokens_per_s'] / hf[r['batch']]['tokens_per_s']:.2f}x transformers generate_batch")
        if limit:
            bound = r["batch"] * limit["steps_per_s"]
            parts.append(f"{r['tokens_per_s'] / bound:.1%} of the bandwidth limit ({bound:,.0f} tokens/s)")
        print(" | ".join(parts))
    if limit:
        print(f"  bandwidth limit: a decode step reads every weight once ({limit['weight_bytes'] / 1e9:.2f} GB) at the "
              f"measured copy rate {limit['copy_gb_s']:,.0f} GB/s: at most {limit['steps_per_s']:,.0f} steps/s")


def progress(row: dict) -> None:
    """One line as each run ends, so that a run cut short by a time limit still leaves its figures."""
    what = row.get("error") or f"{row['tokens']} tokens in {row['wall_s']:.2f} s = {row['tokens_per_s']:.1f} tokens/s"
    print(f"[done] {row['system']} B={row['batch']}: {what}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny Llama, float32, CPU unless --device: the smoke run")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda, or cpu with --small)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --small)")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated max_num_seqs values (default 8,64; 4 with --small)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 256 (16 with --small)")
    ap.add_argument("--output-len", type=int, default=None, help="default 128 (8 with --small)")
    ap.add_argument("--backends", default=None,
                    help="tinypaged attention backends, NAME+graphs for CUDA-graph decode (enforce_eager=False) "
                         "(default triton,triton+graphs on CUDA; torch)")
    ap.add_argument("--skip-hf", action="store_true", help="tinypaged only")
    ap.add_argument("--hf-batch-sizes", default=None,
                    help="the batch sizes transformers runs at (default: the first of --batch-sizes; its batch-64 run "
                         "takes minutes)")
    ap.add_argument("--no-profile", action="store_true", help="no torch.profiler pass (no gpu busy time)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.small else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA device here; use --small (CPU) for a smoke run")
    if args.small and device.type == "cpu":
        torch.set_num_threads(1)  # a smoke run on a shared CPU, not a measurement: no thread oversubscription
    args.dtype = args.dtype or ("float32" if args.small else "bfloat16")
    sizes = [int(x) for x in (args.batch_sizes or ("4" if args.small else "8,64")).split(",")]
    if any(b < 1 for b in sizes):
        ap.error(f"--batch-sizes must be positive integers; got {args.batch_sizes}")
    prompt_len = args.prompt_len or (16 if args.small else 256)
    out_len = args.output_len or (8 if args.small else 128)
    backends = (args.backends or ("triton,triton+graphs" if device.type == "cuda" else "torch")).split(",")
    hf_sizes = [int(x) for x in (args.hf_batch_sizes or str(sizes[0])).split(",")]
    shapes = SMALL if args.small else SMOLLM2_1_7B
    dtype = getattr(torch, args.dtype)
    env = {"model": "random Llama, " + ("tiny shapes" if args.small else "SmolLM2-1.7B's shapes"), "dtype": args.dtype,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
           "torch": torch.__version__, "transformers": transformers.__version__, "prompt_len": prompt_len,
           "output_len": out_len, "shapes": shapes}
    rows = []
    with tempfile.TemporaryDirectory(prefix="tinypaged-bench-") as tmp:
        hf = random_llama(shapes, dtype, device, Path(tmp))
        if device.type == "cuda":
            env["bandwidth_limit"] = bandwidth_limit(hf, device)
        for batch in sizes:
            prompts = make_prompts(2 * batch, prompt_len, shapes["vocab_size"], seed=batch)
            for backend in backends:
                try:
                    rows.append(run_tinypaged(Path(tmp), prompts, out_len, batch, args, device, backend))
                except Exception as e:  # one failing configuration must not hide the others
                    rows.append({"system": f"tinypaged ({backend})", "batch": batch, "error": f"{type(e).__name__}: {e}"})
                progress(rows[-1])
            if not args.skip_hf and batch in hf_sizes:
                try:
                    rows.append(run_generate_batch(hf, prompts, out_len, batch))
                except Exception as e:
                    rows.append({"system": "transformers generate_batch", "batch": batch,
                                 "error": f"{type(e).__name__}: {e}"})
                progress(rows[-1])
    for r in rows:
        if r.get("breakdown_ms"):
            r["cuda_graphs"] = graph_estimate(r["breakdown_ms"])
    print_report(env, rows)
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=2))
        print(f"\nfigures written to {args.json}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
