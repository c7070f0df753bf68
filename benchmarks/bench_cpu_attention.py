"""Decode attention on a float32 CPU: tinypaged's C++ operator against the torch route it replaces, side by side.

    python benchmarks/bench_cpu_attention.py               # SmolLM2-135M's heads, batch 8-64, contexts 100-1000
    python benchmarks/bench_cpu_attention.py --threads 1

Shapes are a decode step's: 9 query heads, 3 KV heads, head_dim 64, block size 16, each sequence's blocks scattered
over a cache of 8192 slots per layer; 30 layers' caches are read in turn, as a step does, so the keys come from
memory rather than a warm cache. Per call (one layer), best of several rounds: the C++ operator reading block tables
(what the engine runs), the same operator reading a slot per key (block_size 1, a KV manager with its own slots),
and ``SDPABackend``'s torch route (gathered copies, torch's fused kernel); then what a step builds once for them:
the runner's int32 block tables, or the slot of every key (``paged_context_slots``). The machine's other load
skews the figures: run it on a quiet machine, and read ``/proc/loadavg`` beside them.
"""

from __future__ import annotations

import argparse
import time

import torch

from tinypaged import cpu_native
from tinypaged.attention.backends import DecodeBatch, paged_context_slots
from tinypaged.attention.sdpa import SDPABackend

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, SLOTS = 9, 3, 64, 16, 30, 8192


def best_us(fns, rounds: int) -> list[float]:
    """Microseconds per call of each ``fn(layer)``, the best of ``rounds`` passes over the layers (interleaved)."""
    best = [float("inf")] * len(fns)
    for r in range(rounds + 1):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            for layer in range(LAYERS):
                fn(layer)
            if r:  # the first pass warms up
                best[k] = min(best[k], (time.perf_counter() - t0) / LAYERS * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = cpu_native.ops()
    if ops is None:
        raise SystemExit(f"no CPU operators here: {cpu_native.why()}")
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    torch_route = SDPABackend()
    print(f"decode attention, {HEADS} heads / {KV_HEADS} KV heads x {HEAD_DIM}, block size {BLOCK}, "
          f"{torch.get_num_threads()} threads; microseconds per layer (lengths: max L, the others L/2..L)")
    header = ["B", "L", "C++ tables", "C++ slots", "torch route", "speed-up", "GB/s", "tables us", "slots us"]
    print("  ".join(f"{h:>11}" for h in header))
    for batch in (8, 16, 32, 64):
        for length in (100, 300, 1000):
            width = -(-length // BLOCK)
            if batch * width > SLOTS // BLOCK:
                continue
            tables = torch.randperm(SLOTS // BLOCK, generator=g)[:batch * width].view(batch, width).int()
            lens = torch.randint(length // 2, length + 1, (batch,), generator=g)
            lens[0] = length
            query = torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=g)[:, :HEADS]  # fused qkv's view
            slots = paged_context_slots(tables, length, BLOCK)

            def torch_call(layer):
                batch_ = DecodeBatch(torch.arange(batch), lens, BLOCK, context_slots=slots)  # its per-step work too
                return torch_route.decode(query, keys[layer], values[layer], batch_, 0.125)

            saved, cpu_native.usable = cpu_native.usable, lambda t: None  # SDPABackend's torch route
            try:
                got, ref = ops.decode_attention(query, keys[0], values[0], tables, lens, BLOCK, 0.125), torch_call(0)
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
                us = best_us([lambda i: ops.decode_attention(query, keys[i], values[i], tables, lens, BLOCK, 0.125),
                              lambda i: ops.decode_attention(query, keys[i], values[i], slots, lens, 1, 0.125),
                              torch_call], args.rounds)
            finally:
                cpu_native.usable = saved
            rows = [[list(t) for t in tables.tolist()]]
            meta = best_us([lambda i: torch.tensor(rows[0], dtype=torch.int32),
                            lambda i: paged_context_slots(torch.tensor(rows[0], dtype=torch.int32), length, BLOCK)],
                           max(1, args.rounds // 3))
            gbs = 2 * KV_HEADS * HEAD_DIM * 4 * int(lens.sum()) / us[0] / 1e3  # K and V bytes read
            cells = [batch, length, *(f"{u:.1f}" for u in us), f"{us[2] / us[0]:.2f}x", f"{gbs:.1f}",
                     *(f"{u:.1f}" for u in meta)]
            print("  ".join(f"{c:>11}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
