"""The judge (tinypaged.course.grading.verify) trusts nothing from the sandbox but each case's steps (#28).

Fabricated evidence goes straight into ``verify.score``, no sandbox: a record's other claims (``reuse``,
``finished``, a verdict) change nothing; NaN and inf never pass; malformed or oversized evidence, and events about
calls or cells the job does not have, give 0 for that check with the reason, never a crash. Also here: a
failed hidden case shows no inputs or expected values, a symlinked submission is refused, the quick grader's
outputs stay out of the submissions' folders and the repository, and nbgrader's test cells are compared with
what the learner was given (tampering flagged, no checksum noise).
"""

import copy
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from tinypaged.course import checks, coursework
from tinypaged.course.grading import notebook as nbk
from tinypaged.course.grading.verify import apply_to_notebook, build_job, effective_seed, score, verdict_lines


def meta(grade, solution, locked, gid, points=None):
    m = {"grade": grade, "solution": solution, "locked": locked, "grade_id": gid, "schema_version": 3}
    if points is not None:
        m["points"] = points
    return {"nbgrader": m}


def code(src, gid, kind, points=None):
    md = {"given": meta(False, False, True, gid), "solution": meta(False, True, False, gid),
          "test": meta(True, False, True, gid, points)}[kind]
    return {"cell_type": "code", "metadata": md, "source": src, "outputs": [], "execution_count": None}


SOURCE = {"cells": [
    code("from tinypaged.course.checks import check", "setup", "given"),
    code("def first_fit(holes, size):\n    ### BEGIN SOLUTION\n    return None\n    ### END SOLUTION\n",
         "first_fit", "solution"),
    code('check("first_fit", first_fit)\n### BEGIN HIDDEN TESTS\ncheck("first_fit", first_fit, hidden=7)\n'
         '### END HIDDEN TESTS', "test_ff", "test", points=2),
    code("def paged_attention(q, k, v, t, s, scale):\n    ### BEGIN SOLUTION\n    return None\n    ### END SOLUTION\n",
         "pa", "solution"),
    code('check("paged_attention_torch", paged_attention)', "test_pa", "test", points=2),
], "metadata": {"tinypaged": {"stage": "02"}}, "nbformat": 4, "nbformat_minor": 5}


def first_fit(holes, size):
    return next((s for s, g in holes if g >= size), None)


def wrong_first_fit(holes, size):  # best fit
    fits = [(g, s) for s, g in holes if g >= size]
    return min(fits)[1] if fits else None


def todo(*_):
    raise NotImplementedError("not implemented yet")


def observed(name, impl, hidden=None):
    return checks.observe(checks.get(name), impl, hidden, detect=False)


def honest_pa():
    """The paged attention record a correct implementation gives (the reference's own outcomes)."""
    return {"check": "paged_attention_torch", "hidden": None, "reuse": None,
            "outcomes": copy.deepcopy(checks.expected_outcomes("paged_attention_torch"))}


def evidence(ff=first_fit, pa=None, **extra):
    records = {"test_ff/0": observed("first_fit", ff), "test_ff/1": observed("first_fit", ff, effective_seed(7)),
               "test_pa/0": pa if pa is not None else observed("paged_attention_torch", todo)}
    return {"records": records, "cells": {}, "kills": [], "refused": [], "threads": [], **extra}


def judged(ev):
    job = build_job(SOURCE, SOURCE, "02")
    return score(SOURCE, job, [], ev)


def row(report, gid):
    return next(t for t in report["tests"] if t["grade_id"] == gid)


def test_honest_and_untouched_records_score_as_they_should():
    rep = judged(evidence(pa=honest_pa()))
    assert (rep["score"], rep["max_score"]) == (4.0, 4.0)
    assert judged(evidence(ff=todo))["score"] == 0.0


def test_claims_beside_the_steps_are_ignored():
    # an untouched exercise claiming everything a verdict could say: still 0
    ev = evidence(ff=todo)
    for rec in ev["records"].values():
        rec.update(reuse=None, finished=True, status=checks.PASS, passed=99, verdict="PASS", score=2)
        for o in rec["outcomes"]:
            o.update(passed=True, status=checks.PASS)
    ev["finished"] = True
    assert judged(ev)["score"] == 0.0
    # a correct answer that the sandbox says reused the reference: the claim is not evidence (no finding either)
    ev = evidence(pa=honest_pa())
    for rec in ev["records"].values():
        rec["reuse"] = "first_fit calls the package's own first_fit"
    rep = judged(ev)
    assert rep["score"] == 4.0 and coursework.status(rep) == "PASS", rep["findings"]


def _with_data(record, value):
    rec = copy.deepcopy(record)
    for o in rec["outcomes"]:
        for step in o["steps"]:
            if isinstance(step[1], dict) and "tensor" in step[1]:
                step[1]["data"] = [value] * len(step[1]["data"])
    return rec


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan"])
def test_nan_and_inf_never_pass(value):
    rep = judged(evidence(pa=_with_data(honest_pa(), value)))
    assert row(rep, "test_pa")["score"] == 0.0, row(rep, "test_pa")
    # the same through JSON, as the probe's events arrive (Python's json reads NaN and Infinity)
    rec = json.loads(json.dumps(_with_data(honest_pa(), value)))
    assert row(judged(evidence(pa=rec)), "test_pa")["score"] == 0.0


def test_a_scalar_nan_step_fails():
    rec = observed("first_fit", first_fit)
    rec["outcomes"][0]["steps"][0][1] = math.nan
    r = row(judged(evidence(ff=first_fit) | {"records": evidence()["records"] | {"test_ff/0": rec}}), "test_ff")
    assert 0 < r["score"] < 2 and r["checks"][0]["status"] == checks.FAIL


@pytest.mark.parametrize("mangle, reason", [
    (lambda r: r["outcomes"][0]["steps"][0][1].__setitem__("data", 5), "data is not"),
    (lambda r: r["outcomes"][0]["steps"][0][1].__setitem__("tensor", "big"), "shape is not"),
    (lambda r: r["outcomes"][0]["steps"][0].__setitem__(1, {1: 2}), None),
    (lambda r: r.__setitem__("outcomes", "all passed"), "no list of outcomes"),
    (lambda r: r["outcomes"].__setitem__(0, ["steps"]), "is not an object"),
    (lambda r: r["outcomes"][0].__setitem__("steps", [["only a description"]]), "[description, value] pairs"),
    (lambda r: r["outcomes"].extend(copy.deepcopy(r["outcomes"])), "outcomes for"),
    (lambda r: r["outcomes"][0]["steps"][0].__setitem__(1, 1 << 70), "64 bits"),
    (lambda r: r["outcomes"][0]["steps"].append(["padding", "x" * (9 << 20)]), "larger than"),
    (lambda r: r["outcomes"][0]["steps"].append(["deep", json.loads("[" * 40 + "]" * 40)]), "deeper"),
])
def test_malformed_or_oversized_evidence_is_a_zero_with_the_reason(mangle, reason):
    rec = honest_pa()
    mangle(rec)
    r = row(judged(evidence(pa=rec)), "test_pa")
    assert r["score"] == 0.0 and r["checks"][0]["status"] == checks.FAIL
    if reason:
        assert "not valid" in r["message"] and reason in r["message"], r["message"]


def test_events_about_calls_or_cells_the_job_lacks_are_dropped():
    ev = evidence(pa=honest_pa(), kills=[{"call": "forged/0", "case": 0, "why": "x"}, {"cell": "abc", "why": "y"},
                                         {"cell": 99, "why": "z"}, "junk"],
                  cells={"abc": {"error": None}, 77: {"error": "E"}, 1: "junk"})
    ev["records"]["forged/1"] = {"outcomes": []}
    rep = judged(ev)
    assert rep["score"] == 4.0 and not [f for f in rep["findings"] if f["kind"] == "killed"]


def test_a_failed_hidden_case_shows_no_inputs_or_expected_values():
    ev = evidence(ff=wrong_first_fit)
    rep = judged(ev)
    visible, hidden = row(rep, "test_ff")["checks"]
    assert "expected" in visible["message"]  # visible cases may show both
    assert hidden["status"] == checks.FAIL and hidden["message"].startswith("hidden case 1: FAIL"), hidden
    shown = "\n".join(verdict_lines(row(rep, "test_ff")))
    assert "first_fit([" not in hidden["message"] and "expected" not in hidden["message"]
    assert "expected" in hidden["detail"]  # kept for the instructor's JSON report
    # the kernel's own printout in a test cell with hidden cases is not kept as feedback
    ran = copy.deepcopy(SOURCE)
    ran["cells"][2]["outputs"] = [{"output_type": "stream", "name": "stdout",
                                   "text": "check first_fit (hidden cases): FAIL - expected 777, got 30\n"}]
    ran["cells"][4]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "your engine: ...\n"}]
    out = apply_to_notebook(ran, rep, SOURCE)["cells"]
    assert "expected 777" not in json.dumps(out[2]["outputs"]) and shown in out[2]["outputs"][0]["text"]
    assert out[4]["outputs"][0]["text"] == "your engine: ...\n"  # a cell without hidden cases keeps it


def test_a_symlinked_submission_or_folder_is_refused(tmp_path):
    real = tmp_path / "solutions" / "02_block_table.ipynb"
    real.parent.mkdir()
    shutil.copy(coursework.ROOT / "solutions" / "02_block_table.ipynb", real)
    (tmp_path / "alice").mkdir()
    link = tmp_path / "alice" / "02_block_table.ipynb"
    link.symlink_to(Path("..") / "solutions" / real.name)
    with pytest.raises(ValueError, match="symbolic link"):
        nbk.read(link)
    (tmp_path / "bob").symlink_to(tmp_path / "solutions")
    with pytest.raises(ValueError, match="symbolic link"):
        nbk.read(tmp_path / "bob" / "02_block_table.ipynb")
    report = coursework.grade_notebook(link, execute=False)
    assert report["score"] == 0 and "symbolic link" in report["error"] and coursework.status(report) == "ERROR"
    assert nbk.read(real)["cells"]  # a plain file still reads


def test_quick_grader_outputs_stay_out_of_submissions_and_the_repository(tmp_path, capsys):
    sub = tmp_path / "alice" / "02_block_table.ipynb"
    sub.parent.mkdir()
    shutil.copy(coursework.ROOT / "exercises" / "02_block_table.ipynb", sub)
    for args, flag in ((["--csv", str(sub.parent / "grades.csv")], "--csv"),
                       (["--feedback", str(sub.parent / "fb")], "--feedback"),
                       (["--out", str(coursework.ROOT / "graded")], "--out"),
                       (["--csv", "grades.csv"], "--csv")):
        cwd = os.getcwd()
        os.chdir(coursework.ROOT)  # the documented place an instructor types the command
        try:
            rc = coursework.main(["grade", "--unsafe-no-sandbox", "--no-execute", *args, str(sub)])
        finally:
            os.chdir(cwd)
        err = capsys.readouterr().err
        assert rc == 2 and f"refusing to grade: {flag}" in err, err
    assert not (sub.parent / "grades.csv").exists() and not (coursework.ROOT / "graded").exists()
    assert not (coursework.ROOT / "grades.csv").exists()
    out = coursework.private_dir(tmp_path / "graded" / "feedback")
    assert out.stat().st_mode & 0o777 == 0o700


# ---------------------------------------------------------------- nbgrader: test cells against what was given

def test_nbgrader_flags_tampered_test_cells_and_honest_work_is_quiet(tmp_path, monkeypatch, caplog):
    """Stage 02 released on a scratch course; nbgrader's sanitizing step and tinypaged's verifier run in-process on
    two submissions (the verifier's sandboxed checks replaced by a full-marks report: what is tested is the flow):
    the honest one logs no checksum warning and is not flagged; edited, deleted and re-pointed test cells are
    FLAGGED, each named, and graded from the instructor's cells (full marks for the same correct code)."""
    import logging

    import nbformat
    from nbgrader.utils import determine_grade

    from tinypaged.course.grading import nbgrader_verify, verify

    assignment = "02_block_table"
    course = tmp_path / "course"
    monkeypatch.delenv("TINYPAGED_EXCHANGE", raising=False)
    coursework.release(course, [coursework.ROOT / "solutions" / f"{assignment}.ipynb"])
    solution = nbk.read(coursework.ROOT / "solutions" / f"{assignment}.ipynb")
    released = nbk.read(course / "release" / assignment / f"{assignment}.ipynb")
    tests = [i for i, c in enumerate(released["cells"]) if nbk.is_test(c)]
    honest = copy.deepcopy(released)  # the released notebook with the solution cells' code filled in
    sol = {nbk.grade_id(c): nbk.source_of(c) for c in solution["cells"] if nbk.is_solution(c)}
    for c in honest["cells"]:
        if nbk.is_solution(c) and nbk.grade_id(c) in sol:
            c["source"] = sol[nbk.grade_id(c)]
    mallory = copy.deepcopy(honest)
    edited, repointed, deleted = (nbk.grade_id(mallory["cells"][i]) for i in tests[:3])
    mallory["cells"][tests[0]]["source"] = "print('PASS')"
    mallory["cells"][tests[1]]["metadata"]["nbgrader"]["points"] = 100
    del mallory["cells"][tests[2]]
    mallory["metadata"]["tinypaged"]["tampered"] = []  # the submission's own say is overwritten
    eve = copy.deepcopy(honest)  # another stage's notebook handed in as this one: refused, not graded
    eve["metadata"]["tinypaged"]["stage"] = "06"

    full = [{"grade_id": nbk.grade_id(c), "cell": i, "points": nbk.points(c), "score": nbk.points(c),
             "status": checks.PASS, "message": "", "checks": []}
            for i, c in enumerate(solution["cells"]) if nbk.is_test(c)]
    auto = sum(t["points"] for t in full)
    monkeypatch.setattr(verify, "grade", lambda *a, **k: {
        "score": auto, "max_score": auto, "tests": copy.deepcopy(full), "findings": [], "errors": [], "manual": [],
        "manual_points": 0.0})
    log = logging.getLogger("tinypaged-sealed-judge")
    reports = {}
    for student, sub in (("alice", honest), ("mallory", mallory), ("eve", eve)):
        resources = {"nbgrader": {"db_url": f"sqlite:///{course / 'gradebook.db'}", "assignment": assignment,
                                  "notebook": assignment, "student": student},
                     "metadata": {"path": str(course / "autograded" / student / assignment)}}
        sanitize = nbgrader_verify.CompareGivenCells(log=log)
        caplog.clear()
        with caplog.at_level(logging.DEBUG - 1, logger=log.name):
            nb, resources = sanitize.preprocess(nbformat.reads(json.dumps(sub), as_version=4), resources)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        nb = nbformat.reads(nbformat.writes(nb), as_version=4)  # written to autograded/ and read back, as nbgrader does
        nb, resources = nbgrader_verify.VerifyChecks(log=log).preprocess(nb, resources)
        reports[student] = resources["tinypaged"]["report"]
        got = sum(determine_grade(c)[0] or 0 for c in nb.cells if nbk.nbgrader_meta(c).get("grade"))
        assert got == (0 if student == "eve" else auto), (student, got)  # from the instructor's cells and points
        if student == "alice":
            assert warnings == [], warnings  # no "checksum has changed" for an honest notebook
    assert coursework.status(reports["alice"]) == "PASS" and coursework.summary(reports["alice"]) == ""
    line = coursework.summary(reports["mallory"])
    assert coursework.status(reports["mallory"]) == "FLAGGED", line
    for gid, what in ((edited, "its code was edited"), (repointed, "its points changed"), (deleted, "deleted")):
        assert f"test cell '{gid}': {what}" in line, (gid, line)
    assert coursework.status(reports["eve"]) == "ERROR" and "stage 06 notebook, not stage 02" in reports["eve"]["error"]


def test_nbgrader_feedback_leaves_the_hidden_tests_out():
    from traitlets.config.loader import PyFileConfigLoader

    cfg = PyFileConfigLoader(coursework.CONFIG.name, path=str(coursework.CONFIG.parent)).load_config()
    names = [p.__name__ for p in cfg.GenerateFeedback.preprocessors]
    assert "ClearHiddenTests" in names and names.index("ClearHiddenTests") > names.index("GetGrades")
    assert "CompareGivenCells" in [p.__name__ for p in cfg.Autograde.sanitize_preprocessors]
