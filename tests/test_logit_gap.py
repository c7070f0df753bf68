"""Every greedy generation a lesson prints keeps a clear top-two logit gap, so a GPU prints the same tokens.

The rule and its thresholds are in ``tinypaged/course/lesson_prompts.py``. Here:

* each generation in ``lesson_prompts.GENERATIONS`` clears ``MIN_GAP[dtype]`` at every step, measured
  with Hugging Face transformers on the CPU (same weights as the engine);
* the registry is complete: every notebook or solution cell that drives the engine is either listed
  there or listed as printing nothing that depends on which tokens come out;
* the notebooks take those prompts from ``tinypaged.course.lesson_prompts`` (so the checked prompts are the run ones).
"""

import functools
import json
import re
from pathlib import Path

import pytest

from tinypaged.course import lesson_prompts as lp

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))
# A cell "generates" when it runs the engine or a model's decoding loop.
GENERATING = re.compile(r"\.generate\(|generate_cached\(|generate_recompute\(|beam_search\(|\.step\(\)")

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def model(name, dtype):
    return lp.load_hf(name, dtype)


@functools.lru_cache(maxsize=None)
def tokenizer():
    return lp.load_tokenizer()


def code_cells(path):
    cells = json.loads(path.read_text())["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def locate(notebook, pattern):
    """Indices of the code cells of ``notebook`` that ``pattern`` finds."""
    return [i for i, src in code_cells(ROOT / notebook) if re.search(pattern, src)]


@pytest.mark.parametrize("gen", lp.GENERATIONS, ids=lambda g: g.name)
def test_top_two_gap(gen):
    gaps = lp.min_gaps(gen, model(gen.model, gen.dtype), tokenizer())
    need = lp.MIN_GAP[gen.dtype]
    bad = {i: round(g, 8) for i, g in enumerate(gaps) if g < need}
    assert not bad, (f"{gen.name} ({gen.model}, {gen.dtype}): prompts {sorted(bad)} come within {need} of a tie "
                     f"(smallest gaps {bad}); pick others with `python -m tinypaged.course.lesson_prompts --search`")


def test_the_gap_is_measured_on_the_tokens_the_engine_generates():
    """The measuring loop decodes what tinypaged decodes (padding and all), so its gaps are the engine's steps."""
    from tinypaged import LLM, SamplingParams

    gen = next(g for g in lp.GENERATIONS if g.name == "triton")
    prompts = gen.prompts(None)
    tokens, _ = lp.greedy_gaps(model("tiny", "float32"), prompts, lp.TRITON_NEW_TOKENS)
    llm = LLM("tiny", dtype="float32", device="cpu", block_size=8, num_gpu_blocks_override=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=lp.TRITON_NEW_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == tokens


def test_a_near_tie_is_caught():
    """The check can fail: "tiny" in float32 has flat logits, and the lesson's first prompts came within 0.01."""
    old = lp.Generation("old_triton", "tiny", "float32", lambda tok: [list(range(100, 100 + n)) for n in (3, 11)],
                        (8, 8), False, (), ())
    assert max(lp.min_gaps(old, model("tiny", "float32"), tokenizer())) < lp.MIN_GAP["float32"]


def test_registered_cells_exist():
    for gen in lp.GENERATIONS:
        for notebook, pattern in gen.cells:
            assert len(locate(notebook, pattern)) == 1, f"{gen.name}: {pattern!r} must find one cell of {notebook}"
    for notebook, pattern, _ in lp.NOT_TOKEN_DEPENDENT:
        assert len(locate(notebook, pattern)) == 1, f"{pattern!r} must find one cell of {notebook}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_generating_cell_is_accounted_for(path):
    notebook = f"{path.parent.name}/{path.name}"
    known = [pat for g in lp.GENERATIONS for nb, pat in g.cells if nb == notebook]
    known += [pat for nb, pat, _ in lp.NOT_TOKEN_DEPENDENT if nb == notebook]
    unlisted = [i for i, src in code_cells(path)
                if GENERATING.search(src) and not any(re.search(p, src) for p in known)]
    assert not unlisted, (f"{notebook}: cells {unlisted} generate but are not in tinypaged.course.lesson_prompts "
                          f"(GENERATIONS, or NOT_TOKEN_DEPENDENT with the reason)")


@pytest.mark.parametrize("gen", [g for g in lp.GENERATIONS if g.names], ids=lambda g: g.name)
def test_notebooks_take_their_prompts_from_lesson_prompts(gen):
    for notebook in sorted({nb for nb, _ in gen.cells}):
        source = "\n".join(src for _, src in code_cells(ROOT / notebook))
        missing = [n for n in gen.names if not re.search(rf"\b{n}\b", source)]
        assert "tinypaged.course.lesson_prompts" in source and not missing, (
            f"{notebook} must import {', '.join(gen.names)} from tinypaged.course.lesson_prompts for '{gen.name}' "
            f"(missing: {', '.join(missing) or 'the import'})")
