"""A long soak of ``python -m tinypaged serve`` (engine core in its own process): does the core's memory level off?

    python benchmarks/soak_server.py                      # 8 rounds of 440 requests on the tiny model (a few minutes)
    python benchmarks/soak_server.py --rounds 12 --json FILE

Each round sends the same mix through the OpenAI-compatible API, 16 at a time: completions and chats, streamed
and not, ``n`` 1-3, prompts that share prefixes (prefix caching on), lengths that make the small KV cache preempt,
stop strings, and a tenth of the streams dropped by the client after their first chunk. After each round, once
nothing runs, it prints the resident memory (RSS) of the server process and of the engine core process. A memory
that keeps growing round after round by about the same amount is a leak; one that grows in the first rounds (caches,
allocator arenas, compiled shapes) and then stays is not. The server binds 127.0.0.1 and is stopped at the end (or
on Ctrl-C) with its engine core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tinypaged", "serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--enable-prefix-caching", "--num-gpu-blocks-override", "128", "--max-num-seqs", "8", "--no-access-log"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server was not ready within 120 s")


def requests_of_round(rng: random.Random, count: int) -> list[dict]:
    prefixes = [" ".join(f"w{rng.randrange(50)}" for _ in range(40)) for _ in range(6)]
    out = []
    for i in range(count):
        prompt = rng.choice(prefixes) + " " + " ".join(f"q{rng.randrange(200)}" for _ in range(rng.randrange(1, 60)))
        body = {"model": "tiny", "max_tokens": rng.choice([4, 16, 48, 96]), "temperature": rng.choice([0.0, 0.8]),
                "n": rng.choice([1, 1, 1, 2, 3]), "seed": i}
        if rng.random() < 0.2:
            body["stop"] = ["q1", "w7"]
        stream = rng.random() < 0.5
        body["stream"] = stream
        if rng.random() < 0.5:
            out.append(("/v1/completions", dict(body, prompt=prompt), stream and rng.random() < 0.2))
        else:
            out.append(("/v1/chat/completions", dict(body, messages=[{"role": "user", "content": prompt}]),
                        stream and rng.random() < 0.2))
    return out


async def one(client: httpx.AsyncClient, path: str, body: dict, drop: bool) -> int:
    if body["stream"]:
        async with client.stream("POST", path, json=body) as r:
            async for _ in r.aiter_lines():
                if drop:
                    break  # the client hangs up after the first line
            return r.status_code
    r = await client.post(path, json=body)
    return r.status_code


async def run_round(port: int, reqs, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    codes: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        async def bounded(req):
            async with sem:
                code = await one(client, *req)
                codes[code] = codes.get(code, 0) + 1
        await asyncio.gather(*(bounded(r) for r in reqs))
    return codes


def rss_mb(proc: psutil.Process) -> dict:
    core = [c for c in proc.children(recursive=True) if c.is_running()]
    return {"server_mb": proc.memory_info().rss / 2**20,
            "core_mb": max((c.memory_info().rss for c in core), default=0) / 2**20}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=440, help="requests per round")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    port = free_port()
    server = start_server(port)
    rows = []
    try:
        ps = psutil.Process(server.pid)
        rows.append({"round": 0, "requests": 0, **rss_mb(ps)})
        print(f"round  0: server {rows[-1]['server_mb']:7.1f} MB, engine core {rows[-1]['core_mb']:7.1f} MB", flush=True)
        for k in range(1, args.rounds + 1):
            t0 = time.perf_counter()
            codes = asyncio.run(run_round(port, requests_of_round(random.Random(k), args.requests), args.concurrency))
            time.sleep(1.0)  # let the core finish aborts of dropped streams
            rows.append({"round": k, "requests": k * args.requests, "codes": codes, "wall_s": time.perf_counter() - t0,
                         **rss_mb(ps)})
            r = rows[-1]
            print(f"round {k:2d}: server {r['server_mb']:7.1f} MB, engine core {r['core_mb']:7.1f} MB "
                  f"({args.requests} requests in {r['wall_s']:.0f} s, status {codes})", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
