"""The engine's products: fused projections, oneDNN and MKL GEMMs (same maths, fewer and faster kernels).

What ``tinypaged.model.llama``'s forward calls for its matrix products, each what vLLM does in its own way:

* **fused projections** (``fuse_projections``, run by the engine after loading): q, k and v read the same input,
  and so do gate and up; stacking their weights makes one GEMM of each group (vLLM's ``QKVParallelLinear`` and
  ``MergedColumnParallelLinear``): four products per layer instead of seven. The layers' own weights become views
  into the stacked tensor, so ``q_proj.weight`` and the ``state_dict`` keep Hugging Face's names and numbers.
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
* **MKL's packed GEMM for a full decode batch** (9 to 16 rows, Intel CPUs with MKL; ``mkl_packed_linear``): MKL's
  own copy of the weight packed for 16-row products (``cblas_sgemm_pack``, torch's ``mkl._mkl_linear``, which
  inductor emits for a float32 linear) streams faster still: a SmolLM2-135M step's products took 37-40 ms at 16
  rows against oneDNN's 46-47 ms (measured 2026-12-04 on the project's 2-core Xeon). A course-only choice too: it
  is what lets the eager forward beat vLLM's CPU build on the same cores (docs/RESULTS.md).

The element-wise operators (add-and-norm, RoPE, SiLU-and-multiply) live beside the model that calls them
(``tinypaged.model.llama``); attention is the step's backend (``tinypaged.attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinear(nn.Module):
    """One or more ``nn.Linear`` layers over one input, as one GEMM on their weights stacked by output row.

    Invariant: each layer's weight (and bias) is a view into the stacked tensor, so loading a
    ``state_dict`` into the layers, or reading ``q_proj.weight``, sees the very numbers the GEMM uses.
    A module (hooks see its calls) without parameters or buffers: the stacked tensors are plain attributes,
    so the model's ``state_dict`` keeps Hugging Face's names. Fuse after the model has its final device and
    dtype (``.to()`` copies each parameter on its own, ending the views).
    """

    def __init__(self, layers: list[nn.Linear]):
        super().__init__()
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_ONEDNN_LINEAR = torch.ops.mkldnn._linear_pointwise.default if ONEDNN else None  # (x, weight, bias, "none", [], "")


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
        self.mkl_key, self.mkl_tensor = None, None  # MKL's packed copy, for ``mkl_packed_linear``: the same invariant

    @staticmethod
    def key_of(weight: torch.Tensor) -> tuple:
        return weight.data_ptr(), weight._version, weight.shape  # a torch.Size is a tuple: no copy to make

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        key = self.key_of(weight)
        if key != self.key:
            self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.key = key
        return self.tensor

    def for_mkl(self, weight: torch.Tensor) -> torch.Tensor:
        key = self.key_of(weight)
        if key != self.mkl_key:
            self.mkl_tensor = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), MKL_ROWS)
            self.mkl_key = key
        return self.mkl_tensor


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


# MKL's packed GEMM (``cblas_sgemm_pack`` / ``cblas_sgemm_compute``, torch's ``mkl._mkl_linear``; what inductor emits
# for a float32 linear on an MKL build) for decode batches of MKL_MIN_ROWS to MKL_ROWS rows on an Intel CPU: a
# SmolLM2-135M step's 121 products (30 layers' distinct weights and the lm_head, read from memory as in a real step)
# took 37.4-40.4 ms at 16 rows against oneDNN's blocked copy's 45.7-47.2 ms, and 40.4 against 39.2 ms at 8 rows
# (this project's 2-core Xeon, 2026-12-04, 22:40 UTC). The copy is packed for exactly MKL_ROWS rows: torch multiplies
# by it only when the input has that many (any other count falls back to the plain weight, 2x slower), so a smaller
# batch is padded with zero rows, whose products cost little in a step bound by reading the weights. The packed copy
# is one more copy of every weight (made at the first such batch, or at warm-up).
MKL_ROWS = 16
MKL_MIN_ROWS = 9
MKL_PACKED = GEMV_ROWS > 0 and hasattr(torch.ops.mkl, "_mkl_linear")  # MKL on an Intel CPU (as GEMV_ROWS)
_MKL_LINEAR = torch.ops.mkl._mkl_linear.default if MKL_PACKED else None  # (x, packed, weight, bias, rows)


def mkl_packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      packed: PackedWeight) -> torch.Tensor:
    """``x @ weight.T + bias`` for 1..``MKL_ROWS`` rows of ``x`` through MKL's packed copy of ``weight`` (``x`` padded
    to ``MKL_ROWS`` rows; the result is the first ``len(x)`` rows, contiguous)."""
    rows = x.shape[0]
    if rows < MKL_ROWS:
        x = F.pad(x, (0, 0, 0, MKL_ROWS - rows))
    return _MKL_LINEAR(x, packed.for_mkl(weight), weight, bias, MKL_ROWS)[:rows]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None) -> torch.Tensor:
    """``F.linear`` (x @ weight.T + bias); float32 on a CPU with more than ``GEMV_ROWS`` rows goes to oneDNN's
    GEMM (what vLLM's CPU backend and inductor's CPU linears call), which computes a decode step's products in
    well under the CPU time of the default BLAS call from 4 rows up, on ``packed``'s blocked copy of the weight
    when one is given; ``MKL_MIN_ROWS``..``MKL_ROWS`` rows with a ``packed`` weight on an Intel CPU go to MKL's
    packed GEMM instead (``mkl_packed_linear``). At 1 to 3 rows (the last requests of a batch, a lone chat) on an Intel CPU, MKL's
    matrix-vector kernels stream the plain weight faster: a SmolLM2 step's 121 products took 21.6 / 23.2 ms that
    way against 29.6 / 30.0 ms through oneDNN's blocked copy at 1 / 2 rows (stop 38's machine, whose CPU model
    was not recorded; MKL's speed there points to an Intel part). On an AMD EPYC (2026-12-02, 18:30 UTC) the
    same call took 47.6-52.1 / 83.7-100.7 / 104.3-124.8 ms at 1 / 2 / 3 rows against oneDNN's 25.8-35.0 /
    28.2-37.0 / 28.3-42.8 ms: MKL runs slower code paths on other vendors' CPUs, so ``GEMV_ROWS`` is 0 there.
    Other dtypes (oneDNN takes no float64) and devices: ``F.linear``."""
    # about 120 calls a decode step, each between two weight streams: the cheapest reads (``x.is_cpu``, not
    # ``x.device.type``, which builds a torch.device each time) and oneDNN's operator resolved once at import
    if ONEDNN and x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.shape[0] > GEMV_ROWS:
        if packed is not None and weight.dtype == torch.float32:
            if MKL_PACKED and MKL_MIN_ROWS <= x.shape[0] <= MKL_ROWS:  # a decode batch of 9-16 rows on Intel
                return mkl_packed_linear(x, weight, bias, packed)
            weight = packed.of(weight)
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def fuse_projections(model) -> None:
    """Give every layer its fused [q; k; v] and [gate; up] projections (o_proj, down_proj and lm_head are single
    GEMMs already). Run after the model has its final device and dtype. Idempotent."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None:
            attn.qkv_proj = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
        if mlp.gate_up_proj is None:
            mlp.gate_up_proj = FusedLinear([mlp.gate_proj, mlp.up_proj])


WARM_ROWS = PACK_ROWS  # warm_up builds oneDNN's primitives for decode batches of 1 to this many rows


def warm_up(model, max_rows: int) -> int:
    """Pay the products' one-off costs now rather than in the first requests (vLLM's server warms its model at
    start-up): pack every projection's weight for oneDNN, and run one product of each weight shape for every
    decode batch size 1..min(``max_rows``, ``WARM_ROWS``), so oneDNN has built the primitives those steps use.
    Larger batches are not warmed: a new row count costs oneDNN 1-3 ms once per shape, little beside such a
    product, while warming every count up to the default ``max_num_seqs`` (256) ran 1,280 products, most of the
    time in the [49152, 576] lm_head: 21 s on 2 threads, 38 s on 1, before the server said it was ready (1.0 s
    for 32 rows; measured on an AMD EPYC, 2026-12-02). Changes no weight, cache or counter. Returns the number
    of products run (0 where the oneDNN GEMMs do not apply)."""
    projections = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None or mlp.gate_up_proj is None:
            return 0  # not fused: nothing packed
        projections += [attn.qkv_proj, mlp.gate_up_proj, attn.o_proj, mlp.down_proj]
    projections.append(model.lm_head)
    projections = [(p.weight, p.bias, p.packed) for p in projections]
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
