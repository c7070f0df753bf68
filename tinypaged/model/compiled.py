"""A compiled forward (knob ``enforce_eager=False``): the fast path's maths, with the small element-wise ops fused.

A decode step of SmolLM2-135M on a CPU is some 1,100 small operators: per layer a norm, a residual add, RoPE,
SiLU-and-multiply, each a handful of kernels and each paid for in Python dispatch. vLLM compiles its model
(``torch.compile``, inductor) and cuts the graph at attention ("piecewise" graphs): attention reads the paged
cache with a step-dependent layout, everything around it is dense and the same every step. This module does the
same by hand, in two pieces per layer, each compiled once and shared by all layers (a layer's weights are inputs):

* ``before_attention``: residual add + RMSNorm (vLLM's fused add-norm), the fused [q; k; v] GEMM, RoPE;
* ``after_attention``: the o_proj GEMM, residual add + RMSNorm, the [gate; up] GEMM, SiLU-and-multiply, down_proj.

The token dimension is dynamic: one graph per piece for every batch size, decodes and prefills alike (torch's
specialisation of a size-1 batch is turned off); a new model shape or dtype compiles anew. Attention stays eager and goes through the step's ``ForwardContext``
as on the other paths. The first step pays the compile (seconds to a minute on a loaded 2-core machine; the
benchmark reports it apart as warm-up); inductor's FX graph cache keeps the result across processes (torch's
default ``/tmp/torchinductor_$USER``, or ``TORCHINDUCTOR_CACHE_DIR`` if set before start): a second engine, in this process
or a later one, compiles in a fraction of the first one's time.

The GEMMs are the same ``linear`` calls as the eager fast path (oneDNN in float32 on a CPU, called as a custom
operator from the graph), so any gain is in the element-wise work and the Python around it. Measured on the
project's loaded 2-core machine (SmolLM2-135M, 16 requests, max_num_seqs 16, 1 thread, the two paths alternated in
one process): no gain, 62 against 71 output tokens per CPU-second for the eager fast path (the GEMMs are some 90% of
a layer's dense time; each compiled call pays a guard check and the custom operator's dispatch). It stays an option,
tested equal to the reference (``tests/test_compiled.py``), for a model or machine where the element-wise share is
larger; ``enforce_eager=True`` (eager) is the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinypaged.model import fused
from tinypaged.model.llama import apply_rope, rms_norm


@torch.library.custom_op("tinypaged::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``fused.linear`` as an opaque operator inside the compiled graph (inductor cannot lower oneDNN's
    linear with a symbolic row count; as a custom operator it calls it as it is)."""
    return fused.linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _one_graph_for_all_sizes():
    """Compile for a symbolic token count without torch's specialisation of size 1 and without "duck sizing"
    (which would tie the token count to a head count that happens to equal it on the first call)."""
    return torch.fx.experimental._config.patch(use_duck_shape=False, backed_size_oblivious=True)


def before_attention(hidden, residual, norm_w, eps: float, qkv_w, qkv_b, cos, sin, heads: int, kv_heads: int):
    """(q, k, v, residual): the residual stream so far, normed, projected, rotated."""
    residual = hidden + residual
    x = rms_norm(residual, norm_w, eps)
    n, d = x.shape[0], cos.shape[-1]
    qkv = linear(x, qkv_w, qkv_b).view(n, heads + 2 * kv_heads, d)
    qk = apply_rope(qkv[:, : heads + kv_heads], cos, sin)
    return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:], residual


def after_attention(attn, residual, o_w, o_b, norm_w, eps: float, gate_up_w, down_w):
    """(mlp output, residual): o_proj onto the residual stream, then the MLP on its norm."""
    residual = residual + linear(attn, o_w, o_b)
    x = rms_norm(residual, norm_w, eps)
    gate, up = linear(x, gate_up_w).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down_w), residual


_PIECES = []


def compiled_pieces():
    """The two compiled pieces, made once per process: every engine (and every layer) shares their graphs, so a
    second engine in the same process compiles nothing."""
    if not _PIECES:
        _PIECES.extend(torch.compile(f, dynamic=True, fullgraph=True) for f in (before_attention, after_attention))
    return tuple(_PIECES)


class CompiledForward:
    """``CausalLM.forward`` with its dense pieces compiled (set as ``model.compiled`` by ``compile_model``)."""

    def __init__(self, model):
        for layer in model.model.layers:
            if layer.self_attn.qkv_proj is None or layer.mlp.gate_up_proj is None:
                raise ValueError("enforce_eager=False compiles the fast path's fused projections: it needs "
                                 "fast_path=True")
        self.model = model
        self.before, self.after = compiled_pieces()
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((a.layer_idx, layer.input_layernorm, a.qkv_proj, a.o_proj, a.scale, a.num_heads,
                                a.num_kv_heads, layer.post_attention_layernorm, m.gate_up_proj, m.down_proj))

    def __call__(self, input_ids, positions, ctx, logits_indices=None) -> torch.Tensor:
        stack = self.model.model
        x = stack.embed_tokens(input_ids)
        cos, sin = stack.rotary(positions, x.dtype)
        residual = torch.zeros_like(x)  # always a tensor: one graph for every layer
        with _one_graph_for_all_sizes():
            for idx, norm1, qkv, o, scale, heads, kv_heads, norm2, gate_up, down in self.layers:
                q, k, v, residual = self.before(x, residual, norm1.weight, norm1.eps, qkv.weight, qkv.bias, cos,
                                                sin, heads, kv_heads)
                out = ctx.attend(idx, q, k, v, scale)
                x, residual = self.after(out.reshape(out.shape[0], -1), residual, o.weight, o.bias, norm2.weight,
                                         norm2.eps, gate_up.weight, down.weight)
        x = x + residual
        if logits_indices is not None:
            x = x[logits_indices]
        return self.model.lm_head(stack.norm(x))


def compile_model(model) -> CompiledForward:
    """Route ``model``'s forward through ``CompiledForward`` (idempotent); compiling happens on first use."""
    if getattr(model, "compiled", None) is None:
        model.compiled = CompiledForward(model)
    return model.compiled
