"""A small, readable Llama-family decoder (Llama, SmolLM2, Qwen2) whose attention is pluggable.

Parameter names follow Hugging Face's checkpoints, so a ``state_dict`` loads as it is.
The model never owns a KV cache: each attention layer receives a ``ForwardContext`` that says
where this step's keys and values go and where every sequence's earlier ones live. That
context is what changes from stage to stage (contiguous arena, block table, Triton kernel).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
import torch.nn.functional as F

from tinypaged import cpu_native, triton_mode
from tinypaged.model import fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's maths. Half precision is normalised in float32 (as Hugging Face does); float32/64 stay as they are."""
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    h = x.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


# -- the three element-wise operators of a layer, each one call --------------------------------------------------
# Each is the maths in torch, or one C++ call where tinypaged's CPU operators apply (float32 on a CPU where they
# were built: tinypaged/cpu_native.py), or one Triton kernel on a CUDA device (kernels/fused_elementwise.py), as
# vLLM's layers call its own kernels (fused_add_rms_norm, rotary_embedding, silu_and_mul). Same numbers within
# rounding (tests/test_cpu_native.py, tests/test_fused_elementwise.py).

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the fused kernels take (float32 maths)


@functools.cache
def _kernels():
    """``tinypaged.kernels``, imported on first use, so that a CPU run never imports Triton (pyproject.toml's
    import-linter contract names this import: the graph reads it as one of the package's top, as the attention
    backends' import of the kernels)."""
    import tinypaged.kernels

    return tinypaged.kernels


def fused_kernels(t: torch.Tensor):
    """``tinypaged.kernels`` when its fused Triton kernels apply to ``t`` (a CUDA tensor of a dtype they take, with
    Triton installed), else None. Reads only the tensor's device and dtype (never its values): safe while a CUDA
    graph is being captured."""
    if not t.is_cuda or not triton_mode.AVAILABLE or t.dtype not in _TRITON_DTYPES:
        return None
    return _kernels()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x``; with ``residual`` given, ``x += residual`` first, in place (vLLM's fused add-norm: the
    residual stream ``x`` is updated and normalised in one pass)."""
    native = cpu_native.usable(x)
    if native is not None:
        return native.add_rms_norm(x, residual, weight, eps)
    kernels = fused_kernels(x)
    if kernels is not None:
        return kernels.add_rms_norm_triton(x, residual, weight, eps)
    if residual is not None:
        x.add_(residual)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one torch kernel, the same maths
    return rms_norm(x, weight, eps)


def rotate_(x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """RoPE in place on the first ``heads`` heads of ``x`` [tokens, all heads, head_dim] (Hugging Face's
    convention: each head's two halves rotate as pairs). ``cos`` and ``signed_sin`` [tokens, head_dim] come from
    ``RotaryEmbedding``; ``signed_sin``'s first half is negated, so that swapping the halves (a roll by half a
    head) and multiplying gives HF's ``cat(-x2, x1) * sin``."""
    native = cpu_native.usable(x)
    if native is not None:
        native.rope_(x, cos, signed_sin, heads)
        return
    kernels = fused_kernels(x)
    if kernels is not None:
        kernels.rope_triton_(x, heads, cos, signed_sin)
        return
    part = x[:, :heads]
    part.copy_(torch.addcmul(part * cos[:, None], part.roll(x.shape[-1] // 2, dims=-1), signed_sin[:, None]))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` = [gate | up] along the last dimension (vLLM's ``silu_and_mul``)."""
    native = cpu_native.usable(gate_up)
    if native is not None:
        return native.silu_mul(gate_up)
    kernels = fused_kernels(gate_up)
    if kernels is not None:
        return kernels.silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class Linear(nn.Linear):
    """``nn.Linear`` whose product is the engine's GEMM (``fused.linear``: oneDNN or MKL on a prepacked weight for
    float32 on a CPU, as vLLM's CPU backend; ``F.linear`` elsewhere). Same parameters and names as ``nn.Linear``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed = fused.PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.linear(x, self.weight, self.bias, self.packed)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of ``x`` (of ``x + residual``, written into ``x``, when a residual is given)."""
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inverse_frequencies(hf_config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of rotary embeddings; scaled variants (llama3, ...) use transformers' formulas."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    head_dim = head_dim_of(hf_config)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return inv_freq, 1.0


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class RotaryEmbedding(nn.Module):
    """cos and signed sin for arbitrary positions: a sequence's new tokens may start anywhere (chunks, cache hits)."""

    def __init__(self, hf_config):
        super().__init__()
        inv_freq, self.scaling = rope_inverse_frequencies(hf_config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin), each [tokens, head_dim], made once per step for every layer (see ``rotate_``)."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        cos = (freqs.cos() * self.scaling).to(dtype)
        sin = (freqs.sin() * self.scaling).to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


class Attend(nn.Module):
    """A layer's one call into the step's attention, ``ctx.attend`` (vLLM's ``Attention`` layer, which its models
    call the same way), as a module without parameters: hooks see it (``tinypaged.lab.step_profile`` times it)."""

    def __init__(self, layer_idx: int, scale: float):
        super().__init__()
        self.layer_idx, self.scale = layer_idx, scale

    def forward(self, q, k, v, ctx) -> torch.Tensor:
        return ctx.attend(self.layer_idx, q, k, v, self.scale)  # writes k, v into the cache, then attends


class Attention(nn.Module):
    def __init__(self, hf_config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = head_dim_of(hf_config)
        bias = getattr(hf_config, "attention_bias", hf_config.model_type == "qwen2")
        h = hf_config.hidden_size
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=getattr(hf_config, "attention_bias", False))
        self.scale = self.head_dim**-0.5
        self.attn = Attend(layer_idx, self.scale)
        self.qkv_proj = None  # once fused (the engine does it: fused.fuse_projections): one GEMM over [q; k; v]

    def forward(self, x, cos, signed_sin, ctx) -> torch.Tensor:
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv_proj = self.qkv_proj  # read once (None until fused: a plain attribute then, not yet a submodule)
        if qkv_proj is None:  # as the checkpoint stores them: three products
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        else:  # the same three products as one GEMM on the stacked weights (vLLM's QKVParallelLinear)
            qkv = qkv_proj(x)
        qkv = qkv.view(n, h + 2 * kvh, d)
        rotate_(qkv, h + kvh, cos, signed_sin)  # RoPE on the query and key heads, in place
        q, k, v = qkv.split_with_sizes((h, kvh, kvh), dim=1)  # three views in one call: half three slicings' time
        out = self.attn(q, k, v, ctx)  # writes k, v into the cache, then attends
        return self.o_proj(out.reshape(n, h * d))


class MLP(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        h, i = hf_config.hidden_size, hf_config.intermediate_size
        self.gate_proj = Linear(h, i, bias=False)
        self.up_proj = Linear(h, i, bias=False)
        self.down_proj = Linear(i, h, bias=False)
        self.gate_up_proj = None  # once fused: one GEMM over [gate; up] (vLLM's MergedColumnParallelLinear)

    def forward(self, x):
        gate_up_proj = self.gate_up_proj  # read once; None until fused
        if gate_up_proj is None:
            gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        else:
            gate_up = gate_up_proj(x)
        return self.down_proj(silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, hf_config, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.self_attn = Attention(hf_config, layer_idx)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.mlp = MLP(hf_config)

    def forward(self, x, pending, cos, signed_sin, ctx):
        """``x`` is the residual stream, updated in place; ``pending`` is the previous layer's MLP output, not yet
        added to it (each add happens inside the norm that follows it). Returns this layer's MLP output."""
        h = self.input_layernorm(x, pending)  # x += pending; h = norm(x)
        h = self.post_attention_layernorm(x, self.self_attn(h, cos, signed_sin, ctx))  # x += attention; norm
        return self.mlp(h)


class DecoderStack(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(hf_config, i) for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.rotary = RotaryEmbedding(hf_config)


class CausalLM(nn.Module):
    """Flat ("varlen") forward: all tokens of all sequences in this step form one 1-D batch.

    ``input_ids`` and ``positions`` are [num_tokens]; ``ctx`` knows which tokens belong to which
    sequence. ``logits_indices`` picks the tokens whose next-token logits we need (the last token
    of each sequence that samples this step), so the vocabulary projection runs only there.

    This is the engine's one forward, on every device and dtype: every layer's attention goes through
    ``ctx.attend`` (the step's attention backend); speed comes from the operators it calls (fused projections,
    ``add_rms_norm``, ``rotate_``, ``silu_mul``) and, on a GPU with ``enforce_eager=False``, from replaying this
    very forward as a CUDA graph (tinypaged/worker/cuda_graphs.py). tests/test_one_forward.py fails if another
    module loops over the layers.
    """

    def __init__(self, hf_config):
        super().__init__()
        self.config = hf_config
        self.model = DecoderStack(hf_config)
        self.lm_head = Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        if getattr(hf_config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @torch.inference_mode()
    def forward(self, input_ids, positions, ctx, logits_indices=None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # a new tensor: the residual stream, added to in place
        cos, signed_sin = self.model.rotary(positions, x.dtype)
        pending = None  # the last layer's MLP output, added to x by the next norm
        for layer in self.model.layers:
            pending = layer(x, pending, cos, signed_sin, ctx)
        if logits_indices is not None:
            x, pending = x[logits_indices], pending[logits_indices]
        return self.lm_head(self.model.norm(x, pending))
