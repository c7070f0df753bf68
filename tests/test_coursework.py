"""Assignments: nbgrader sources, generated exercises, rebuilt submissions, the static scan and the verifier.

Everything here runs in-process and fast; tests/test_grading.py runs real submissions in kernels.
"""

import copy
import json

import pytest

from tinypaged.course import checks, coursework
from tinypaged.course.grading import notebook as nbk
from tinypaged.course.grading.scan import scan_notebook
from tinypaged.course.grading.verify import apply_to_notebook, build_job, effective_seed, score

SOLVED = """def add(a, b):
    ### BEGIN SOLUTION
    return a + b
    ### END SOLUTION
"""


def meta(grade, solution, locked, gid, points=None):
    m = {"grade": grade, "solution": solution, "locked": locked, "grade_id": gid, "schema_version": 3}
    if points is not None:
        m["points"] = points
    return {"nbgrader": m}


def code(src, gid=None, kind="given", points=None, outputs=()):
    md = {} if gid is None else {
        "given": meta(False, False, True, gid), "solution": meta(False, True, False, gid),
        "test": meta(True, False, True, gid, points)}[kind]
    return {"cell_type": "code", "metadata": md, "source": src, "outputs": list(outputs), "execution_count": None}


def nb(*cells, stage="01"):
    return {"cells": list(cells), "metadata": {"tinypaged": {"stage": stage}}, "nbformat": 4, "nbformat_minor": 5}


# ---------------------------------------------------------------- solutions and exercises

def test_solution_regions_become_not_implemented_at_their_indentation():
    out = nbk.strip_solutions(SOLVED)
    assert out == 'def add(a, b):\n    raise NotImplementedError("not implemented yet")\n'


@pytest.mark.parametrize("broken", ["### BEGIN SOLUTION\nx = 1\n", "x = 1\n### END SOLUTION\n",
                                    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n"])
def test_unbalanced_markers_are_refused(broken):
    with pytest.raises(ValueError):
        nbk.strip_solutions(broken)


def test_repository_solutions_follow_the_conventions():
    sols = [s for s, _ in coursework.pairs()]
    assert sols, "no solution notebooks"
    for sol in sols:
        assert coursework.lint_notebook(sol) == [], sol.name


def test_lint_names_what_is_wrong(tmp_path):
    bad = nb(code("x = 1"), code(SOLVED, "add", "given"), code("check('add', add)", "t", "test", points=0),
             stage="03")
    path = tmp_path / "09_demo.ipynb"
    path.write_text(json.dumps(bad))
    problems = "\n".join(coursework.lint_notebook(path))
    for expected in ("metadata.tinypaged.stage must be '09'", "a code cell without nbgrader metadata",
                     "outside a solution cell", "needs points > 0", "unknown check 'add'", "no hidden cases"):
        assert expected in problems, expected


def test_every_solution_has_an_exercise_and_a_lesson():
    sols = sorted(p.name for p, _ in coursework.pairs())
    lessons = {p.name[:2] for p in (coursework.ROOT / "notebooks").glob("*.ipynb")}
    assert {s[:2] for s in sols} <= lessons
    assert all((coursework.ROOT / "exercises" / s).exists() for s in sols)


def test_repository_exercises_match_their_solutions():
    """exercises/ is exactly what nbgrader's generate_assignment makes of solutions/."""
    assert coursework.drifted() == []


def test_exercises_hold_no_solutions_hidden_tests_or_outputs():
    for sol, ex in coursework.pairs():
        text = ex.read_text()
        exercise = json.loads(text)
        assert nbk.BEGIN not in text and nbk.BEGIN_HIDDEN not in text and "hidden=" not in text, ex.name
        assert all(c.get("outputs", []) == [] for c in exercise["cells"]), ex.name
        assert exercise["metadata"]["tinypaged"]["stage"] == sol.name[:2]
        stubs = sum(nbk.STUB in nbk.source_of(c) for c in exercise["cells"] if nbk.is_solution(c))
        assert stubs == sum(nbk.is_solution(c) and c["cell_type"] == "code" for c in exercise["cells"])


# ---------------------------------------------------------------- rebuilding a submission

SOURCE = nb(code("from tinypaged.course.checks import check", "setup"),
            code(SOLVED, "add", "solution"),
            code('check("x", add)\n### BEGIN HIDDEN TESTS\ncheck("x", add, hidden=1)\n### END HIDDEN TESTS', "t_add",
                 "test", points=2))


def test_assemble_puts_back_the_instructors_cells_and_keeps_the_learners():
    sub = copy.deepcopy(SOURCE)
    sub["cells"][0]["source"] = "import os  # learner edited a locked cell"
    sub["cells"][1]["source"] = "def add(a, b):\n    return a - b\n"
    sub["cells"][2]["source"] = 'print("PASS")  # learner replaced the test'
    sub["cells"].insert(1, code("helper = 1"))  # an added cell
    run = nbk.assemble(SOURCE, sub)
    srcs = [nbk.source_of(c) for c in run["cells"]]
    assert srcs[0] == "from tinypaged.course.checks import check"
    assert srcs[1] == "helper = 1" and nbk.role(run["cells"][1]) == nbk.LEARNER
    assert srcs[2] == "def add(a, b):\n    return a - b\n" and nbk.role(run["cells"][2]) == nbk.LEARNER
    assert "hidden=1" in srcs[3] and nbk.points(run["cells"][3]) == 2


def test_assemble_restores_deleted_cells_and_ignores_forged_metadata():
    sub = copy.deepcopy(SOURCE)
    del sub["cells"][2]  # the test cell
    del sub["cells"][1]  # the solution cell
    sub["cells"].append(code("x = 1", "t_add_forged", "test", points=100))
    run = nbk.assemble(SOURCE, sub)
    ids = [nbk.grade_id(c) for c in run["cells"]]
    assert ids[:3] == ["setup", "add", "t_add"]
    assert nbk.STUB in nbk.source_of(run["cells"][1])
    assert nbk.grade_id(run["cells"][3]) is None and not nbk.is_test(run["cells"][3])


def test_stage_comes_from_the_metadata_then_the_file_name(tmp_path):
    assert nbk.stage_of(nb(stage="04"), tmp_path / "alice_homework.ipynb") == "04"
    assert nbk.stage_of({"metadata": {}}, tmp_path / "02_block_table.ipynb") == "02"
    assert nbk.stage_of({"metadata": {}}, tmp_path / "homework.ipynb") is None


# ---------------------------------------------------------------- the static scan

def scan(*learner, given="from tinypaged.kv import contiguous\nfrom tinypaged.attention import backends as attention\nimport tinypaged"):
    cells = [(0, given, False)] + [(i + 1, src, True) for i, src in enumerate(learner)]
    return scan_notebook(cells)


@pytest.mark.parametrize("src", [
    "first_fit = contiguous.first_fit",
    "from tinypaged.kv.contiguous import first_fit",
    "from tinypaged.kv.contiguous import first_fit as ff\ndef first_fit(h, s):\n    return ff(h, s)",
    "def first_fit(h, s):\n    return tinypaged.kv.contiguous.first_fit(h, s)",
    "import tinypaged.kv.contiguous as c\nfirst_fit = getattr(c, 'first_fit')",
])
def test_scan_finds_reuse_of_a_reference(src):
    found = [f for f in scan(src) if f.kind == "reuse"]
    assert found and "first_fit" in found[0].checks and "first_fit" in found[0].binds


def test_scan_finds_the_package_stage_module_of_references():
    found = scan("from tinypaged.course.checks import stage03 as ref\ndef fork(t, r):\n    return ref.fork(t, r)")
    kinds = {f.kind for f in found}
    assert "reuse" in kinds and "tamper" in kinds  # a reference, reached through the grader's own modules


@pytest.mark.parametrize("src", [
    "import tinypaged.course.checks\ntinypaged.checks.evaluate = lambda *a: ('PASS', '')",
    "from tinypaged import checks\nsetattr(checks, 'check', print)",
    "import sys\nsys.modules['tinypaged.course.checks'] = None",
    "exec('import tinypaged')",
    "import os\nos.environ.pop('TINYPAGED_GRADING')",
    "contiguous.first_fit = lambda h, s: 0",
    "import builtins\nbuiltins.print = None",
])
def test_scan_finds_tampering(src):
    assert any(f.kind == "tamper" for f in scan(src)), src


@pytest.mark.parametrize("src", [
    "from tinypaged.course.checks import check\ncheck('first_fit', first_fit)",
    "import torch\ntorch.backends.cudnn.deterministic = True",
    "class A:\n    def __init__(self):\n        self.free = []\n        self.free.append(1)",
    "from tinypaged.kv.block_pool import hash_block_tokens\nh = hash_block_tokens(None, [1])",
    "def first_fit(holes, size):\n    return next((s for s, g in holes if g >= size), None)",
])
def test_scan_leaves_ordinary_code_alone(src):
    assert scan(src) == [], src


# ---------------------------------------------------------------- the verifier

def ff(holes, size):
    return next((s for s, g in holes if g >= size), None)


SOURCE_FF = nb(code("from tinypaged.course.checks import check", "setup"),
               code("def first_fit(holes, size):\n    ### BEGIN SOLUTION\n    return None\n    ### END SOLUTION\n",
                    "first_fit", "solution"),
               code('check("first_fit", first_fit)\n### BEGIN HIDDEN TESTS\ncheck("first_fit", first_fit, hidden=7)\n'
                    '### END HIDDEN TESTS', "test_ff", "test", points=2))


def evidence(impl=ff, calls=("test_ff/0", "test_ff/1"), **extra):
    """What a probe would have reported for ``impl`` (observed in this process: the verifier is what is tested)."""
    records = {}
    for key in calls:
        hidden = effective_seed(7) if key.endswith("/1") else None
        records[key] = checks.observe(checks.get("first_fit"), impl, hidden, detect=False)
    return {"records": records, "cells": {}, "kills": [], "refused": [], "threads": [], **extra}


def graded(learner_src, ev):
    sub = copy.deepcopy(SOURCE_FF)
    sub["cells"][1]["source"] = learner_src
    job = build_job(SOURCE_FF, sub, "01")
    found = scan_notebook([(c["index"], c["source"], c["learner"]) for c in job["cells"]])
    return score(SOURCE_FF, job, found, ev)


def test_the_module_comes_from_the_sources_solution_cells_whatever_the_submission_says():
    sub = copy.deepcopy(SOURCE_FF)
    sub["cells"][0]["source"] = "import os  # a locked cell edited"
    sub["cells"][1]["source"] = "def first_fit(h, s):\n    return 0\n"
    sub["cells"][1]["metadata"]["nbgrader"]["solution"] = False  # re-marked: still the learner's code
    sub["cells"].insert(2, code("first_fit = None  # an added cell"))
    cells = nbk.module_cells(SOURCE_FF, sub)
    assert [(c["grade_id"], c["learner"]) for c in cells] == [("setup", False), ("first_fit", True)]
    assert cells[0]["source"].startswith("from tinypaged.course.checks import check")
    assert "return 0" in cells[1]["source"]
    del sub["cells"][1]  # a lost solution cell comes back as the stub
    assert nbk.STUB in nbk.module_cells(SOURCE_FF, sub)[1]["source"]


def test_verifier_scores_observations_against_its_own_expectations():
    rep = graded("def first_fit(h, s): ...", evidence())
    assert (rep["score"], rep["max_score"]) == (2.0, 2.0) and rep["tests"][0]["status"] == checks.PASS
    forged = evidence()
    for rec in forged["records"].values():  # the probe claims outcomes a first fit never gives
        for o in rec["outcomes"]:
            for step in o["steps"]:
                step[1] = -1
    assert graded("def first_fit(h, s): ...", forged)["score"] == 0.0


def test_verifier_gives_partial_credit_and_names_a_killed_check():
    ev = evidence(calls=("test_ff/0",), kills=[{"call": "test_ff/1", "case": 0, "why": "ran past its CPU-time budget"}])
    row = graded("def first_fit(h, s): ...", ev)["tests"][0]
    assert 0 < row["score"] < 2 and "CPU-time budget" in row["message"]


def test_verifier_zeroes_reuse_runtime_reuse_refusals_and_everything_after_tampering():
    rep = graded("from tinypaged.kv.contiguous import first_fit", evidence())
    assert rep["score"] == 0 and "reference implementation tinypaged.kv.contiguous.first_fit" in rep["tests"][0]["message"]
    rep = graded("import tinypaged.course.checks as c\nc.evaluate = None\ndef first_fit(h, s): ...", evidence())
    assert rep["score"] == 0 and "grader" in rep["tests"][0]["message"]
    ev = evidence()  # a claim of the sandbox beside the steps is not evidence (tests/test_sealed_judge.py)
    ev["records"]["test_ff/0"]["reuse"] = "first_fit calls the package's own first_fit"
    rep = graded("def first_fit(h, s): ...", ev)
    assert rep["tests"][0]["score"] == 2 and coursework.status(rep) == "PASS"
    ev = evidence(refused=["test_ff/1: cell_001_learner, line 2: sys._getframe()"])
    row = graded("def first_fit(h, s): ...", ev)["tests"][0]
    assert 0 < row["score"] < 2 and "refused" in row["message"]


def test_verdicts_are_written_in_nbgraders_language():
    rep = graded("def first_fit(h, s): ...", evidence(calls=("test_ff/0",)))
    ran = copy.deepcopy(SOURCE_FF)  # the kernel printed something and claimed an error-free full score
    ran["cells"][2]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "your engine: ...\n"},
                                  {"output_type": "execute_result", "data": {"text/plain": "2"}, "metadata": {}}]
    out = apply_to_notebook(ran, rep, SOURCE_FF)["cells"][2]["outputs"]
    # the verdict, not the kernel's claim; what it printed is dropped here (a cell with hidden cases: their
    # answers could show), kept in a cell without (tests/test_sealed_judge.py)
    assert [o["output_type"] for o in out] == ["stream", "execute_result"] and "your engine" not in out[0]["text"]
    assert 0 < float(out[-1]["data"]["text/plain"]) < 2
    full = graded("def first_fit(h, s): ...", evidence())
    visible = copy.deepcopy(SOURCE_FF)  # a test cell without hidden cases (a serving check's)
    visible["cells"][2]["source"] = 'check("first_fit", first_fit)'
    logged = copy.deepcopy(visible)  # the engine's INFO line goes to stderr, which nbgrader scores as a failure
    logged["cells"][2]["outputs"] = [{"output_type": "stream", "name": "stderr", "text": "INFO tinypaged: ...\n"}]
    cell = apply_to_notebook(logged, full, visible)["cells"][2]
    assert cell["outputs"][0]["text"] == "INFO tinypaged: ...\n" and cell["outputs"][0]["name"] == "stdout"
    from nbformat import from_dict
    from nbgrader.utils import determine_grade
    assert determine_grade(from_dict(cell))[0] == full["tests"][0]["points"]
    rep = graded("def first_fit(h, s): ...", evidence(calls=()))
    lost = copy.deepcopy(SOURCE_FF)
    del lost["cells"][2]  # the submission lost its test cell: it comes back, scored
    out = apply_to_notebook(lost, rep, SOURCE_FF)["cells"][-1]["outputs"]
    assert out[-1]["output_type"] == "error"


@pytest.mark.parametrize("src", [
    "import sys", "import os", "import threading", "import gc", "from importlib import import_module",
    "f = check.__globals__", "x = getattr(torch, name)", "open('/etc/passwd')", "t = torch.sys",
    "y = (1).__class__.__base__.__subclasses__()", "s = '__glob' 'als__'", "exec('1')",
])
def test_solution_cells_are_read_strictly(src):
    assert any(f.kind == "tamper" for f in scan(src)), src
