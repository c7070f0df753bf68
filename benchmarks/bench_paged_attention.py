"""How fast is the Triton PagedAttention decode kernel, and what does paging cost?

For each configuration (GQA 32 query / 8 KV heads, head_dim 128, like a Llama-3-8B layer)
the table reports:

* ``paged us``   - kernel time on a shuffled block table (pages scattered through the cache).
* ``GB/s``       - effective bandwidth: bytes the kernel must move (K and V of the real
                   context, Q, O, block table, seq_lens) divided by that time. Decode attention
                   is memory-bound, so this is the number that matters.
* ``%copy``      - that bandwidth as a fraction of a device-to-device copy measured in this
                   run (a practical ceiling; about 4.3 TB/s on an H200).
* ``ident us`` / ``paging +%`` - the same kernel with an identity block table (each
                   sequence's pages contiguous and in order), and the extra time paging costs.
                   The vLLM paper measured 20-26% for its 2023 kernel.
* ``gather us`` / ``speed-up`` - the baseline that first copies K/V out of the pages into
                   padded contiguous tensors, then runs torch attention.

The last three lines (``summary: ...``) condense the table, for ``scripts/gpu_check.sh``'s report:
the best bandwidth as a fraction of the copy, and the median paging overhead and speed-up (with
their ranges) over the configurations measured.

Usage::

    python benchmarks/bench_paged_attention.py            # full sweep (~1-2 min on an H200)
    python benchmarks/bench_paged_attention.py --quick    # four configurations

Without CUDA the kernels would run in Triton's CPU interpreter, where timings mean
nothing; the script says so and exits successfully.
"""

import argparse
import itertools
import statistics
import sys

import tinypaged  # noqa: F401  (first, before triton: it decides how Triton kernels run)
import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def copy_bandwidth(nbytes=1 << 30):
    """Bytes/s of a device-to-device copy (read + write) of a large tensor."""
    import triton.testing

    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    ms = triton.testing.do_bench(lambda: src.clone(), return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def make_batch(batch, context, block_size, dtype, identity, seed=0):
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    value_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=dtype)
    if identity:
        physical = torch.arange(num_blocks, device="cuda")
    else:
        physical = torch.randperm(num_blocks, generator=gen, device="cuda")
    block_tables = physical.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return query, key_cache, value_cache, block_tables, seq_lens


def bytes_moved(batch, context, block_size, dtype):
    elt = torch.finfo(dtype).bits // 8
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elt
    q_and_o = 2 * batch * NUM_HEADS * HEAD_DIM * elt
    tables = batch * (-(-context // block_size)) * 4 + batch * 4
    return kv + q_and_o + tables


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few configurations only")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("No CUDA device: the Triton kernels would run in the CPU interpreter, where timings "
              "measure nothing meaningful about GPU performance. Skipping the benchmark.")
        return 0

    import triton.testing

    from tinypaged.kernels import gather_then_attend, paged_attention_decode
    from tinypaged.kernels.paged_attention import _choose_num_splits, _sm_count

    if args.quick:
        sweep = itertools.product([torch.float16], [16], [1, 64], [512, 8192])
    else:
        sweep = itertools.product([torch.float16, torch.bfloat16], [16, 32], [1, 8, 32, 64], [512, 2048, 8192])

    copy_bw = copy_bandwidth()
    sm_count = _sm_count(torch.device("cuda"))
    print(f"device: {torch.cuda.get_device_name()}  ({sm_count} SMs)")
    print(f"device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    print(f"GQA {NUM_HEADS}q/{NUM_KV_HEADS}kv, head_dim {HEAD_DIM}; times are medians (triton.testing.do_bench)\n")

    header = (f"{'dtype':>8} {'block':>5} {'batch':>5} {'ctx':>5} {'splits':>6} | {'paged us':>9} {'GB/s':>6} "
              f"{'%copy':>6} | {'ident us':>9} {'paging +%':>9} | {'gather us':>10} {'speed-up':>8}")
    print(header)
    print("-" * len(header))

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    rows = []
    for dtype, block_size, batch, context in sweep:
        scale = HEAD_DIM ** -0.5
        paged = make_batch(batch, context, block_size, dtype, identity=False)
        ident = make_batch(batch, context, block_size, dtype, identity=True)
        splits = _choose_num_splits(batch, NUM_KV_HEADS, paged[3].shape[1] * block_size, sm_count)

        # Check before timing: a fast wrong kernel is worth nothing.
        out = paged_attention_decode(*paged, scale)
        ref = gather_then_attend(*paged, scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)

        t_paged = bench(lambda: paged_attention_decode(*paged, scale))
        t_ident = bench(lambda: paged_attention_decode(*ident, scale))
        t_gather = bench(lambda: gather_then_attend(*paged, scale))
        bw = bytes_moved(batch, context, block_size, dtype) / (t_paged * 1e-3)

        print(f"{str(dtype)[6:]:>8} {block_size:>5} {batch:>5} {context:>5} {splits:>6} | "
              f"{t_paged * 1e3:>9.1f} {bw / 1e9:>6.0f} {100 * bw / copy_bw:>5.0f}% | "
              f"{t_ident * 1e3:>9.1f} {100 * (t_paged / t_ident - 1):>+8.1f}% | "
              f"{t_gather * 1e3:>10.1f} {t_gather / t_paged:>7.1f}x")
        config = f"{str(dtype)[6:]}, block {block_size}, batch {batch}, context {context}"
        rows.append({"config": config, "copy": bw / copy_bw, "paging": t_paged / t_ident - 1,
                     "speedup": t_gather / t_paged})
        del paged, ident, out, ref
        torch.cuda.empty_cache()
    print()
    for line in summary(rows):
        print(line)
    return 0


def summary(rows):
    """Three ``summary:`` lines condensing the table's rows (dicts with config, copy, paging, speedup)."""
    best = max(rows, key=lambda r: r["copy"])
    paging = [r["paging"] for r in rows]
    speedup = [r["speedup"] for r in rows]
    return [
        f"summary: bandwidth {100 * best['copy']:.0f}% of the device-to-device copy (best: {best['config']})",
        f"summary: paging overhead vs an identity block table {100 * statistics.median(paging):+.1f}% "
        f"(median of {len(rows)}; {100 * min(paging):+.1f}% .. {100 * max(paging):+.1f}%; paper, 2023: +20-26%)",
        f"summary: speed-up over gather-then-attend {statistics.median(speedup):.1f}x "
        f"(median of {len(rows)}; {min(speedup):.1f}x .. {max(speedup):.1f}x)",
    ]


if __name__ == "__main__":
    sys.exit(main())
