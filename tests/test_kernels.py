"""Triton kernels against their PyTorch references.

Without CUDA the kernels run in Triton's interpreter (one program at a time, in
NumPy), so every case here is kept small: a handful of sequences, contexts of at
most a few hundred tokens. On a CUDA machine the same tests run compiled.
"""

import random

import pytest
import torch

from tinypaged.kernels import (
    gather_then_attend,
    merge_splits_reference,
    online_softmax_update,
    paged_attention_decode,
    paged_attention_reference,
    reshape_and_cache,
    reshape_and_cache_reference,
)
from tinypaged.kernels.paged_attention import MIN_TOKENS_PER_SPLIT, _choose_num_splits
from tinypaged.triton_mode import INTERPRETED

if INTERPRETED:
    import triton.language as tl

    # Triton's own library functions (tl.zeros, tl.cdiv, ...) are @triton.jit too: if
    # triton was imported before tinypaged set TRITON_INTERPRET, they were built for the
    # compiler and every kernel here fails with "Cannot call @triton.jit'd outside of the
    # scope of a kernel". Say so plainly instead.
    if type(tl.zeros).__name__ != "InterpretedFunction":
        raise RuntimeError("triton was imported before tinypaged: import tinypaged first "
                           "(e.g. in conftest.py) so the Triton interpreter is set up in time")

# (atol, rtol) per dtype. fp32: the kernel and the reference differ only in the
# order of sums. fp16/bf16: both compute in fp32, and the output is rounded to
# fp16 (~1e-3 relative) or bf16 (~8e-3 relative).
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (1.5e-2, 2e-2),
    # fp64 keeps its softmax state in fp64; the scale reaches the kernel as an fp32 scalar.
    torch.float64: (1e-6, 1e-6),
}

CUDA = torch.cuda.is_available()


@pytest.fixture
def device():
    return "cuda" if CUDA else "cpu"


def make_paged_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                     seed=0, shuffle=True, spare_blocks=3):
    """Random query and caches, with each sequence's pages scattered through the cache.

    Unused block-table entries hold -1, so any read past a sequence's end would fault
    on a GPU (or index garbage): the kernel must never touch them.
    """
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq) + 1  # one spare column: tables are usually wider than needed
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
    block_tables = torch.full((num_seqs, width), -1, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = physical[used:used + nb].to(torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    return (query.to(device), key_cache.to(device), value_cache.to(device),
            block_tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device))


def assert_close(actual, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    assert actual.dtype == expected.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# One line per case: heads (query/KV), head_dim, block size, dtype, context lengths.
# Together they cover MHA and GQA ratios 2, 3 (SmolLM2: 9q/3kv), 4; head_dim 64/128;
# block sizes 8..128; 1-token, block-aligned and ragged contexts; fp32, fp16 and fp64.
CASES = [
    # H, KV, dim, block, dtype,         seq_lens
    (4, 4, 64, 16, torch.float32, [1, 16, 45]),
    (4, 2, 128, 8, torch.float32, [24, 3, 1]),
    (8, 2, 64, 32, torch.float16, [64, 33, 1]),
    (9, 3, 64, 16, torch.float32, [130, 1, 17]),
    (9, 3, 64, 128, torch.float16, [128, 5]),
    (4, 2, 128, 32, torch.float16, [96, 71]),
    (4, 2, 16, 8, torch.float64, [1, 20, 9]),     # the "tiny" model's shape, fp64 (exact engine tests)
]


@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-b{c[3]}-{str(c[4])[6:]}")
def test_paged_attention_matches_reference(case, num_splits, device):
    num_heads, num_kv_heads, head_dim, block_size, dtype, seq_lens = case
    args = make_paged_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
    scale = head_dim ** -0.5
    expected = paged_attention_reference(*args, scale)
    actual = paged_attention_decode(*args, scale, num_splits=num_splits)
    assert actual.shape == expected.shape
    assert_close(actual, expected, dtype)


def test_random_configs(device):
    """A seeded sweep over shapes the fixed cases do not pin down."""
    rng = random.Random(1234)
    for trial in range(10):
        num_kv_heads = rng.choice([1, 2, 3])
        num_heads = num_kv_heads * rng.choice([1, 2, 3, 5])
        head_dim = rng.choice([32, 64, 128])
        block_size = rng.choice([8, 16, 32, 64, 128])
        dtype = rng.choice([torch.float32, torch.float16])
        seq_lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 3))]
        num_splits = rng.choice([None, 1, 2, 4])
        args = make_paged_batch(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                                seed=trial, shuffle=rng.random() < 0.8)
        scale = rng.uniform(0.05, 0.3)
        expected = paged_attention_reference(*args, scale)
        actual = paged_attention_decode(*args, scale, num_splits=num_splits)
        assert_close(actual, expected, dtype)


def test_more_splits_than_tiles(device):
    """Splits that receive no tokens must not disturb the merge (they write l = 0)."""
    args = make_paged_batch([1, 70], 4, 2, 64, 16, torch.float32, device)
    expected = paged_attention_reference(*args, 0.125)
    assert_close(paged_attention_decode(*args, 0.125, num_splits=8), expected, torch.float32)


def test_block_table_indirection_is_honoured(device):
    """Same data under two different physical layouts gives the same answer."""
    seq_lens, shape = [40, 23], (4, 2, 64, 8)
    shuffled = make_paged_batch(seq_lens, *shape, torch.float32, device, seed=5, shuffle=True)
    contiguous = make_paged_batch(seq_lens, *shape, torch.float32, device, seed=5, shuffle=False)
    query, kc, vc, bt, lens = contiguous
    # Move the contiguous batch's blocks to the shuffled batch's physical positions.
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    real = bt >= 0
    kc2[shuffled[3][real].long()] = kc[bt[real].long()]
    vc2[shuffled[3][real].long()] = vc[bt[real].long()]
    a = paged_attention_decode(query, kc, vc, bt, lens, 0.125)
    b = paged_attention_decode(query, kc2, vc2, shuffled[3], lens, 0.125)
    assert_close(a, b, torch.float32)


def test_strided_query(device):
    """Engines slice q out of a fused qkv projection: a non-contiguous view must work."""
    query, kc, vc, bt, lens = make_paged_batch([30, 9], 4, 2, 64, 16, torch.float32, device)
    fused = torch.randn(2, 4 + 2 + 2, 64, device=device)
    fused[:, :4] = query
    q_view = fused[:, :4]
    assert not q_view.is_contiguous()
    expected = paged_attention_reference(query, kc, vc, bt, lens, 0.125)
    assert_close(paged_attention_decode(q_view, kc, vc, bt, lens, 0.125, num_splits=2), expected, torch.float32)


def test_empty_sequence_gives_zeros(device):
    """A padded batch slot with seq_len 0 yields zeros (not NaN) in every implementation."""
    query, kc, vc, bt, lens = make_paged_batch([5, 1], 4, 2, 64, 16, torch.float32, device)
    lens[1] = 0
    for fn, kw in [(paged_attention_decode, {"num_splits": 1}), (paged_attention_decode, {"num_splits": 2}),
                   (paged_attention_reference, {}), (gather_then_attend, {})]:
        out = fn(query, kc, vc, bt, lens, 0.125, **kw)
        assert torch.all(out[1] == 0), fn.__name__


@pytest.mark.skipif(not CUDA, reason="bfloat16 needs a compiled kernel (the interpreter has no bf16)")
def test_bfloat16(device):
    args = make_paged_batch([1, 100, 257], 32, 8, 128, 16, torch.bfloat16, device)
    expected = paged_attention_reference(*args, 128 ** -0.5)
    for num_splits in (1, 3):
        assert_close(paged_attention_decode(*args, 128 ** -0.5, num_splits=num_splits), expected, torch.bfloat16)


def test_fp32_is_compared_in_ieee_precision():
    """The fp32 tolerances (1e-4) assume IEEE fp32 on both sides; TF32 (a 10-bit mantissa) would need ~1e-2.

    The kernel's tl.dot calls say input_precision="ieee" (test_the_graded_kernel_multiplies_with_tl_dot), and
    torch's fp32 matmuls (the references, and the model in the lessons) must not have been switched to TF32 by
    any import on the way here.
    """
    import transformers  # noqa: F401  (imported by the engine: it must not change the setting)

    from tinypaged import LLM

    LLM("tiny", dtype="float32", device="cpu", num_gpu_blocks_override=8)
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cuda.matmul.allow_tf32
    assert getattr(torch.backends.cuda.matmul, "fp32_precision", "none") in ("none", "ieee")


def test_choose_num_splits():
    # Short contexts: the single-pass kernel.
    assert _choose_num_splits(1, 8, 512, 132) == 1
    # A long context with few programs: split, but keep partitions >= MIN_TOKENS_PER_SPLIT.
    n = _choose_num_splits(1, 8, 8192, 132)
    assert 1 < n <= 8192 // MIN_TOKENS_PER_SPLIT
    # A big batch already fills the GPU: no split.
    assert _choose_num_splits(64, 8, 8192, 132) == 1
    # Monotone in batch size.
    counts = [_choose_num_splits(b, 8, 4096, 132) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert counts == sorted(counts, reverse=True)


def test_automatic_split_choice_is_correct(device):
    # Wide block table (8 * 128 = 1024 tokens of capacity) with one KV head: auto picks > 1 split.
    args = make_paged_batch([300], 2, 1, 64, 128, torch.float32, device, spare_blocks=6)
    query, kc, vc, bt, lens = args
    bt = torch.cat([bt, torch.full((1, 6), -1, dtype=torch.int32, device=device)], dim=1)
    assert _choose_num_splits(1, 1, bt.shape[1] * 128, 132) > 1
    expected = paged_attention_reference(query, kc, vc, bt, lens, 0.125)
    assert_close(paged_attention_decode(query, kc, vc, bt, lens, 0.125), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_then_attend_matches_reference(dtype, device):
    args = make_paged_batch([1, 16, 50, 33], 9, 3, 64, 16, dtype, device)
    expected = paged_attention_reference(*args, 0.125)
    assert_close(gather_then_attend(*args, 0.125), expected, dtype)


def test_the_kernels_algorithm_in_torch_gives_the_spec():
    """paged_attention_kernel's loop body is online_softmax_update and merge_splits_kernel is merge_splits_reference:
    composed in torch, cutting each context into splits and tiles as the kernel does, they give the spec's answer
    (and the Triton launcher gives the same)."""
    query, kc, vc, bt, lens = make_paged_batch([1, 23, 40], 6, 2, 16, 8, torch.float64, "cpu", seed=9)
    scale, tile, num_splits = 0.3, 4, 3
    S, H, D = query.shape
    group = H // kc.shape[2]
    partial = torch.zeros(S, H, num_splits, D, dtype=torch.float64)
    maxes = torch.full((S, H, num_splits), float("-inf"), dtype=torch.float64)
    sums = torch.zeros(S, H, num_splits, dtype=torch.float64)
    for s in range(S):
        n = int(lens[s])
        per_split = -(-(-(-n // num_splits)) // tile) * tile      # cdiv(cdiv(n, splits), tile) * tile
        for split in range(num_splits):
            m = torch.full((H,), float("-inf"), dtype=torch.float64)
            l, acc = torch.zeros(H, dtype=torch.float64), torch.zeros(H, D, dtype=torch.float64)
            for t0 in range(split * per_split, min((split + 1) * per_split, n), tile):
                tok = torch.arange(t0, min(t0 + tile, n, (split + 1) * per_split))
                blocks, rows = bt[s, tok // 8].long(), tok % 8
                k = kc[blocks, rows].repeat_interleave(group, dim=1)   # [tokens, H, D]
                v = vc[blocks, rows].repeat_interleave(group, dim=1)
                scores = torch.einsum("hd,nhd->hn", query[s], k) * scale
                # every query head has its own values (GQA repeats them): one update per head
                for h in range(H):
                    mh, lh, ah = online_softmax_update(m[h:h + 1], l[h:h + 1], acc[h:h + 1], scores[h:h + 1], v[:, h])
                    m[h], l[h], acc[h] = mh[0], lh[0], ah[0]
            partial[s, :, split] = acc / torch.where(l > 0, l, 1.0)[:, None]
            maxes[s, :, split], sums[s, :, split] = m, l
    expected = paged_attention_reference(query, kc, vc, bt, lens, scale)
    torch.testing.assert_close(merge_splits_reference(partial, maxes, sums), expected, atol=1e-12, rtol=1e-12)
    assert (sums[0, :, 1:] == 0).all(), "a 1-token sequence leaves its last splits empty"
    if not CUDA:  # the interpreter takes these CPU tensors
        assert_close(paged_attention_decode(query, kc, vc, bt, lens, scale, num_splits=num_splits), expected,
                     torch.float64)


def test_merge_splits_kernel_is_merge_splits_reference(device):
    """The merge kernel alone, on splits with far-apart maxima and empty splits (l = 0, m = -inf)."""
    from tinypaged.kernels.paged_attention import merge_splits_kernel

    gen = torch.Generator().manual_seed(2)
    partial = torch.randn(2, 3, 5, 32, generator=gen)
    maxes = torch.randn(2, 3, 5, generator=gen) * 20
    sums = torch.rand(2, 3, 5, generator=gen) * 10 + 0.5
    maxes[0, :, 3:], sums[0, :, 3:], partial[0, :, 3:] = float("-inf"), 0.0, 0.0
    maxes[1, 2], sums[1, 2], partial[1, 2] = float("-inf"), 0.0, 0.0          # a head with no tokens at all
    partial, maxes, sums = partial.to(device), maxes.to(device), sums.to(device)
    out = torch.empty(2, 3, 32, device=device)
    merge_splits_kernel[(2, 3)](out, partial, maxes, sums, out.stride(0), out.stride(1), *partial.stride()[:3],
                                *maxes.stride()[:2], 5, SPLITS_PAD=8, HEAD_DIM=32)
    assert_close(out, merge_splits_reference(partial, maxes, sums), torch.float32)
    assert torch.all(out[1, 2] == 0)


# ---------------------------------------------------------------- reshape_and_cache

def _slot_mapping(num_tokens, num_blocks, block_size, gen, pad_every=4):
    """Distinct random slots, with every pad_every-th token marked as padding (-1)."""
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::pad_every] = -1
    return slots


@pytest.mark.parametrize("block_size, num_kv_heads, head_dim, dtype", [
    (16, 2, 64, torch.float32),
    (8, 3, 128, torch.float16),
    (32, 1, 64, torch.float32),
])
def test_reshape_and_cache_matches_reference(block_size, num_kv_heads, head_dim, dtype, device):
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_blocks = 13, 5
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = _slot_mapping(num_tokens, num_blocks, block_size, gen).to(device)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Start from a recognisable fill so untouched (and -1) slots can be checked.
    kc = torch.full(cache_shape, 7.0, dtype=dtype, device=device)
    vc = torch.full(cache_shape, 7.0, dtype=dtype, device=device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reshape_and_cache(key, value, kc, vc, slots)
    reshape_and_cache_reference(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    # Exactly the real tokens were written.
    written = (kc != 7.0).any(dim=-1).any(dim=-1).sum().item()
    assert written == int((slots >= 0).sum())


def test_reshape_and_cache_int32_slots_and_cast(device):
    """int32 slot mappings work, and fp32 activations are narrowed into an fp16 cache."""
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(6, 2, 64, generator=gen).to(device)
    value = torch.randn(6, 2, 64, generator=gen).to(device)
    slots = torch.tensor([5, -1, 0, 17, 31, -1], dtype=torch.int32, device=device)
    kc = torch.zeros(2, 16, 2, 64, dtype=torch.float16, device=device)
    vc = torch.zeros_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reshape_and_cache(key, value, kc, vc, slots)
    reshape_and_cache_reference(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert torch.equal(kc[1, 1], key[3].half())


def test_write_then_attend_equals_dense_attention(device):
    """End to end: cache a sequence's K/V with the slot mapping, then attend through the pages."""
    gen = torch.Generator().manual_seed(11)
    block_size, num_kv_heads, num_heads, head_dim, n = 8, 2, 4, 64, 21
    table = torch.tensor([6, 1, 3], dtype=torch.int32)              # 3 blocks hold 21 tokens
    positions = torch.arange(n)
    slots = table[positions // block_size].long() * block_size + positions % block_size
    key = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(1, num_heads, head_dim, generator=gen)
    kc = torch.zeros(8, block_size, num_kv_heads, head_dim)
    vc = torch.zeros_like(kc)
    kc, vc, key, value, query = (t.to(device) for t in (kc, vc, key, value, query))
    reshape_and_cache(key, value, kc, vc, slots.to(device))

    out = paged_attention_decode(query, kc, vc, table[None].to(device),
                                 torch.tensor([n], dtype=torch.int32, device=device), 0.125)
    # Dense attention over the original, unpaged K/V.
    k = key.repeat_interleave(2, dim=1)
    v = value.repeat_interleave(2, dim=1)
    probs = torch.softmax(torch.einsum("hd,nhd->hn", query[0], k) * 0.125, dim=-1)
    dense = torch.einsum("hn,nhd->hd", probs, v)
    assert_close(out[0], dense, torch.float32)


# ---------------------------------------------------------------- stage 5 checks must fail wrong code

def _online_no_rescale(m, l, acc, scores, values):
    m_new = torch.maximum(m, scores.max(dim=1).values)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l + p.sum(dim=1), acc + p @ values          # forgets alpha = exp(m - m_new)


def _online_in_place(m, l, acc, scores, values):
    from tinypaged.kernels.reference import online_softmax_update

    new = online_softmax_update(m, l, acc, scores, values)
    m.copy_(new[0]), l.copy_(new[1]), acc.copy_(new[2])
    return m, l, acc


def _online_no_max(m, l, acc, scores, values):
    p = torch.exp(scores)
    return torch.zeros_like(m), l + p.sum(dim=1), acc + p @ values


def _attention_wrong_scale(q, kc, vc, bt, lens, scale):
    return paged_attention_reference(q, kc, vc, bt, lens, scale * 1.1)


def _attention_whole_pages(q, kc, vc, bt, lens, scale):
    # Reads every row of the last page, including the rows past the sequence's end.
    bs = kc.shape[1]
    return paged_attention_reference(q, kc, vc, bt, (lens + bs - 1) // bs * bs, scale)


def _attention_no_max(q, kc, vc, bt, lens, scale):
    out = torch.empty_like(q)
    group = q.shape[1] // kc.shape[2]
    for s in range(len(q)):
        n = int(lens[s])
        pos = torch.arange(n)
        blocks = bt[s, pos // kc.shape[1]].long()
        k = kc[blocks, pos % kc.shape[1]].repeat_interleave(group, 1)
        v = vc[blocks, pos % kc.shape[1]].repeat_interleave(group, 1)
        e = torch.exp(torch.einsum("hd,nhd->hn", q[s], k) * scale)   # overflows for large scores
        out[s] = torch.einsum("hn,nhd->hd", e / e.sum(-1, keepdim=True), v)
    return out


def _attention_stub_in_interpreter(*args):
    # What an exercise kernel with the stub raises when launched: a wrapped NotImplementedError.
    from triton.runtime.errors import InterpreterError

    raise InterpreterError(repr(NotImplementedError("not implemented yet")))


@pytest.mark.parametrize("name, impl, status", [
    ("online_softmax_update", _online_no_rescale, "FAIL"),
    ("online_softmax_update", _online_in_place, "FAIL"),
    ("online_softmax_update", _online_no_max, "FAIL"),
    ("paged_attention", _attention_wrong_scale, "FAIL"),
    ("paged_attention", _attention_whole_pages, "FAIL"),
    ("paged_attention", _attention_no_max, "FAIL"),
    ("paged_attention", _attention_stub_in_interpreter, "not implemented yet"),
])
def test_stage05_checks_reject_wrong_code(name, impl, status):
    from tinypaged.course import checks

    got, msg = checks.evaluate(name, impl)
    assert got == status, f"{name} with {impl.__name__}: {got} {msg}"


# ---------------------------------------------------------------- the launchers' contract

def test_launchers_refuse_what_the_kernels_cannot_do_before_any_work(device):
    """tl.arange spans a power of two, and the kernels read V (and write both caches) with K's strides:
    a bad input is a ValueError naming it, and no cache is written."""
    query, kc, vc, bt, lens = make_paged_batch([5], 2, 1, 48, 8, torch.float32, device)
    with pytest.raises(ValueError, match="head_dim=48"):
        paged_attention_decode(query, kc, vc, bt, lens, 0.125)
    key = torch.randn(3, 1, 48, device=device)
    kc_before = kc.clone()
    with pytest.raises(ValueError, match="head_dim=48"):
        reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1, 2], device=device))
    assert torch.equal(kc, kc_before)

    query, kc, vc, bt, lens = make_paged_batch([5], 2, 1, 16, 8, torch.float32, device)
    vc_other_layout = vc.transpose(0, 1).contiguous().transpose(0, 1)   # same shape, other strides
    with pytest.raises(ValueError, match="key_cache/value_cache"):
        paged_attention_decode(query, kc, vc_other_layout, bt, lens, 0.125)
    with pytest.raises(ValueError, match="key_cache/value_cache"):
        reshape_and_cache(query[:, :1], query[:, :1], kc, vc_other_layout, torch.tensor([0], device=device))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_splits"):
            paged_attention_decode(query, kc, vc, bt, lens, 0.125, num_splits=bad)


def test_reshape_and_cache_strided_key_and_value(device):
    """Keys and values sliced out of a fused projection (rows not contiguous, strides unequal) are written right."""
    gen = torch.Generator().manual_seed(4)
    fused = torch.randn(5, 6, 16, generator=gen).to(device)             # [tokens, q 2 + k 2 + v 2 heads, dim]
    key, value = fused[:, 2:4], fused[:, 4:6].transpose(0, 1).contiguous().transpose(0, 1)
    assert not key.is_contiguous() and key.stride() != value.stride()
    slots = torch.tensor([3, -1, 8, 0, 15], device=device)
    kc, vc = torch.zeros(2, 8, 2, 16, device=device), torch.zeros(2, 8, 2, 16, device=device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reshape_and_cache(key, value, kc, vc, slots)
    reshape_and_cache_reference(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_tiles_are_padded_for_tl_dot():
    """TILE_N: a power of two in [MIN_DOT, MAX_TILE_TOKENS], 64 keys for head_dim <= 128 and a K tile within
    TILE_ELEMENTS; the query group and head_dim pad to powers of two >= MIN_DOT (16), which tl.dot needs on a GPU
    (the interpreter would accept smaller tiles, so this is checked here)."""
    from tinypaged.kernels.paged_attention import MAX_TILE_TOKENS, MIN_DOT, TILE_ELEMENTS, _padded, _tile_tokens

    assert MIN_DOT == 16
    for head_dim in (8, 16, 32, 64, 128, 256, 512, 1024):
        dim_pad = _padded(head_dim)
        assert dim_pad == max(16, head_dim)
        tile = _tile_tokens(dim_pad)
        assert tile & (tile - 1) == 0 and MIN_DOT <= tile <= MAX_TILE_TOKENS
        assert tile * dim_pad <= TILE_ELEMENTS or tile == MIN_DOT
    assert [_tile_tokens(_padded(d)) for d in (64, 128, 256)] == [64, 64, 32]
    assert [_padded(g) for g in (1, 3, 4, 9, 16, 17)] == [16, 16, 16, 16, 16, 32]


def test_launcher_gives_the_kernel_tiles_of_at_least_16(device, monkeypatch):
    """What the launcher passes to the kernel, for shapes below 16 (1 query head per KV head, head_dim 8)."""
    from tinypaged.kernels import paged_attention as pa

    seen = []
    kernel = pa.paged_attention_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                seen.append(meta)
                return kernel[grid](*args, **meta)
            return launch

    monkeypatch.setattr(pa, "paged_attention_kernel", Spy())
    args = make_paged_batch([5, 19], 3, 3, 8, 4, torch.float32, device)
    assert_close(pa.paged_attention_decode(*args, 0.3, num_splits=2), paged_attention_reference(*args, 0.3),
                 torch.float32)
    (meta,) = seen
    assert (meta["QUERIES_PER_KV"], meta["GROUP_PAD"], meta["HEAD_DIM"], meta["DIM_PAD"]) == (1, 16, 8, 16)
    assert meta["TILE_N"] == 64


# Shapes under tl.dot's 16: head_dim 8, and 1..8 query heads per KV head (padded to 16 rows).
@pytest.mark.parametrize("group", range(1, 9))
def test_small_head_dim_and_groups_match_reference(group, device):
    dtype = torch.float64 if group % 4 == 0 else torch.float32   # fp64 for groups 4 and 8 (the exact engine tests)
    args = make_paged_batch([1, 13, 40], 2 * group, 2, 8, 8, dtype, device, seed=group)
    expected = paged_attention_reference(*args, 8 ** -0.5)
    for num_splits in (1, 3):
        assert_close(paged_attention_decode(*args, 8 ** -0.5, num_splits=num_splits), expected, dtype)


def test_the_graded_kernel_multiplies_with_tl_dot():
    """Stage 5 teaches the fast kernel: both reductions of a tile are tl.dot (tensor cores on a GPU), scores
    q @ k^T and values p @ v, with IEEE float32 products; the broadcast-and-sum form (tl.sum over a
    [GROUP_PAD, TILE_N, HEAD_DIM] product, 15% of a device copy on an H200) is gone. The package's kernel is
    the solution's graded cell (tests/test_one_engine.py), so this holds for both."""
    import ast
    import inspect

    from tinypaged.kernels import paged_attention as pa

    tree = ast.parse(inspect.getsource(pa))
    kernel = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "paged_attention_kernel")
    loop = next(n for n in ast.walk(kernel) if isinstance(n, ast.For))

    def calls(node, name):
        return [c for c in ast.walk(node) if isinstance(c, ast.Call) and ast.unparse(c.func) == name]

    dots = calls(loop, "tl.dot")
    assert [ast.unparse(c.args[1]) for c in dots] == ["tl.trans(k)", "v"], [ast.unparse(c) for c in dots]
    assert ast.unparse(dots[0].args[0]) == "q" and ast.unparse(dots[1].args[0]).startswith("p")
    for c in dots:
        assert {k.arg: ast.unparse(k.value) for k in c.keywords}.get("input_precision") == "'ieee'"
    for c in calls(kernel, "tl.sum"):   # only row sums of p remain: no reduction of a broadcast product
        assert not any(isinstance(n, ast.BinOp) for n in ast.walk(c.args[0])), ast.unparse(c)
    assert not any(three_d in ast.unparse(loop) for three_d in ("[None, :, :]", "[:, None, :]", "[:, :, None]"))


@pytest.mark.parametrize("module, kernel, check", [
    ("paged_attention", "paged_attention_kernel", "paged_attention"),
    ("paged_attention", "merge_splits_kernel", "merge_splits"),
    ("reshape_and_cache", "reshape_and_cache_kernel", "reshape_and_cache"),
])
def test_handing_in_the_packages_kernel_scores_nothing(module, kernel, check):
    """The package's kernels are the assignment's solution line for line: importing one into the kernel's cell is
    reuse that the grader counts against the check of the launcher that runs it."""
    from tinypaged.course import checks
    from tinypaged.course.grading.scan import scan_notebook

    found = [f for f in scan_notebook([(6, f"from tinypaged.kernels.{module} import {kernel}\n", True)])
             if f.kind == "reuse"]
    assert found and check in found[0].checks, found
    assert set(checks.get(check).targets) & set(found[0].binds), "the grader would not count this reuse"
