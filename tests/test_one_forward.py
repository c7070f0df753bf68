"""One model forward (issue #46): ``tinypaged.model.llama``'s, on every device, through the attention seam.

Its fused projections compute what the checkpoint's three (two) projections compute, its default attention
("sdpa") what the reference "torch" backend computes, its oneDNN GEMMs what ``F.linear`` computes, and no other
module in the package runs the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import tinypaged
from tinypaged import LLM, SamplingParams
from tinypaged.attention.backends import TorchBackend
from tinypaged.attention.sdpa import SDPABackend

PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 4000 + 3 for j in range(9 + 6 * i)]} for i in range(6)]


def run(reference: bool, dtype="float64", monkeypatch=None, **kw):
    """Greedy tokens and every step's logits; a small step budget makes prompts arrive in chunks
    (prefills starting past position 0) beside decodes of the others. ``reference``: the checkpoint's
    unfused projections and the "torch" attention backend (the lessons' reference), else the defaults."""
    if reference:
        monkeypatch.setattr("tinypaged.engine.core.fuse_projections", lambda model: None)
        kw.setdefault("attention_backend", "torch")
    llm = LLM("tiny", dtype=dtype, device="cpu", max_num_seqs=4, max_num_batched_tokens=16,
              block_size=4, kv_cache_tokens=1024, max_model_len=64, **kw)
    if reference:
        monkeypatch.undo()
    runner, logits = llm.llm_engine.runner, []
    execute = runner.execute
    runner.execute = lambda scheduled: (lambda out: logits.append(out[0]) or out)(execute(scheduled))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs], [x for x in logits if x is not None], llm


@pytest.mark.parametrize("kw", [dict(), dict(kv_cache_manager="contiguous"), dict(enable_prefix_caching=True)],
                         ids=["paged", "contiguous", "prefix-caching"])
def test_the_engine_equals_the_unfused_reference_in_float64(kw, monkeypatch):
    ref_tokens, ref_logits, ref = run(True, monkeypatch=monkeypatch, **kw)
    tokens, logits, llm = run(False, **kw)
    assert ref.llm_engine.model.model.layers[0].self_attn.qkv_proj is None  # the reference really is unfused
    assert llm.llm_engine.model.model.layers[0].self_attn.qkv_proj is not None
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) > 10
    for a, b in zip(ref_logits, logits):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def test_float32_stays_close_to_the_reference(monkeypatch):
    ref_tokens, ref_logits, _ = run(True, dtype="float32", monkeypatch=monkeypatch)
    tokens, logits, _ = run(False, dtype="float32")
    assert tokens == ref_tokens
    for a, b in zip(ref_logits, logits):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_the_default_backend_and_fused_projections():
    engine = LLM("tiny", device="cpu", kv_cache_tokens=256).llm_engine
    assert isinstance(engine.runner.backend, SDPABackend) and engine.config.attention_backend == "sdpa"
    layer = engine.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    names = list(engine.model.state_dict())  # Hugging Face's names, and nothing more
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("qkv" in n or "gate_up" in n for n in names)


def test_a_named_backend_runs_what_its_name_says():
    """No silent swap: "torch" is the reference, "sdpa" is torch's fused attention; an unset attention_backend is
    "sdpa" on a CPU, and the config then names the one that runs."""
    cases = [(dict(attention_backend="torch"), TorchBackend), (dict(attention_backend="sdpa"), SDPABackend),
             (dict(), SDPABackend)]
    for kw, kind in cases:
        engine = LLM("tiny", device="cpu", kv_cache_tokens=256, **kw).llm_engine
        assert type(engine.runner.backend) is kind, kw
        assert engine.config.attention_backend == {TorchBackend: "torch", SDPABackend: "sdpa"}[kind]
    with pytest.raises(ValueError, match="attention_backend='fused'.*'torch', 'sdpa', 'triton'"):
        LLM("tiny", device="cpu", kv_cache_tokens=256, attention_backend="fused")


def test_the_removed_fast_path_knob_is_an_error_naming_it():
    with pytest.raises((TypeError, ValueError), match="fast_path"):
        LLM("tiny", device="cpu", kv_cache_tokens=256, fast_path=False)


PACKAGE = Path(tinypaged.__file__).parent


def loops_over_layers(tree: ast.AST) -> list[str]:
    """Functions that run the model's layers: a ``for`` over ``<something>.layers`` whose body calls a layer or a
    layer's part (``ctx``, ``attend`` or the loop variable called). Loops that only read weights do not count."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for loop in ast.walk(fn):
            if not (isinstance(loop, ast.For) and isinstance(loop.iter, ast.Attribute) and loop.iter.attr == "layers"):
                continue
            names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
            for call in (n for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                f = call.func
                runs = (isinstance(f, ast.Name) and f.id in names) or (isinstance(f, ast.Attribute) and f.attr == "attend") \
                    or any(isinstance(a, ast.Name) and a.id == "ctx" for a in call.args)
                if runs:
                    found.append(f"{fn.name} (line {loop.lineno})")
                    break
    return found


def test_only_the_models_own_forward_runs_the_layers():
    """A second whole-model path (a flat loop, a compiled copy, a C++ call taking every layer) fails here."""
    assert loops_over_layers(ast.parse("def f(m, x, ctx):\n    for layer in m.model.layers:\n        x = layer(x, ctx)\n"))
    assert not loops_over_layers(ast.parse("def f(m):\n    for layer in m.model.layers:\n        print(layer.mlp)\n"))
    found = {str(p.relative_to(PACKAGE)): loops_over_layers(ast.parse(p.read_text())) for p in PACKAGE.rglob("*.py")}
    found = {path: fns for path, fns in found.items() if fns}
    assert list(found) == ["model/llama.py"] and len(found["model/llama.py"]) == 1, found
    assert found["model/llama.py"][0].startswith("forward")


def test_fused_weights_are_the_layers_weights():
    """Loading a state_dict into the fused model (or editing q_proj) changes what the fused GEMM computes."""
    engine = LLM("tiny", device="cpu", kv_cache_tokens=256).llm_engine
    attn = engine.model.model.layers[1].self_attn
    state = {k: torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    engine.model.load_state_dict(state)
    x = torch.randn(3, attn.q_proj.in_features)
    with torch.inference_mode():
        expected = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        torch.testing.assert_close(attn.qkv_proj(x), expected)
        torch.testing.assert_close(attn.q_proj.weight, state["model.layers.1.self_attn.q_proj.weight"])


def test_every_projection_goes_through_onednn_linear_and_equals_f_linear(monkeypatch):
    """Every product of a step goes through ``fused.linear`` with its packed weight; in float32 on a CPU that is
    oneDNN, numbers as ``F.linear``'s (float64, which oneDNN does not take, falls back on ``F.linear`` there)."""
    from tinypaged.model import fused

    if not fused.ONEDNN:
        pytest.skip("torch was built without oneDNN")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    for rows in (1, 3, 16, 100):
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(fused.linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    calls = []
    real = fused.linear
    monkeypatch.setattr(fused, "linear", lambda x, w, b=None, packed=None: calls.append((x.dtype, packed is not None))
                        or real(x, w, b, packed))
    for dtype in ("float32", "float64"):  # tiny: 2 layers x (qkv, o, gate_up, down) + lm_head
        calls.clear()
        llm = LLM("tiny", device="cpu", dtype=dtype, kv_cache_tokens=256)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=1))
        assert calls == [(getattr(torch, dtype), True)] * (4 * 2 + 1), dtype  # each brings its packed weight


@pytest.mark.parametrize("gemv_rows", [3, 0])
def test_few_row_products_take_the_plain_blas_call_and_more_rows_the_packed_onednn_one(monkeypatch, gemv_rows):
    """Up to ``GEMV_ROWS`` rows (a lone request's decode step) ``fused.linear`` multiplies the plain weight with
    the default BLAS call (3 on an Intel CPU with MKL, whose matrix-vector kernels stream it faster there; 0
    elsewhere); from one row more it goes to oneDNN on the packed copy. Both give ``F.linear``'s numbers."""
    from tinypaged.model import fused

    if not fused.ONEDNN:
        pytest.skip("torch was built without oneDNN")
    monkeypatch.setattr(fused, "GEMV_ROWS", gemv_rows)
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    packed = fused.PackedWeight()
    plain = []
    f_linear = torch.nn.functional.linear
    monkeypatch.setattr(fused.F, "linear", lambda *a: plain.append(a[0].shape[0]) or f_linear(*a))
    for rows in range(1, gemv_rows + 3):
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(fused.linear(x, w, b, packed), f_linear(x, w, b), rtol=1e-5, atol=1e-5)
        if rows <= gemv_rows:
            assert packed.tensor is None  # no blocked copy made for products that never use it
    assert plain == list(range(1, gemv_rows + 1))
    assert packed.tensor is not None


@pytest.mark.parametrize("system, machine, cpuinfo, processor, mkl, expected", [
    ("linux", "x86_64", "vendor_id\t: GenuineIntel\n", "", True, True),
    ("linux", "x86_64", "vendor_id\t: AuthenticAMD\n", "", True, False),
    ("linux", "x86_64", "vendor_id\t: GenuineIntel\n", "", False, False),  # torch's BLAS is not MKL
    ("linux", "aarch64", "", "", True, False),
    ("win32", "AMD64", "", "Intel64 Family 6 Model 142 Stepping 10, GenuineIntel", True, True),
    ("win32", "AMD64", "", "AMD64 Family 25 Model 33 Stepping 0, AuthenticAMD", True, False),
    ("darwin", "x86_64", "", "i386", True, True),
    ("darwin", "arm64", "", "arm", True, False),
])
def test_the_few_row_blas_route_is_taken_only_where_mkl_runs_on_an_intel_cpu(monkeypatch, tmp_path, system, machine,
                                                                              cpuinfo, processor, mkl, expected):
    """MKL's matrix-vector kernels beat oneDNN's at 1-3 rows on an Intel CPU only (on an AMD EPYC they took 1.6-3x
    oneDNN's time): ``mkl_on_intel`` reads the vendor where each system keeps it."""
    import builtins
    import platform
    import sys

    from tinypaged.model import fused

    info = tmp_path / "cpuinfo"
    info.write_text(cpuinfo)
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: real_open(info if f == "/proc/cpuinfo" else f, *a, **k))
    monkeypatch.setattr(sys, "platform", system)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(platform, "processor", lambda: processor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    assert fused.mkl_on_intel() is expected


def test_packed_weights_equal_f_linear_and_follow_every_change_to_the_weight():
    """The blocked copy oneDNN multiplies by (``PackedWeight``) gives ``F.linear``'s numbers for any row count,
    and is made again when the plain weight changes in place (``load_state_dict``, ``mul_``, a write through a
    view of the fused tensor) or is replaced: a stale copy would generate from the old weights."""
    from tinypaged.model import fused

    if not fused.ONEDNN:
        pytest.skip("torch was built without oneDNN")
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    packed = fused.PackedWeight()
    for rows in (1, 5, 16, 33, 200):
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(fused.linear(x, w, b, packed), torch.nn.functional.linear(x, w, b),
                                   rtol=1e-5, atol=1e-5)
    first = packed.tensor
    x = torch.randn(4, 64, generator=g)
    fused.linear(x, w, b, packed)
    assert packed.tensor is first  # unchanged weight: packed once
    w.mul_(2)
    torch.testing.assert_close(fused.linear(x, w, b, packed), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    w = torch.randn(96, 64, generator=g)  # a new tensor in its place
    torch.testing.assert_close(fused.linear(x, w, b, packed), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)

    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_tokens=256)
    prompt, greedy = [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=6)
    before = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    model = llm.llm_engine.model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, value in state.items():
        if name.endswith(("q_proj.weight", "up_proj.weight")):
            value.mul_(-1.5)  # writes through the views into the fused [q; k; v] and [gate; up] tensors
    model.load_state_dict(state)
    after = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    fresh = LLM("tiny", device="cpu", dtype="float32", kv_cache_tokens=256)  # fused from the new weights
    fresh.llm_engine.model.load_state_dict(state)
    assert after == fresh.generate(prompt, greedy)[0].outputs[0].token_ids != before


def test_warm_up_packs_every_projection_before_the_first_request_and_changes_nothing():
    """``fused.warm_up`` (the engine core runs it before it says Ready, as vLLM's server warms its model): every
    projection's packed copy exists afterwards, one product per weight shape and decode batch size (up to
    ``WARM_ROWS``) was run, and
    the engine generates what a cold one generates, with no step counted."""
    from tinypaged.model import fused

    if not fused.ONEDNN:
        pytest.skip("torch was built without oneDNN")
    prompt, greedy = [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=6)
    cold = LLM("tiny", device="cpu", dtype="float32", kv_cache_tokens=256).generate(prompt, greedy)
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_tokens=256)
    model = llm.llm_engine.model
    packs = [p for layer in model.model.layers for p in (layer.self_attn.qkv_proj.packed, layer.mlp.gate_up_proj.packed,
                                                          layer.self_attn.o_proj.packed,
                                                          layer.mlp.down_proj.packed)]
    packs.append(model.lm_head.packed)
    assert all(p.tensor is None for p in packs)
    shapes = {tuple(w.shape) for w in (model.model.layers[0].self_attn.qkv_proj.weight, model.lm_head.weight,
                                       model.model.layers[0].mlp.gate_up_proj.weight,
                                       model.model.layers[0].self_attn.o_proj.weight,
                                       model.model.layers[0].mlp.down_proj.weight)}
    assert fused.warm_up(model, 4) == 4 * len(shapes)
    assert all(p.tensor is not None for p in packs) and llm.get_metrics()["num_steps"] == 0
    # batches past WARM_ROWS are not warmed: the default max_num_seqs (256) runs 32 products per shape, not 256
    assert fused.warm_up(model, llm.llm_engine.config.max_num_seqs) == fused.WARM_ROWS * len(shapes) < 256 * len(shapes)
    assert token_ids_of(llm.generate(prompt, greedy)) == token_ids_of(cold)
    from tinypaged.model.loader import load_model

    unfused = load_model("tiny", torch.float32, torch.device("cpu"), 0)  # as loaded, before the engine fuses it
    assert fused.warm_up(unfused, 4) == 0


def token_ids_of(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_the_forward_reads_the_models_parts_at_every_step(monkeypatch):
    """The forward reads each norm weight and projection where the model keeps it, so a change made in place after
    the engine was built (``load_state_dict`` on norms and o_proj/down_proj) reaches the next step, with the
    unfused reference's numbers (float64)."""
    fast = LLM("tiny", device="cpu", dtype="float64", kv_cache_tokens=256)
    monkeypatch.setattr("tinypaged.engine.core.fuse_projections", lambda model: None)
    ref = LLM("tiny", device="cpu", dtype="float64", kv_cache_tokens=256, attention_backend="torch")
    monkeypatch.undo()
    prompt, greedy = [{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=6)
    before = token_ids_of(fast.generate(prompt, greedy))
    state = {k: v.clone() for k, v in fast.llm_engine.model.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    for name, value in state.items():
        if name.endswith(("layernorm.weight", "model.norm.weight", "o_proj.weight", "down_proj.weight")):
            value.add_(torch.randn(value.shape, generator=g, dtype=value.dtype))
    for llm in (fast, ref):
        llm.llm_engine.model.load_state_dict(state)
    after = token_ids_of(fast.generate(prompt, greedy))
    assert after == token_ids_of(ref.generate(prompt, greedy)) and after != before


def test_mkl_packed_products_equal_f_linear_for_every_row_count_they_take():
    """A decode batch of ``MKL_MIN_ROWS``..``MKL_ROWS`` rows on an Intel CPU goes through MKL's packed copy of the
    weight, padded to ``MKL_ROWS`` rows: the result is ``F.linear``'s (bias or not), ``len(x)`` contiguous rows, and
    the packed copy is made again when the weight changes in place or is replaced."""
    from tinypaged.model import fused

    if not fused.MKL_PACKED:
        pytest.skip("MKL's packed GEMM is used only with MKL on an Intel CPU")
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(80, 48, generator=g), torch.randn(80, generator=g)
    packed = fused.PackedWeight()
    for rows in range(fused.MKL_MIN_ROWS, fused.MKL_ROWS + 1):
        for bias in (None, b):
            x = torch.randn(rows, 48, generator=g)
            y = fused.linear(x, w, bias, packed)
            assert y.shape == (rows, 80) and y.is_contiguous()
            torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    first = packed.mkl_tensor
    assert first is not None, "those row counts did not go through MKL's packed copy"
    x = torch.randn(fused.MKL_ROWS, 48, generator=g)
    w.mul_(3)
    torch.testing.assert_close(fused.linear(x, w, b, packed), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert packed.mkl_tensor is not first
    w = torch.randn(80, 48, generator=g)
    torch.testing.assert_close(fused.linear(x, w, b, packed), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
