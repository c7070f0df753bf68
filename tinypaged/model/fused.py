"""The engine's fast path (course-only knob ``fast_path``, on by default): the same maths, fewer kernels.

Three changes against the readable reference of lessons 1-3, each what vLLM does in its own way:

* **fused projections**: q, k and v read the same input, and so do gate and up; stacking their weights
  makes one GEMM of each group (vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``): four
  calls per layer instead of seven (a small gain on a CPU, where a decode step's few rows make each
  GEMM cost what reading its weights costs);
* **fused attention**: an unset ``attention_backend`` becomes ``"sdpa"``
  (``tinypaged.attention.sdpa.SDPABackend``), which gathers each sequence's keys once and hands them to
  ``torch.nn.functional.scaled_dot_product_attention`` (one kernel, no [B, H, C] score tensor kept
  around) instead of ``attend_gathered``'s chain of permutes, matmuls and masks (``"torch"``, the reference);
* **oneDNN GEMMs** (float32 on a CPU): every projection calls oneDNN's linear on the plain weights (``linear``),
  about half the CPU time of the default BLAS call for a step's few rows. oneDNN-*prepacked* weights were tried
  and left out: the engine's batch shape changes from step to step, and each new shape builds a new prepacked
  primitive, which cost more than it saved (docs/RESULTS.md).

``fast_path=False`` runs the reference path; tests/test_fast_path.py checks both give the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        start = 0
        for layer in layers:
            size = layer.out_features
            layer.weight = nn.Parameter(self.weight[start:start + size], requires_grad=False)
            if has_bias:
                layer.bias = nn.Parameter(self.bias[start:start + size], requires_grad=False)
            start += size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (x @ weight.T + bias); float32 on a CPU goes to oneDNN's GEMM (what vLLM's CPU backend and
    inductor's CPU linears call), which computes a decode step's few-row products in about half the CPU time of
    the default BLAS call (measured on the project's 2-core machine, 1 to 512 rows). Other dtypes (oneDNN takes no
    float64) and devices: ``F.linear``."""
    if ONEDNN and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class SingleLinear:
    """An ``nn.Linear``'s forward through ``linear`` (its own weight tensor, read at each call)."""

    def __init__(self, layer: nn.Linear):
        self.layer = layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.layer.weight, self.layer.bias)


def fuse_projections(model) -> None:
    """Give every layer its fused [q; k; v] and [gate; up] projections; o_proj, down_proj and lm_head are single
    GEMMs already and keep their weights, their forward goes through ``linear`` (oneDNN on a CPU). Idempotent."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None:
            attn.qkv_proj = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
        if mlp.gate_up_proj is None:
            mlp.gate_up_proj = FusedLinear([mlp.gate_proj, mlp.up_proj])
        for single in (attn.o_proj, mlp.down_proj):
            single.forward = SingleLinear(single)
    model.lm_head.forward = SingleLinear(model.lm_head)

