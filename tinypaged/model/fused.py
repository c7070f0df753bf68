"""The engine's fast path (course-only knob ``fast_path``, on by default): the same maths, fewer kernels.

Five changes against the readable reference of lessons 1-3, each what vLLM does in its own way:

* **fused projections**: q, k and v read the same input, and so do gate and up; stacking their weights
  makes one GEMM of each group (vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``): four
  calls per layer instead of seven (a small gain on a CPU, where a decode step's few rows make each
  GEMM cost what reading its weights costs);
* **fused attention**: an unset ``attention_backend`` becomes ``"sdpa"``
  (``tinypaged.attention.sdpa.SDPABackend``), which gathers each sequence's keys once and hands them to
  ``torch.nn.functional.scaled_dot_product_attention`` (one kernel, no [B, H, C] score tensor kept
  around) instead of ``attend_gathered``'s chain of permutes, matmuls and masks (``"torch"``, the reference);
* **oneDNN GEMMs on prepacked weights** (float32 on a CPU): every projection calls oneDNN's linear on a copy of
  its weight reordered once into oneDNN's blocked layout for 32-row batches (``PackedWeight``), as vLLM's CPU
  backend does (``create_onednn_mm(weight, 32)``). A decode step reads every weight once, so a step costs what
  streaming the weights costs: the blocked copy streams at about 1.6x the plain weight's rate (measured on the
  project's 2-core machine at 16 rows: 7.3 against 12.4 ms for the 30 [gate; up] weights), and the plain call is
  itself about twice the default BLAS call. oneDNN builds one primitive per new row count and shape (well under
  a millisecond, then cached), so the first steps of each batch size pay a little once. Below 4 rows (a lone
  request, the last ones of a batch) on an Intel CPU the order turns: MKL's matrix-vector kernels stream the plain
  weight faster than oneDNN streams its blocked copy, so ``linear`` sends those products there (a course-only
  choice: vLLM's CPU backend calls oneDNN at every row count). On other CPUs MKL takes slower code paths and
  oneDNN wins at every row count (``GEMV_ROWS`` is 0 there).
* **one flat loop** (``FlatForward``): the layers run as plain tensor calls, not through the module tree (vLLM
  compiles its forward into one graph; here a compiled whole forward measured no faster than this loop).
* **C++ operators on a float32 CPU** (``tinypaged.cpu_native``, where this machine can build them): the residual
  add fused into the RMSNorm after it, RoPE in place, SiLU-and-multiply, and decode attention reading the cache in
  place (``SDPABackend.decode``), each one call instead of a handful of torch operators, as vLLM's CPU backend
  runs its own C++ for that work. Elsewhere the same loop runs on torch's operators.

``fast_path=False`` runs the reference path; tests/test_fast_path.py checks both give the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinypaged import cpu_native


class FusedLinear:
    """One or more ``nn.Linear`` layers over one input, as one GEMM on their weights stacked by output row.

    Invariant: each layer's weight (and bias) is a view into the stacked tensor, so loading a
    ``state_dict`` into the layers, or reading ``q_proj.weight``, sees the very numbers the GEMM uses.
    Not an ``nn.Module``, so the model's ``state_dict`` keeps Hugging Face's names. Fuse after the model
    has its final device and dtype (``.to()`` copies each parameter on its own, ending the views).
    """

    def __init__(self, layers: list[nn.Linear]):
        has_bias = layers[0].bias is not None
        self.weight = torch.cat([layer.weight.detach() for layer in layers])
        self.bias = torch.cat([layer.bias.detach() for layer in layers]) if has_bias else None
        self.packed = PackedWeight()
        start = 0
        for layer in layers:
            size = layer.out_features
            layer.weight = nn.Parameter(self.weight[start:start + size], requires_grad=False)
            if has_bias:
                layer.bias = nn.Parameter(self.bias[start:start + size], requires_grad=False)
            start += size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


PACK_ROWS = 32  # the batch size oneDNN's blocked layout is chosen for (vLLM's CPU backend passes 32 too)


class PackedWeight:
    """oneDNN's blocked copy of one float32 weight, made on first use and made again whenever the weight changes.

    Invariant: the copy holds the numbers the plain weight holds now. Checked at each call, cheaply: the copy is
    keyed by the weight's storage and version counter, which every in-place write (``load_state_dict``,
    ``copy_``, ``mul_``), on the weight or on a view of it, moves on; assigning a new tensor changes the storage.
    The plain weight stays where it is (lessons read ``q_proj.weight``); the copy costs as much memory again.
    """

    def __init__(self):
        self.key, self.tensor = None, None

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self.key:
            self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.key = key
        return self.tensor


def mkl_on_intel() -> bool:
    """Whether torch's BLAS is MKL and this CPU is an Intel one: where MKL's matrix-vector kernels are tuned."""
    import platform
    import sys

    if not torch.backends.mkl.is_available() or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if sys.platform == "darwin":
        return True  # every x86 Mac has an Intel CPU
    if sys.platform == "win32":
        return "GenuineIntel" in platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


# up to this many rows, a float32 CPU product goes to the default BLAS call (see ``linear``): MKL's matrix-vector
# kernels on an Intel CPU; elsewhere none (oneDNN at every row count)
GEMV_ROWS = 3 if mkl_on_intel() else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """``F.linear`` (x @ weight.T + bias); float32 on a CPU with more than ``GEMV_ROWS`` rows goes to oneDNN's
    GEMM (what vLLM's CPU backend and inductor's CPU linears call), which computes a decode step's products in
    well under the CPU time of the default BLAS call from 4 rows up, on ``packed``'s blocked copy of the weight
    when one is given. At 1 to 3 rows (the last requests of a batch, a lone chat) on an Intel CPU, MKL's
    matrix-vector kernels stream the plain weight faster: a SmolLM2 step's 121 products took 21.6 / 23.2 ms that
    way against 29.6 / 30.0 ms through oneDNN's blocked copy at 1 / 2 rows (stop 38's machine, whose CPU model
    was not recorded; MKL's speed there points to an Intel part). On an AMD EPYC (2026-12-02, 18:30 UTC) the
    same call took 47.6-52.1 / 83.7-100.7 / 104.3-124.8 ms at 1 / 2 / 3 rows against oneDNN's 25.8-35.0 /
    28.2-37.0 / 28.3-42.8 ms: MKL runs slower code paths on other vendors' CPUs, so ``GEMV_ROWS`` is 0 there.
    Other dtypes (oneDNN takes no float64) and devices: ``F.linear``."""
    if ONEDNN and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] > GEMV_ROWS:
        if packed is not None and weight.dtype == torch.float32:
            weight = packed.of(weight)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class SingleLinear:
    """An ``nn.Linear``'s forward through ``linear`` (its own weight tensor, read at each call)."""

    def __init__(self, layer: nn.Linear):
        self.layer = layer
        self.packed = PackedWeight()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.layer.weight, self.layer.bias, self.packed)


def fuse_projections(model) -> None:
    """Give every layer its fused [q; k; v] and [gate; up] projections; o_proj, down_proj and lm_head are single
    GEMMs already and keep their weights, their forward goes through ``linear`` (oneDNN on a CPU); the model's
    forward becomes ``FlatForward``. Idempotent."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None:
            attn.qkv_proj = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
        if mlp.gate_up_proj is None:
            mlp.gate_up_proj = FusedLinear([mlp.gate_proj, mlp.up_proj])
        for single in (attn.o_proj, mlp.down_proj):
            if not isinstance(single.forward, SingleLinear):
                single.forward = SingleLinear(single)
    if not isinstance(model.lm_head.forward, SingleLinear):
        model.lm_head.forward = SingleLinear(model.lm_head)
    if model.fast_forward is None:
        model.fast_forward = FlatForward(model)


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """``RMSNorm.forward`` (tinypaged.model.llama) as a plain call; float32 runs torch's one-kernel ``rms_norm``,
    other dtypes the module's own steps (half precision normalised in float32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
    return norm.forward(x)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's cos and sin [tokens, head_dim] shaped for ``rope``: [tokens, 1, head_dim], the sine's first half
    negated, made once per step for all layers."""
    half = sin.shape[-1] // 2
    return cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` in three kernels: the halves swapped by one ``roll`` stand in for ``cat(-x2, x1)``, the
    sign lives in ``signed_sin`` (``rope_tables``): x * cos + roll(x) * signed_sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class FlatForward:
    """``CausalLM.forward`` on the fast path: the same maths as one flat loop over the layers, no module calls.

    A decode step of a small model on a CPU pays for Python as much as for the element-wise maths: the module
    tree (layer -> attention -> projection, norm, MLP) is some 7 ``nn.Module`` calls per layer, each a few
    microseconds of hooks and dispatch, before any kernel runs. This loop reads each layer's parts where the
    model keeps them (norm weights, ``FusedLinear``/``SingleLinear`` projections, ``ctx.attend``), so a weight
    loaded or changed in place is what the next step uses, and the attention backend, a learner's included, is
    called as on the reference path. RoPE's cos/sin are shaped once per step (``rope_tables``); residual adds
    and SiLU-times-up write in place into tensors the step made. ``fast_path=False`` keeps the module forward
    that lessons 1-3 read; tests/test_fast_path.py checks both give the same numbers (float64: to 1e-10).
    """

    def __init__(self, model):
        self.model = model
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            # o_proj's and down_proj's SingleLinear (their ``forward``): the module's own __call__ is skipped
            self.layers.append((attn.layer_idx, layer.input_layernorm, attn.qkv_proj, attn.o_proj.forward, attn.scale,
                                attn.num_heads, attn.num_kv_heads, attn.head_dim, layer.post_attention_layernorm,
                                mlp.gate_up_proj, mlp.down_proj.forward))

    def __call__(self, input_ids, positions, ctx, logits_indices=None) -> torch.Tensor:
        stack = self.model.model
        x = stack.embed_tokens(input_ids)
        cos, signed_sin = rope_tables(*stack.rotary(positions, x.dtype))
        native = cpu_native.usable(x)
        if native is not None:
            return self.native(native, x, cos, signed_sin, ctx, logits_indices)
        n = x.shape[0]
        for idx, norm1, qkv_proj, o_proj, scale, heads, kv_heads, head_dim, norm2, gate_up_proj, down_proj in self.layers:
            qkv = qkv_proj(rms_norm(x, norm1)).view(n, heads + 2 * kv_heads, head_dim)
            qk = rope(qkv[:, : heads + kv_heads], cos, signed_sin)
            out = ctx.attend(idx, qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:], scale)
            x = x + o_proj(out.reshape(n, heads * head_dim))  # a new tensor: the embedding's rows stay as they are
            gate, up = gate_up_proj(rms_norm(x, norm2)).chunk(2, dim=-1)
            x += down_proj(F.silu(gate).mul_(up))
        if logits_indices is not None:
            x = x[logits_indices]
        return self.model.lm_head.forward(rms_norm(x, stack.norm))

    def native(self, ops, x, cos, signed_sin, ctx, logits_indices) -> torch.Tensor:
        """The same loop on a float32 CPU with tinypaged's C++ operators (``tinypaged.cpu_native``): each residual
        add is fused into the RMSNorm after it and runs in place on ``x`` (the embedding lookup's own new tensor),
        RoPE runs in place on the fused qkv, SiLU-and-multiply is one call. Attention always goes through
        ``ctx.attend`` and the step's backend (``SDPABackend.decode`` calls the C++ decode attention)."""
        stack = self.model.model
        n = x.shape[0]
        cos, signed_sin = cos.view(n, -1), signed_sin.view(n, -1)
        residual = None  # the last product not yet added to x
        for idx, norm1, qkv_proj, o_proj, scale, heads, kv_heads, head_dim, norm2, gate_up_proj, down_proj in self.layers:
            qkv = qkv_proj(ops.add_rms_norm(x, residual, norm1.weight, norm1.eps)).view(n, heads + 2 * kv_heads, head_dim)
            ops.rope_(qkv, cos, signed_sin, heads + kv_heads)
            out = ctx.attend(idx, qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:], scale)
            h = ops.add_rms_norm(x, o_proj(out.reshape(n, heads * head_dim)), norm2.weight, norm2.eps)
            residual = down_proj(ops.silu_mul(gate_up_proj(h)))
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        return self.model.lm_head.forward(ops.add_rms_norm(x, residual, stack.norm.weight, stack.norm.eps))


WARM_ROWS = PACK_ROWS  # warm_up builds oneDNN's primitives for decode batches of 1 to this many rows


def warm_up(model, max_rows: int) -> int:
    """Pay the fast path's one-off costs now rather than in the first requests (vLLM's server warms its model at
    start-up): pack every projection's weight for oneDNN, and run one product of each weight shape for every
    decode batch size 1..min(``max_rows``, ``WARM_ROWS``), so oneDNN has built the primitives those steps use.
    Larger batches are not warmed: a new row count costs oneDNN 1-3 ms once per shape, little beside such a
    product, while warming every count up to the default ``max_num_seqs`` (256) ran 1,280 products, most of the
    time in the [49152, 576] lm_head: 21 s on 2 threads, 38 s on 1, before the server said it was ready (1.0 s
    for 32 rows; measured on an AMD EPYC, 2026-12-02). Changes no weight, cache or counter. Returns the number
    of products run (0 where the fast path's oneDNN GEMMs do not apply)."""
    projections = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None or mlp.gate_up_proj is None:
            return 0  # the reference path: nothing packed
        projections += [attn.qkv_proj, mlp.gate_up_proj, attn.o_proj.forward, mlp.down_proj.forward]
    projections.append(model.lm_head.forward)
    projections = [(p.weight, p.bias, p.packed) if isinstance(p, FusedLinear) else (p.layer.weight, p.layer.bias, p.packed)
                   for p in projections]
    first = projections[0][0]
    if not (ONEDNN and first.dtype == torch.float32 and first.device.type == "cpu"):
        return 0
    one_per_shape = {}
    with torch.inference_mode():
        for weight, bias, packed in projections:
            packed.of(weight)
            one_per_shape.setdefault((tuple(weight.shape), bias is not None), (weight, bias, packed))
        for weight, bias, packed in one_per_shape.values():
            for rows in range(1, min(max_rows, WARM_ROWS) + 1):
                linear(torch.zeros(rows, weight.shape[1], dtype=weight.dtype), weight, bias, packed)
    return len(one_per_shape) * min(max_rows, WARM_ROWS)
