"""The student edition as a class meets it (issue 45): the grader's edition of a stage holds no answer of any stage
the class has not finished, yet serves that stage's serving check; in a learner's edition a lesson cell that needs
an unwritten part prints one line, and a hidden check refuses to judge (it would compare the learner with themself).

Editions are built once per module: the grader's through ``sandbox.edition_for_stage`` (cached under the grader's
cache, keyed by the sources), the learner's edition of assignment 02 with ``student_edition.write``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tinypaged.course import student_edition as se
from tinypaged.course.grading import sandbox

ROOT = se.ROOT
SERVING = {"01": "serve_contiguous", "02": "serve_paged", "03": "serve_prefix_cache", "04": "serve_policy",
           "05": "serve_kernels", "07": "serve_radix"}
# What the grader's edition withholds besides the graded parts, per stage graded (the checks of that stage and of
# every later one name them): the explicit list, held to the registry below.
WITHHELD = {
    "01": ["gather_then_attend", "merge_splits_reference", "paged_attention_reference", "reshape_and_cache_reference"],
    "02": ["gather_then_attend", "merge_splits_reference", "paged_attention_reference", "reshape_and_cache_reference"],
    "03": ["gather_then_attend", "merge_splits_reference", "paged_attention_reference", "reshape_and_cache_reference"],
    "04": ["gather_then_attend", "merge_splits_reference", "paged_attention_reference", "reshape_and_cache_reference"],
    "05": ["gather_then_attend", "merge_splits_reference", "paged_attention_reference", "reshape_and_cache_reference"],
    "06": [], "07": [], "08": [], "09": [],
}


def _assignment(stage: str) -> str:
    (found,) = [p.stem for p in (ROOT / "solutions").glob(f"{stage}_*.ipynb")]
    return found


def _env(edition: Path, **extra) -> dict:
    env = {"PYTHONPATH": str(edition), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "HOME": os.environ.get("HOME", "/root"), **extra}
    return env


def _python(edition: Path, code: str, cwd: Path, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(edition)], capture_output=True, text=True,
                         timeout=timeout, env=_env(edition, **env), cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def learner02(tmp_path_factory):
    """A learner's edition of assignment 02 (the handout: its parts stubbed, the visible expectations stored)."""
    out = tmp_path_factory.mktemp("learner") / "edition"
    se.write(out, ["02_block_table"])
    return out


# ---------------------------------------------------------------- A: what the grader's edition holds

def test_the_withheld_references_are_what_the_checks_name():
    """The explicit list (``REFERENCE_FUNCTIONS``) is what the checks' registry names as references or forbids:
    plain functions of the engine's code that no assignment has the learner write; the functions kept for the
    engine (``ENGINE_FUNCTIONS``) are named by some check too (no stale entry)."""
    assert se.reference_functions() == se.REFERENCE_FUNCTIONS
    for stage, names in WITHHELD.items():
        assert sorted(se.withheld_references({s for s in WITHHELD if s >= stage})) == names, stage
    from tinypaged.course import checks

    checks._load_all()
    named = {getattr(o, "__name__", None) for c in checks.REGISTRY.values() for o in c.forbidden_objects()}
    assert set(se.ENGINE_FUNCTIONS) <= named
    assert se.ENGINE_NEEDS == {}  # the engine serves every stage's check with no later stage's part


def test_the_grader_edition_stubs_every_unfinished_stage_and_no_reference_computes_an_answer(tmp_path):
    """Stage 2 is graded: every graded part of stages 2-9 hands over (but the few the engine needs, ENGINE_NEEDS),
    stage 1 keeps its code, and stage 5's references raise instead of computing stage 2's paged attention."""
    edition = sandbox.edition_for_stage("02")
    assert sandbox.edition_for("02_block_table") == edition  # cached
    marker = (edition / se.MARKER).read_text()
    assert "'01_contiguous_kv_cache'" not in marker and "'09_many_engines'" in marker
    keep = se.engine_needs("02_block_table")
    for path, stubs in se.plan(ROOT).items():
        rel = path.relative_to(ROOT).as_posix()
        text = (edition / se._edition_path(Path(rel))).read_text()
        tree = ast.parse(text)
        for dotted, assignment, _ in stubs:
            node = se._find(tree, dotted)  # None: a Triton kernel, replaced by its stand-in
            body = ast.unparse(node) if node is not None else f"KernelHandIn({assignment!r}" * (
                f"{dotted} = KernelHandIn({assignment!r}, {dotted!r})" in text)
            if assignment.startswith("01") or dotted in keep:
                assert "learner(" not in body, (rel, dotted)
            else:
                assert f"learner({assignment!r}, {dotted!r})" in body or "KernelHandIn" in body, (rel, dotted)
    reference = ast.parse((edition / "tinypaged" / "kernels" / "reference.py").read_text())
    for name in WITHHELD["02"]:
        body = se._strip_docstring(se._find(reference, name).body)
        assert [type(s) for s in body] == [ast.ImportFrom, ast.Raise], name
    run = _python(edition, """
        import sys, torch
        import tinypaged, tinypaged.kernels as K
        from tinypaged.course.handin import PartNotWritten
        from tinypaged.sched import policies
        assert tinypaged.__file__.startswith(sys.argv[1]), tinypaged.__file__
        q, kc = torch.zeros(1, 2, 4), torch.zeros(2, 4, 1, 4)
        for fn in (K.paged_attention_reference, K.gather_then_attend):
            try:
                fn(q, kc, kc, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3]), 0.5)
            except PartNotWritten as e:
                print("raised:", e)
        try:
            policies.schedule_step([], [], 8, 1, None)
        except NotImplementedError as e:
            print("raised:", e)
    """, tmp_path)
    assert "raised: student edition: 02_block_table, part paged_attention_reference" in run.stdout
    assert "raised: student edition: 02_block_table, part gather_then_attend" in run.stdout
    assert "raised: student edition: 04_continuous_batching, part schedule_step" in run.stdout


def test_the_edition_cache_key_follows_every_stubbed_assignment(tmp_path):
    """A change to a later stage's solution notebook changes what the stage-2 edition stubs: a new cache entry."""
    for top in ("tinypaged", "kernels"):
        (tmp_path / top).symlink_to(ROOT / top, target_is_directory=True)
    (tmp_path / "solutions").mkdir()
    for nb in (ROOT / "solutions").glob("*.ipynb"):
        (tmp_path / "solutions" / nb.name).write_bytes(nb.read_bytes())
    before = sandbox._source_key(tmp_path, "02_block_table")
    late = tmp_path / "solutions" / "05_triton_paged_attention.ipynb"
    late.write_text(late.read_text() + "\n")
    assert sandbox._source_key(tmp_path, "02_block_table") != before
    early = tmp_path / "solutions" / "01_contiguous_kv_cache.ipynb"
    after = sandbox._source_key(tmp_path, "02_block_table")
    early.write_text(early.read_text() + "\n")
    assert sandbox._source_key(tmp_path, "02_block_table") == after  # a finished stage is not stubbed


# ---------------------------------------------------------------- B: each stage's serving check still serves

SERVE = """
    import json, os, sys
    from tinypaged.course.grading import notebook as nbk
    import tinypaged
    assert tinypaged.__file__.startswith(sys.argv[1]), tinypaged.__file__
    ns = sys.modules["__main__"].__dict__
    for cell in json.loads(open(os.environ["SOLUTION"]).read())["cells"]:
        gid = nbk.grade_id(cell) or ""
        if cell["cell_type"] == "code" and not gid.startswith("test_") and gid not in ("try_it", "at_work", "replay"):
            exec(compile(nbk.source_of(cell), "<cell " + gid + ">", "exec"), ns)
    if "plugins" not in ns:  # stage 7: the given cell of part (c), as tests/test_checks.py builds it
        from tinypaged.kv.radix_cache import RadixKVManager
        from tinypaged.sched.radix_policy import CacheAwareOrder
        plugins = {"kv_cache_manager": RadixKVManager.factory(page_size=1, tree_factory=RadixTree),
                   "scheduling_policy": CacheAwareOrder(order=lpm_order)}
    from tinypaged.course import checks
    from tinypaged.course.checks import serving
    serving.MODEL = "tiny"  # the path through the engine is the point, not SmolLM2's tokens: a model that loads in 1 s
    c = checks.get(os.environ["CHECK"])
    record = checks.observe(c, plugins, detect=False)
    print("OUTCOMES", json.dumps(record["outcomes"]))
"""


@pytest.mark.parametrize("stage", sorted(SERVING))
def test_each_serving_check_serves_in_its_stage_grader_edition(stage, tmp_path):
    """The solution's parts, on the grader's edition of their stage (every later stage stubbed): the engine serves
    the check's prompts with the check's knobs to the end, so nothing on its path needs a part the class has not
    written yet (stages 1-3 schedule with serving.OneAtATime, not stage 4's schedule_step). The "tiny" model stands
    in for SmolLM2 (the same engine path; the grader's SmolLM2 runs are tests/test_hostile_submissions.py's)."""
    from tinypaged.course import checks
    from tinypaged.course.checks import serving

    if stage == "05":
        from tinypaged import triton_mode

        if not triton_mode.AVAILABLE:
            pytest.skip(triton_mode.WHY_UNAVAILABLE)
    edition = sandbox.edition_for_stage(stage)
    run = _python(edition, SERVE, tmp_path, timeout=600, TINYPAGED_PROBE="1",
                  SOLUTION=str(ROOT / "solutions" / f"{_assignment(stage)}.ipynb"), CHECK=SERVING[stage])
    outcomes = json.loads(run.stdout.split("OUTCOMES ", 1)[1]) if "OUTCOMES " in run.stdout else None
    assert outcomes and all(o["steps"] and "todo" not in o and "error" not in o for o in outcomes), \
        (run.stdout + run.stderr)[-3000:]
    steps = dict(outcomes[0]["steps"])
    assert steps[serving.CALLED] is True and all(v for k, v in steps.items() if k.startswith("greedy tokens")), steps
    assert checks.get(SERVING[stage]).stage == stage


# ---------------------------------------------------------------- C and D: the learner's edition in a notebook

def test_a_hidden_check_in_the_edition_refuses_instead_of_comparing_the_learner_with_themself(learner02, tmp_path):
    run = _python(learner02, """
        from tinypaged.course.checks import check
        def slot_mapping(block_table, positions, block_size):  # wrong: one slot too far
            return [block_table[p // block_size] * block_size + p % block_size + 1 for p in positions]
        check("slot_mapping", slot_mapping)
        check("slot_mapping", slot_mapping, hidden=7)
    """, tmp_path)
    lines = run.stdout.splitlines()
    assert lines[0].startswith("check slot_mapping: FAIL"), lines  # visible: the stored expectations
    assert lines[1] == ("check slot_mapping (hidden cases): hidden cases are graded by the grader; the student "
                        "edition holds no answers for them"), lines
    graded = _python(learner02, """
        import tinypaged.course.checks as checks
        def slot_mapping(block_table, positions, block_size):
            return [block_table[p // block_size] * block_size + p % block_size for p in positions]
        checks.check("slot_mapping", slot_mapping, hidden=7)
    """, tmp_path, TINYPAGED_GRADING="1")
    assert "check slot_mapping (hidden cases): observed" in graded.stdout  # grading mode: the grader judges


def test_lesson_cells_that_need_an_unwritten_part_print_one_line(learner02, tmp_path):
    """Lesson 02's first cells in a kernel over the learner's edition: a cell that needs an unwritten part, and a
    later cell that needs what that cell would have made, each print one line naming the part and where the stored
    output is; an unrelated error still shows its traceback; an exercise's check still says "not implemented yet"."""
    import nbformat
    from nbclient import NotebookClient

    lesson = nbformat.read(ROOT / "notebooks" / "02_block_table.ipynb", as_version=4)
    code = [c for c in lesson.cells if c.cell_type == "code"]
    cells = code[:4] + [nbformat.v4.new_code_cell(s) for s in (
        "undefined_in_this_lesson + 1",
        "from tinypaged.course.checks import check\n"
        "from tinypaged.kv.block_pool import BlockAllocator\n"
        "def slot_mapping(block_table, positions, block_size):\n"
        "    BlockAllocator(4)  # the edition's stub: this notebook has not written it\n"
        "    return []\n"
        "check('slot_mapping', slot_mapping)")]
    nb = nbformat.v4.new_notebook(cells=cells, metadata=lesson.metadata)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(learner02)  # the kernel inherits it
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before

    def printed(cell):
        return [line for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"
                for line in o.text.splitlines() if line.strip()]

    def errors(cell):
        return [o for o in cell.outputs if o.output_type == "error"]

    where = "its stored output is in notebooks/02_block_table.ipynb, or read it on the course site, page 02_block_table"
    needs = nb.cells[1]  # BlockManager(...): BlockAllocator is the learner's to write
    assert not errors(needs) and printed(needs) == [
        f"this cell needs BlockAllocator.__init__ from exercise 02 (02_block_table; not written yet in your "
        f"notebook): {where}"], needs.outputs
    starts = nb.cells[2]  # LLM("tiny", kv_cache_manager="paged", ...)
    assert not errors(starts) and len(printed(starts)) == 1 and "this cell needs BlockAllocator.__init__" in \
        printed(starts)[0], starts.outputs
    later = nb.cells[3]  # uses `engine`, which the cell above did not make
    assert not errors(later) and printed(later) == [
        f"this cell needs engine, which an earlier cell makes with BlockAllocator.__init__ from exercise 02 "
        f"(02_block_table; not written yet in your notebook): {where}"], later.outputs
    assert [e.ename for e in errors(nb.cells[4])] == ["NameError"]  # not the edition's business: a traceback
    assert printed(nb.cells[5]) == ["check slot_mapping: not implemented yet"], nb.cells[5].outputs


def test_part_not_written_is_a_not_implemented_error_that_names_its_part():
    import pickle

    from tinypaged.course.handin import PartNotWritten, learner

    with pytest.raises(PartNotWritten) as e:
        learner("02_block_table", "NoSuchPart.method")
    assert isinstance(e.value, NotImplementedError) and (e.value.assignment, e.value.part) == \
        ("02_block_table", "NoSuchPart.method")
    assert "02_block_table, part NoSuchPart.method" in str(e.value)
    again = pickle.loads(pickle.dumps(e.value))
    assert (again.assignment, again.part, str(again)) == (e.value.assignment, e.value.part, str(e.value))
