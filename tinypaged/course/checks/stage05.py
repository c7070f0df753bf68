"""Stage 5 checks: the online softmax, and a learner's Triton kernels (decode attention over the block
table, the split-K merge, and the K/V write), run by Triton's interpreter without a GPU.

The kernel checks call the learner's Python launchers (given in the notebook) on small batches and
record the outputs; the references are the package's PyTorch specs in ``tinypaged/kernels/reference.py``
(``online_softmax_update``, ``paged_attention_reference``, ``merge_splits_reference``,
``reshape_and_cache_reference``). A kernel
body that still holds the stub ``raise NotImplementedError`` fails inside Triton (the interpreter
wraps the error, the compiler rejects ``raise``); ``run_case`` maps both back to "not implemented yet".
"""

from __future__ import annotations

import importlib

import torch

from tinypaged.course.checks import Case, register
from tinypaged.course.checks._util import rng
from tinypaged.course.checks.serving import serving_check


def _k():
    from tinypaged import kernels

    return kernels


def _package_kernels(*names) -> list:
    """The package's own Triton kernels of these names (the ones the assignment's solution defines, line for
    line): a learner who hands them in scores nothing. None on a machine without Triton, where they do not exist."""
    from tinypaged import triton_mode

    if not triton_mode.AVAILABLE:
        return []
    # by module path: the package binds the name tinypaged.kernels.reshape_and_cache to the launcher
    modules = [importlib.import_module(f"tinypaged.kernels.{m}") for m in ("paged_attention", "reshape_and_cache")]
    return [next(getattr(m, n) for m in modules if hasattr(m, n)) for n in names]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton needs CUDA tensors


# ---------------------------------------------------------------- online softmax

@register("05", "online_softmax_update", reference=lambda: _k().online_softmax_update, points=1)
def cases_online_softmax_update(hidden):
    def chunks(seed, G, N, D, cuts, boost):
        def run(f, t):
            g = torch.Generator().manual_seed(seed)
            values = torch.randn(N, D, generator=g, dtype=torch.float64)
            scores = torch.randn(G, N, generator=g, dtype=torch.float64) * 3
            scores[:, boost[0]:boost[1]] += 6.0  # the maximum arrives late: old terms must be rescaled
            m = torch.full((G,), float("-inf"), dtype=torch.float64)
            l = torch.zeros(G, dtype=torch.float64)
            acc = torch.zeros(G, D, dtype=torch.float64)
            for i, (a, b) in enumerate(zip([0] + cuts, cuts + [N])):
                before = (m.clone(), l.clone(), acc.clone())
                out = f(m, l, acc, scores[:, a:b], values[a:b])
                t(f"chunk {i} (scores {a}..{b - 1}): inputs left unchanged",
                  all(torch.equal(x, y) for x, y in zip((m, l, acc), before)))
                m, l, acc = out
                t(f"after chunk {i}: m (the largest score so far)", m)
                t(f"after chunk {i}: l (sum of exp(score - m))", l)
                t(f"after chunk {i}: acc (sum of exp(score - m) * value)", acc)
            t("acc / l at the end (softmax(scores) @ values)", acc / l[:, None])
        return run

    def big(f, t):
        vals = torch.arange(8, dtype=torch.float64).reshape(2, 4)
        m, l, acc = f(torch.tensor([float("-inf")], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                      torch.zeros(1, 4, dtype=torch.float64), torch.tensor([[1000.0, 999.0]], dtype=torch.float64), vals)
        t("scores of 1000 and 999: acc / l", acc / l[:, None])

    if hidden is None:
        return [Case("three chunks", chunks(5, 3, 12, 4, [5, 9], (5, 9)), "the update must rescale l and acc by "
                     "exp(m_old - m_new) when the maximum grows", tol=1e-9),
                Case("large scores", big, "subtract the running max before exp, or exp(1000) overflows", tol=1e-9)]
    r = rng(hidden, 51)
    n = r.randint(8, 20)
    cuts = sorted(r.sample(range(1, n), 3))
    return [Case("random chunks", chunks(hidden, r.randint(1, 4), n, r.randint(2, 6), cuts, (cuts[1], cuts[2])),
                 tol=1e-9, weight=2)]


# ---------------------------------------------------------------- the decode kernel

_CASES = [  # (query heads, KV heads, head_dim, block size, context lengths, query multiplier)
    (2, 2, 16, 8, [5], 1.0),
    (4, 2, 16, 8, [1, 8, 21, 40], 1.0),
    (4, 1, 32, 16, [33, 16, 2], 1.0),
    (2, 2, 16, 16, [24, 7], 60.0),  # scores large enough to overflow exp without the running max
]


def _attention_case(i, h, kvh, dim, bs, lens, mult, seed, splits=None):
    def run(impl, t):
        from tinypaged.lab.kernel_lab import random_paged_batch

        q, kc, vc, tables, seq_lens = random_paged_batch(lens, h, kvh, dim, bs, device=_device(), seed=seed,
                                                         pad_block=0)
        # Unused table entries point at block 0: a kernel that reads past a sequence's end sees keys that
        # would swallow the softmax.
        kc[0], vc[0] = 30.0, 100.0
        args = (q * mult, kc, vc, tables, seq_lens, dim ** -0.5)
        out = impl(*args) if splits is None else impl(*args, num_splits=splits)
        t(f"{h} query heads / {kvh} KV heads, head_dim {dim}, block_size {bs}, seq_lens {lens}"
          + (f", num_splits {splits}" if splits else ""), out)
    return Case(f"batch {i}", run, "token t of sequence s is row t % block_size of block block_tables[s, t // "
                                   "block_size]; mask tokens at or past seq_len", tol=1e-4)


@register("05", "paged_attention", reference=lambda: _k().paged_attention_reference, points=4,
          forbidden=lambda: [_k().paged_attention_reference, _k().paged_attention_decode, _k().gather_then_attend,
                             *_package_kernels("paged_attention_kernel", "merge_splits_kernel")],
          uses=("paged_attention_kernel",))
def cases_paged_attention(hidden):
    if hidden is None:
        return [_attention_case(i, *c, seed=i) for i, c in enumerate(_CASES)]
    r = rng(hidden, 52)
    return [_attention_case(k, r.choice([2, 4]), r.choice([1, 2]), 16, r.choice([4, 8, 16]),
                            [r.randint(1, 50) for _ in range(r.randint(1, 3))], r.choice([1.0, 40.0]),
                            seed=hidden + k) for k in range(2)]


# ---------------------------------------------------------------- the split-K merge

def _split_inputs(seed, S, H, P, D, empty=()):
    g = torch.Generator().manual_seed(seed)
    partial = torch.randn(S, H, P, D, generator=g)
    maxes = torch.randn(S, H, P, generator=g) * 4
    sums = torch.rand(S, H, P, generator=g) * 10 + 0.5
    for s, p in empty:  # a split with no tokens (a short sequence leaves its last splits empty)
        maxes[s, :, p], sums[s, :, p], partial[s, :, p] = float("-inf"), 0.0, 0.0
    dev = _device()
    return partial.to(dev), maxes.to(dev), sums.to(dev)


@register("05", "merge_splits", reference=lambda: _k().merge_splits_reference, points=3,
          forbidden=lambda: [_k().merge_splits_reference, _k().paged_attention_decode,
                             *_package_kernels("merge_splits_kernel")],
          uses=("merge_splits_kernel",))
def cases_merge_splits(hidden):
    def one(label, seed, S, H, P, D, empty=(), hint=""):
        def run(impl, t):
            args = _split_inputs(seed, S, H, P, D, empty)
            t(f"{S} sequences x {H} heads, {P} splits, head_dim {D}" + (f", empty splits {list(empty)}" if empty else ""),
              impl(*args))
        return Case(label, run, hint, tol=1e-4)

    if hidden is None:
        return [one("one split", 0, 1, 2, 1, 16, hint="one split: the output is that split's result"),
                one("three splits", 1, 2, 3, 3, 16, hint="weight each split by l_i * exp(m_i - max m)"),
                one("empty splits", 2, 2, 2, 4, 16, empty=((0, 3), (1, 2), (1, 3)),
                    hint="an empty split (l = 0, m = -inf) contributes nothing and must not make NaN"),
                one("far-apart maxima", 3, 1, 1, 5, 32)]
    r = rng(hidden, 53)
    P = r.randint(2, 7)
    return [one("random splits", hidden, r.randint(1, 3), r.randint(1, 4), P, 16, empty=((0, P - 1),)),
            one("random splits, one", hidden + 1, 2, 2, 1, 32)]


# ---------------------------------------------------------------- writing K and V

@register("05", "reshape_and_cache", reference=lambda: _k().reshape_and_cache_reference, points=2,
          forbidden=lambda: [_k().reshape_and_cache_reference, _k().reshape_and_cache,
                             *_package_kernels("reshape_and_cache_kernel")],
          uses=("reshape_and_cache_kernel",))
def cases_reshape_and_cache(hidden):
    def one(label, seed, tokens, blocks, bs, kvh, d, pad=()):
        def run(impl, t):
            g = torch.Generator().manual_seed(seed)
            dev = _device()
            key = torch.randn(tokens, kvh, d, generator=g).to(dev)
            value = torch.randn(tokens, kvh, d, generator=g).to(dev)
            kc = torch.zeros(blocks, bs, kvh, d, device=dev)
            vc = torch.zeros(blocks, bs, kvh, d, device=dev)
            slots = torch.randperm(blocks * bs, generator=g)[:tokens]
            for p in pad:
                slots[p] = -1
            result = impl(key, value, kc, vc, slots.to(dev))
            t(f"{tokens} tokens into {blocks} blocks of {bs}, slots {slots.tolist()}: the key cache", kc)
            t("the value cache", vc)
            t("what reshape_and_cache returns (nothing: it writes in place)", result)
        hint = "slot s is row s % block_size of block s // block_size; slot -1 writes nothing"
        if pad:  # an unmasked store of slot -1 writes before the cache: in a kernel that corrupts memory
            hint += (" (mask the store with slot >= 0: an unmasked slot -1 writes out of bounds, which "
                     "crashes the process with 'corrupted double-linked list' or a segfault)")
        return Case(label, run, hint, tol=0.0)

    if hidden is None:
        return [one("one block", 0, 3, 2, 4, 1, 8), one("GQA heads, several blocks", 1, 7, 4, 4, 2, 8),
                one("padding slots", 2, 6, 3, 4, 2, 16, pad=(1, 4))]
    r = rng(hidden, 54)
    return [one("random slots", hidden, r.randint(1, 12), 4, r.choice([4, 8]), r.choice([1, 2, 3]), 8,
                pad=(0,))]


# ---------------------------------------------------------------- serving SmolLM2

def _split(llm, outs) -> bool:
    backend = llm.llm_engine.runner.backend
    return getattr(backend, "num_split_calls", 0) > 0


serving_check("05", "serve_kernels", prompts=("The capital of France is",), max_tokens=6,
              engine_kwargs=dict(block_size=4, num_gpu_blocks_override=8, max_model_len=32, max_num_seqs=1,
                                 dtype="float32", device="auto"),
              facts=[("some decode steps ran split-K", _split)],
              uses=("online_softmax_update", "paged_attention_kernel", "paged_attention", "merge_splits_kernel",
                    "merge_splits", "reshape_and_cache_kernel", "reshape_and_cache"))
