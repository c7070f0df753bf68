"""The grader on real submissions, each run in its own kernel: the solutions get full marks, the untouched
exercises none, and the fixture submissions (tests/fixtures/submissions) the grades they state.

Three CLI runs: solutions + exercises (two notebooks at a time, default time limits), the renamed
stage-1 solution alone (exit status 0; the first run skips that solution), then the attacks with a
15-second cell limit (the infinite loop must time out).
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinypaged.course import coursework
from tinypaged.course.grading import notebook as nbk

ROOT = coursework.ROOT
FIXTURES = ROOT / "tests" / "fixtures" / "submissions"


def build(spec: dict, where: Path) -> Path:
    base = nbk.read(ROOT / spec["base"])
    nb = copy.deepcopy(base)
    stage = nbk.stage_of(base)
    solution = nbk.read(nbk.source_for_stage(stage, ROOT / "solutions"))
    by_id = {nbk.grade_id(c): c for c in nb["cells"] if nbk.grade_id(c)}
    for gid, src in spec.get("replace", {}).items():
        if src == "@solution":
            src = next(nbk.source_of(c) for c in solution["cells"] if nbk.grade_id(c) == gid)
        by_id[gid]["source"] = src
    for gid, src in spec.get("insert_after", []):
        at = nb["cells"].index(by_id[gid]) + 1
        nb["cells"].insert(at, {"cell_type": "code", "metadata": {}, "source": src, "outputs": [],
                                "execution_count": None})
    path = where / spec["fixture"] / spec["name"]
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(nb))
    return path


def grade(paths, *args):
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, "-m", "tinypaged.course.coursework", "grade", "--json", "--jobs", "2", *args,
                           *map(str, paths)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    return proc.returncode, json.loads(proc.stdout)


def fixtures():
    return [dict(json.loads(p.read_text()), fixture=p.stem) for p in sorted(FIXTURES.glob("*.json"))]


def check_expectations(spec, report):
    exp = spec["expect"]
    assert not report.get("error"), report.get("error")
    if exp["score"] == "full":
        assert report["score"] == report["max_score"] > 0, report
    else:
        assert report["score"] == exp["score"], [(t["grade_id"], t["score"], t["message"]) for t in report["tests"]]
    rows = {t["grade_id"]: t for t in report["tests"]}
    for gid, (points, text) in exp["tests"].items():
        assert rows[gid]["score"] == points, (spec["fixture"], gid, rows[gid])
        assert text in rows[gid]["message"] + json.dumps(rows[gid]["checks"]), (spec["fixture"], gid, rows[gid])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    where = tmp_path_factory.mktemp("submissions")
    return {spec["fixture"]: (spec, build(spec, where)) for spec in fixtures()}


def test_solutions_full_marks_exercises_none(built, tmp_path):
    renamed_base = ROOT / built["renamed_solution"][0]["base"]  # graded (renamed) by the next test
    sols = [s for s, _ in coursework.pairs() if s != renamed_base]
    exs = [e for _, e in coursework.pairs()]
    csv = tmp_path / "grades.csv"
    rc, reports = grade(sols + exs, "--csv", str(csv))
    assert rc == 1  # the exercises score nothing, so not everything passes
    by_path = {r["notebook"]: r for r in reports}
    for sol in sols:
        r = by_path[str(sol)]
        assert r["score"] == r["max_score"] > 0 and not r["errors"], (sol.name, coursework.format_report(r))
    for ex in exs:
        r = by_path[str(ex)]
        assert r["score"] == 0 and r["max_score"] > 0 and not r.get("error"), (ex.name, coursework.format_report(r))
        assert all(t["status"] == "not implemented yet" for t in r["tests"]), coursework.format_report(r)
    rows = [line.split(",") for line in csv.read_text().splitlines()]
    assert rows[0][:4] == ["notebook", "stage", "grade_id", "score"]
    totals = {row[0]: row for row in rows if row[2] == "TOTAL"}
    assert totals[str(sols[0])][5] == "PASS" and totals[str(exs[0])][5] == "FAIL"


def test_renamed_file_is_graded_by_its_metadata_and_passes(built):
    spec, renamed = built["renamed_solution"]
    proc = subprocess.run([sys.executable, "-m", "tinypaged.course.coursework", "grade", str(renamed)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # everything passes: exit status 0
    first, second = proc.stdout.splitlines()[:2]
    assert first.startswith(f"{renamed}: ") and second.strip().startswith(f"stage {spec['base'][10:12]}")
    assert "check serve_" in proc.stdout and "FAIL" not in proc.stdout


def test_attacks_get_the_grades_their_fixtures_state(built):
    attacks = {k: v for k, v in built.items() if k != "renamed_solution"}
    rc, reports = grade([p for _, p in attacks.values()], "--timeout", "15")
    assert rc == 1
    by_path = {r["notebook"]: r for r in reports}
    for spec, path in attacks.values():
        check_expectations(spec, by_path[str(path)])


def test_a_file_that_is_not_a_notebook_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tinypaged.course.coursework", "grade", str(tmp_path / "missing.ipynb")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1 and "not a readable notebook" in proc.stdout
