"""The element-wise operators of a decoder layer, one Triton kernel each (what ``tinypaged.model.llama`` calls
on a CUDA device).

In torch each of these is several kernels (a cast, a square, a mean, an rsqrt, two multiplies, ...), each
reading and writing the whole activation; inside a CUDA-graph decode step those reads cost more than the
layer's weights do. One kernel reads its inputs once, computes in float32 in registers, and writes once.

* :func:`add_rms_norm_kernel` - ``x [rows, hidden]`` (optionally ``x += residual`` first, written back into
  ``x``), then ``out = weight * rmsnorm(x)``. One program per row; ``BLOCK`` is ``hidden`` padded to a power of
  two, the padding masked out of the loads, the sum and the stores.
* :func:`rope_kernel` - ``x [tokens, all heads, head_dim]``, rotated in place on its first ``heads`` heads, with
  ``cos`` and ``signed_sin`` ``[tokens, head_dim]`` (``tinypaged.model.llama.rotate_``'s convention: the first
  half of ``signed_sin`` is ``-sin``). One program per token, over a ``[HEADS_PAD, HALF_PAD]`` tile: each head's
  first and second halves are loaded as two tiles, and ``out = x * cos + swap_halves(x) * signed_sin``.
* :func:`silu_mul_kernel` - ``gate_up [rows, 2 * inter]`` = ``[gate | up]`` -> ``silu(gate) * up [rows, inter]``.
  One program per (row, block of ``BLOCK`` columns): a decode step has only a few rows, and ``inter`` is wide
  (8192 for SmolLM2-1.7B), so splitting the columns keeps every streaming multiprocessor busy and the tile small.

Rounding: the maths is float32, and where the torch code rounds an intermediate result to the activation dtype
(the sum ``x + residual``, which is stored; the normalised row before the weight multiply, as Hugging Face's
RMSNorm does; ``x * cos`` before ``addcmul``; ``silu(gate)`` before the multiply) the kernels round it at the same
point, so half-precision results match the torch path to its last bit in most elements. For float32 those
roundings are no-ops.

The launchers only read shapes, strides and dtypes (never a tensor's values) and allocate outputs with
``torch.empty`` on the tensor's device, so they may run inside a CUDA-graph capture
(``tinypaged/worker/cuda_graphs.py``).
"""

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The activation dtypes the kernels accept (they compute in float32; float64 would lose precision)."""

SILU_BLOCK = 1024
"""Columns per ``silu_mul_kernel`` program (fewer when ``inter`` is narrower)."""


def _num_warps(block: int) -> int:
    """Warps for a tile of ``block`` elements: about 8 elements a thread, 1 to 16 warps."""
    return max(1, min(16, block // 256))


@triton.jit
def add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o,            # row strides; every row is contiguous
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row: ``x += residual`` (stored back into ``x``), then ``out = weight * x / rms(x)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as the stored sum is
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    h = x.to(tl.float32)
    mean_square = tl.sum(h * h, axis=0) / hidden  # padding loads 0: it adds nothing to the sum
    h = h * tl.rsqrt(mean_square + eps)
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)  # Hugging Face rounds to the input dtype before the weight
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    x_ptr, cos_ptr, sin_ptr,
    stride_xt, stride_xh,                    # x [tokens, all heads, head_dim], contiguous head_dim
    stride_ct, stride_st,                    # cos, signed_sin [tokens, head_dim], contiguous head_dim
    heads, half,
    HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    """One program per token: rotate its first ``heads`` heads in place. With ``x = [x1 | x2]`` per head, ``cos =
    [c1 | c2]`` and ``signed_sin = [s1 | s2]``: ``[x1 * c1 + x2 * s1 | x2 * c2 + x1 * s2]``."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    d_mask = d < half
    mask = (h < heads) & d_mask
    first = x_ptr + token * stride_xt + h * stride_xh + d
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    c = cos_ptr + token * stride_ct + d
    s = sin_ptr + token * stride_st + d
    c1 = tl.load(c, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(c + half, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(s, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(s + half, mask=d_mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    y1 = (x1 * c1).to(dtype).to(tl.float32) + x2 * s1  # the torch path rounds x * cos, then adds in float32
    y2 = (x2 * c2).to(dtype).to(tl.float32) + x1 * s2
    tl.store(first, y1.to(dtype), mask=mask)
    tl.store(first + half, y2.to(dtype), mask=mask)


@triton.jit
def silu_mul_kernel(
    gate_up_ptr, out_ptr,
    stride_g, stride_o,                      # row strides; every row is contiguous
    inter,
    BLOCK: tl.constexpr,
):
    """Program (row, j): columns ``[j * BLOCK, (j + 1) * BLOCK)`` of ``silu(gate) * up``, where ``gate`` is the
    row's first ``inter`` columns and ``up`` the next ``inter``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)  # the torch path rounds silu(gate) before the multiply
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(dtype), mask=mask)


def _check_activation(name: str, t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype}; the fused kernels take {', '.join(map(str, DTYPES))}")
    if t.dim() == 0 or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{name}: the fused kernels need rows with a contiguous last dimension "
                         f"(shape {tuple(t.shape)}, strides {t.stride()})")


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D view [rows, last dim], without copying (``x`` is written in place, so a copy would be
    wrong)."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as exc:
        raise ValueError(f"{name}: shape {tuple(t.shape)} with strides {t.stride()} cannot be seen as rows "
                         "without a copy") from exc


def add_rms_norm_triton(x: torch.Tensor, residual, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., hidden]`` times ``weight [hidden]``, as a new tensor; with ``residual`` (same shape)
    given, ``x += residual`` first, in place. The output's dtype is ``x``'s and ``weight``'s promoted (as
    ``weight * h`` in torch)."""
    _check_activation("x", x)
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight: shape {tuple(weight.shape)}, expected ({hidden},) for x of shape {tuple(x.shape)}")
    if weight.dtype not in DTYPES or weight.device != x.device:
        raise ValueError(f"weight: {weight.dtype} on {weight.device}; needs one of the fused kernels' dtypes, on "
                         f"x's device ({x.device})")
    weight = weight.contiguous()  # a parameter already is: no copy
    rows = _rows("x", x)
    if residual is not None:
        if residual.shape != x.shape or residual.device != x.device or residual.dtype not in DTYPES:
            raise ValueError(f"residual: shape {tuple(residual.shape)} {residual.dtype} on {residual.device}; "
                             f"expected x's shape {tuple(x.shape)} on {x.device}")
        residual = _rows("residual", residual if residual.stride(-1) == 1 else residual.contiguous())
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0] and hidden:
        block = triton.next_power_of_2(hidden)
        res = rows if residual is None else residual  # unused without a residual (HAS_RESIDUAL is a constexpr)
        add_rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, rows.stride(0), res.stride(0), out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
        )
    return out.view(x.shape)


def rope_triton_(x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """RoPE in place on the first ``heads`` heads of ``x [tokens, all heads, head_dim]``, with ``cos`` and
    ``signed_sin [tokens, head_dim]`` (``signed_sin``'s first half negated: see ``tinypaged.model.llama.rotate_``)."""
    _check_activation("x", x)
    if x.dim() != 3:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [tokens, heads, head_dim]")
    tokens, all_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim}: RoPE rotates pairs across the two halves of a head; it must be even")
    if not 0 <= heads <= all_heads:
        raise ValueError(f"heads={heads}: x has {all_heads} heads")
    for name, t in (("cos", cos), ("signed_sin", signed_sin)):
        if t.shape != (tokens, head_dim) or t.device != x.device:
            raise ValueError(f"{name}: shape {tuple(t.shape)} on {t.device}, expected ({tokens}, {head_dim}) on "
                             f"{x.device}")
        _check_activation(name, t)
    if tokens == 0 or heads == 0 or head_dim == 0:
        return
    half = head_dim // 2
    heads_pad, half_pad = triton.next_power_of_2(heads), triton.next_power_of_2(half)
    rope_kernel[(tokens,)](
        x, cos, signed_sin, x.stride(0), x.stride(1), cos.stride(0), signed_sin.stride(0), heads, half,
        HEADS_PAD=heads_pad, HALF_PAD=half_pad, num_warps=_num_warps(heads_pad * half_pad),
    )


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [..., 2 * inter]`` = ``[gate | up]``, as a new ``[..., inter]`` tensor."""
    _check_activation("gate_up", gate_up)
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up: last dimension {width} is not [gate | up] (it must be even)")
    inter = width // 2
    rows = _rows("gate_up", gate_up)
    out = torch.empty((rows.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and inter:
        block = min(triton.next_power_of_2(inter), SILU_BLOCK)
        silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, out, rows.stride(0), out.stride(0), inter, BLOCK=block, num_warps=_num_warps(block),
        )
    return out.view(*gate_up.shape[:-1], inter)
