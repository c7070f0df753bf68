"""The fused element-wise Triton kernels (kernels/fused_elementwise.py) against the torch maths they replace.

Without CUDA they run in Triton's interpreter (``import tinypaged`` switches it on first: tinypaged/triton_mode.py),
so the shapes are small. The references are ``tinypaged.model.llama``'s torch branches, written out here. The
model calls the kernels only for CUDA tensors: the last tests check that gate, and that it hands each function's
arguments to its launcher unchanged.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import tinypaged  # noqa: F401  (first: sets TRITON_INTERPRET before triton is imported)
from tinypaged import triton_mode
from tinypaged.model import llama

pytestmark = pytest.mark.skipif(not triton_mode.AVAILABLE, reason=triton_mode.WHY_UNAVAILABLE)

if triton_mode.AVAILABLE:
    from tinypaged.kernels import add_rms_norm_triton, rope_triton_, silu_mul_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol): the kernels round where the torch code rounds, so they differ only in float32 summation order
# and libm, which can flip a rounded intermediate by one unit in the last place (bfloat16: 2**-8 to 2**-7
# relative), and the multiply after it by another: two units.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
if triton_mode.INTERPRETED:
    # Triton's interpreter (3.x) casts float32 to bfloat16 by truncating the mantissa, where a GPU (and torch)
    # rounds to nearest even: each rounded bfloat16 intermediate may be off by one more unit here.
    TOLERANCES[torch.bfloat16] = (3.2e-2, 3.2e-2)


def close(actual, expected):
    atol, rtol = TOLERANCES[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def same_sum(actual, expected):
    """``x += residual`` in the kernel equals torch's: exactly, but for one unit of bfloat16 in the interpreter."""
    if triton_mode.INTERPRETED and expected.dtype == torch.bfloat16:
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=2**-7)
    else:
        assert torch.equal(actual, expected)


# -- the references: llama.py's torch branches --------------------------------------------------------------------

def add_rms_norm_reference(x, residual, weight, eps):
    if residual is not None:
        x.add_(residual)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return llama.rms_norm(x, weight, eps)


def rotate_reference_(x, heads, cos, signed_sin):
    part = x[:, :heads]
    part.copy_(torch.addcmul(part * cos[:, None], part.roll(x.shape[-1] // 2, dims=-1), signed_sin[:, None]))


def silu_mul_reference(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def cos_sin(tokens, head_dim, dtype, start=3):
    """What ``llama.RotaryEmbedding`` makes, for positions start .. start + tokens - 1."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(start, start + tokens, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    return torch.cat((cos, cos), dim=-1).to(DEVICE), torch.cat((-sin, sin), dim=-1).to(DEVICE)


# -- add + RMSNorm --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 960])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("with_residual", [False, True], ids=["no-residual", "residual"])
def test_add_rms_norm(dtype, hidden, tokens, with_residual):
    g = torch.Generator().manual_seed(hidden * 10 + tokens)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    x_ref = x.clone()
    expected = add_rms_norm_reference(x_ref, residual, weight, 1e-5)
    out = add_rms_norm_triton(x, residual, weight, 1e-5)
    close(out, expected)
    same_sum(x, x_ref)  # x += residual happened in place (and x is untouched without a residual)
    assert out.data_ptr() != x.data_ptr()


def test_add_rms_norm_keeps_to_its_rows():
    """x a view with a row stride wider than hidden: the columns past hidden are neither read nor written."""
    buffer = torch.full((5, 100), 7.0, device=DEVICE)
    x = buffer[:, :96]
    x.copy_(torch.randn(5, 96, generator=torch.Generator().manual_seed(1)))
    residual = torch.ones(5, 96, device=DEVICE)
    weight = torch.rand(96, device=DEVICE)
    x_ref = x.clone()
    expected = add_rms_norm_reference(x_ref, residual, weight, 1e-6)
    close(add_rms_norm_triton(x, residual, weight, 1e-6), expected)
    torch.testing.assert_close(x, x_ref)
    assert (buffer[:, 96:] == 7.0).all()


def test_add_rms_norm_of_a_three_dimensional_x():
    x = torch.randn(2, 3, 64, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.rand(64, device=DEVICE, dtype=torch.bfloat16)
    close(add_rms_norm_triton(x, None, weight, 1e-5), add_rms_norm_reference(x.clone(), None, weight, 1e-5))


# -- RoPE -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80])  # 80: half a head (40) is not a power of two
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 1), (4, 2)])
def test_rope(dtype, head_dim, tokens, num_heads, num_kv_heads):
    """As the model calls it: a [q | k | v] tensor, rotated on its query and key heads only."""
    all_heads, heads = num_heads + 2 * num_kv_heads, num_heads + num_kv_heads
    g = torch.Generator().manual_seed(head_dim + tokens + heads)
    x = torch.randn(tokens, all_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    cos, signed_sin = cos_sin(tokens, head_dim, dtype)
    x_ref = x.clone()
    rotate_reference_(x_ref, heads, cos, signed_sin)
    values = x[:, heads:].clone()
    rope_triton_(x, heads, cos, signed_sin)
    close(x, x_ref)
    assert torch.equal(x[:, heads:], values)  # the value heads are not touched


def test_rope_on_every_head_and_on_none():
    x = torch.randn(3, 5, 32, device=DEVICE)
    cos, signed_sin = cos_sin(3, 32, torch.float32)
    x_ref = x.clone()
    rotate_reference_(x_ref, 5, cos, signed_sin)
    rope_triton_(x, 5, cos, signed_sin)
    close(x, x_ref)
    before = x.clone()
    rope_triton_(x, 0, cos, signed_sin)
    assert torch.equal(x, before)


# -- SiLU and multiply ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [64, 576, 960, 1536])  # 1536: two column blocks, the second half masked
@pytest.mark.parametrize("tokens", [1, 7])
def test_silu_mul(dtype, inter, tokens):
    g = torch.Generator().manual_seed(inter + tokens)
    gate_up = (torch.randn(tokens, 2 * inter, generator=g) * 4).to(dtype).to(DEVICE)
    before = gate_up.clone()
    out = silu_mul_triton(gate_up)
    close(out, silu_mul_reference(gate_up))
    assert torch.equal(gate_up, before)


# -- the launchers name what they cannot take -----------------------------------------------------------------------

def test_the_launchers_reject_what_the_kernels_cannot_take():
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm_triton(x, None, torch.ones(32, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_triton(x, torch.ones(2, 32, device=DEVICE), torch.ones(64, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        add_rms_norm_triton(x.double(), None, torch.ones(64, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm_triton(x.t(), None, torch.ones(2, device=DEVICE), 1e-5)
    cos, signed_sin = cos_sin(2, 6, torch.float32)
    with pytest.raises(ValueError, match="head_dim=5"):
        rope_triton_(torch.randn(2, 3, 5, device=DEVICE), 2, cos[:, :5], signed_sin[:, :5])
    with pytest.raises(ValueError, match="heads=4"):
        rope_triton_(torch.randn(2, 3, 6, device=DEVICE), 4, cos, signed_sin)
    with pytest.raises(ValueError, match="cos"):
        rope_triton_(torch.randn(3, 3, 6, device=DEVICE), 2, cos, signed_sin)
    with pytest.raises(ValueError, match="even"):
        silu_mul_triton(torch.randn(2, 7, device=DEVICE))


# -- the model's dispatch -------------------------------------------------------------------------------------------

def test_the_model_keeps_cpu_tensors_off_the_triton_kernels(monkeypatch):
    """On a CPU every function takes its C++ (float32) or torch (half precision) path, never a launcher."""
    import tinypaged.kernels

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton launcher was called for a CPU tensor")

    for name in ("add_rms_norm_triton", "rope_triton_", "silu_mul_triton"):
        monkeypatch.setattr(tinypaged.kernels, name, refuse)
    for dtype in DTYPES:
        x = torch.randn(3, 64, dtype=dtype)
        assert llama.fused_kernels(x) is None
        residual, weight = torch.randn(3, 64, dtype=dtype), torch.rand(64, dtype=dtype)
        x_ref = x.clone()
        close(llama.add_rms_norm(x, residual, weight, 1e-5), add_rms_norm_reference(x_ref, residual, weight, 1e-5))
        torch.testing.assert_close(x, x_ref)
        qkv = torch.randn(3, 4, 32, dtype=dtype)
        cos, signed_sin = cos_sin(3, 32, dtype)
        qkv_ref = qkv.clone()
        llama.rotate_(qkv, 3, cos.cpu(), signed_sin.cpu())
        rotate_reference_(qkv_ref, 3, cos.cpu(), signed_sin.cpu())
        close(qkv, qkv_ref)
        gate_up = torch.randn(3, 128, dtype=dtype)
        close(llama.silu_mul(gate_up), silu_mul_reference(gate_up))


def test_the_gate_reads_device_dtype_and_triton(monkeypatch):
    meta = torch.empty(2, 8, device="meta")  # not CUDA: no kernels, whatever the dtype
    assert llama.fused_kernels(meta) is None
    if torch.cuda.is_available():
        import tinypaged.kernels

        assert llama.fused_kernels(torch.empty(2, 8, device="cuda", dtype=torch.bfloat16)) is tinypaged.kernels
        assert llama.fused_kernels(torch.empty(2, 8, device="cuda", dtype=torch.float64)) is None
        monkeypatch.setattr(triton_mode, "AVAILABLE", False)
        assert llama.fused_kernels(torch.empty(2, 8, device="cuda", dtype=torch.bfloat16)) is None


def test_where_the_gate_opens_each_function_is_one_launcher_call(monkeypatch):
    """With the gate open (as for a CUDA tensor), the three functions hand their arguments to the launchers and
    return what they return: nothing of the torch path runs."""
    calls = []
    fake = types.SimpleNamespace(
        add_rms_norm_triton=lambda *a: calls.append(("norm", a)) or "normed",
        rope_triton_=lambda *a: calls.append(("rope", a)),
        silu_mul_triton=lambda *a: calls.append(("silu", a)) or "silu",
    )
    monkeypatch.setattr(llama, "fused_kernels", lambda t: fake)
    x, residual, weight = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8, dtype=torch.bfloat16), object()
    before = x.clone()
    assert llama.add_rms_norm(x, residual, weight, 1e-6) == "normed"
    assert torch.equal(x, before)  # the torch path (x += residual) did not run
    qkv, cos, sin = torch.randn(2, 3, 4, dtype=torch.bfloat16), object(), object()
    assert llama.rotate_(qkv, 2, cos, sin) is None
    gate_up = torch.randn(2, 8, dtype=torch.bfloat16)
    assert llama.silu_mul(gate_up) == "silu"
    assert [c[0] for c in calls] == ["norm", "rope", "silu"]
    assert calls[0][1] == (x, residual, weight, 1e-6)
    assert calls[1][1] == (qkv, 2, cos, sin)
    assert calls[2][1] == (gate_up,)


def test_a_layer_with_the_kernels_equals_the_torch_layer(monkeypatch):
    """A bfloat16 decoder layer (attention stubbed out) through the kernels, interpreted on the CPU, against the
    same layer through the torch path."""
    config = types.SimpleNamespace(hidden_size=96, intermediate_size=160, num_attention_heads=3,
                                   num_key_value_heads=1, rms_norm_eps=1e-5, model_type="llama",
                                   attention_bias=False, head_dim=32)
    torch.manual_seed(0)
    layer = llama.DecoderLayer(config, 0).to(torch.bfloat16)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    ctx = types.SimpleNamespace(attend=lambda idx, q, k, v, scale: (q + k.repeat(1, 3, 1) + v.repeat(1, 3, 1)))
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    pending = torch.randn(4, 96, dtype=torch.bfloat16)
    cos, signed_sin = cos_sin(4, 32, torch.bfloat16)
    x_ref = x.clone()
    expected = layer(x_ref, pending, cos.cpu(), signed_sin.cpu(), ctx)
    import tinypaged.kernels

    monkeypatch.setattr(llama, "fused_kernels", lambda t: tinypaged.kernels)
    out = layer(x, pending, cos.cpu(), signed_sin.cpu(), ctx)
    close(out, expected)
    close(x, x_ref)
