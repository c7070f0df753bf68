"""A small, readable Llama-family decoder (Llama, SmolLM2, Qwen2) whose attention is pluggable.

Parameter names follow Hugging Face's checkpoints, so a ``state_dict`` loads as it is.
The model never owns a KV cache: each attention layer receives a ``ForwardContext`` that says
where this step's keys and values go and where every sequence's earlier ones live. That
context is what changes from stage to stage (contiguous arena, block table, Triton kernel).
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's maths. Half precision is normalised in float32 (as Hugging Face does); float32/64 stay as they are."""
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    h = x.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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
    """cos/sin for arbitrary positions: a sequence's new tokens may start anywhere (chunks, cache hits)."""

    def __init__(self, hf_config):
        super().__init__()
        inv_freq, self.scaling = rope_inverse_frequencies(hf_config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; rotate the two halves of each head (Hugging Face's convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, hf_config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = head_dim_of(hf_config)
        bias = getattr(hf_config, "attention_bias", hf_config.model_type == "qwen2")
        h = hf_config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=getattr(hf_config, "attention_bias", False))
        self.scale = self.head_dim**-0.5
        self.qkv_proj = None  # fast path: a FusedLinear over [q; k; v] (tinypaged.model.fused)

    def forward(self, x, cos, sin, ctx) -> torch.Tensor:
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is None:  # reference: three projections, RoPE on q and on k
            q = apply_rope(self.q_proj(x).view(n, h, d), cos, sin)
            k = apply_rope(self.k_proj(x).view(n, kvh, d), cos, sin)
            v = self.v_proj(x).view(n, kvh, d)
        else:  # one GEMM, then RoPE once on the q and k heads together
            qkv = self.qkv_proj(x).view(n, h + 2 * kvh, d)
            qk = apply_rope(qkv[:, : h + kvh], cos, sin)
            q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kvh:]
        out = ctx.attend(self.layer_idx, q, k, v, self.scale)  # writes k, v into the cache, then attends
        return self.o_proj(out.reshape(n, h * d))


class MLP(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        h, i = hf_config.hidden_size, hf_config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.gate_up_proj = None  # fast path: a FusedLinear over [gate; up] (tinypaged.model.fused)

    def forward(self, x):
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, hf_config, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.self_attn = Attention(hf_config, layer_idx)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.mlp = MLP(hf_config)

    def forward(self, x, cos, sin, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


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
    """

    def __init__(self, hf_config):
        super().__init__()
        self.config = hf_config
        self.model = DecoderStack(hf_config)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        if getattr(hf_config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.compiled = None  # enforce_eager=False: the same forward, compiled (tinypaged.model.compiled)
        self.fast_forward = None  # fast_path: the same forward as one flat loop (tinypaged.model.fused.FlatForward)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @torch.inference_mode()
    def forward(self, input_ids, positions, ctx, logits_indices=None) -> torch.Tensor:
        if self.compiled is not None:
            return self.compiled(input_ids, positions, ctx, logits_indices)
        if self.fast_forward is not None:
            return self.fast_forward(input_ids, positions, ctx, logits_indices)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.lm_head(self.model.norm(x))
