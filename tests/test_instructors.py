"""docs/INSTRUCTORS.md's commands, verbatim, on a scratch course: release with nbgrader's generate_assignment,
collected submissions (honest ones and attacks on nbgrader's path: tests/fixtures/submissions), nbgrader
autograde (sandboxed run, tinypaged's verifier) and nbgrader export to CSV. Nobody gains a point, nobody
changes the course (source/, the gradebook's other rows, other submissions) or writes outside its scratch."""

import csv
import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tinypaged.course import coursework
from tinypaged.course.grading import notebook as nbk

ROOT = coursework.ROOT
DOC = ROOT / "docs" / "INSTRUCTORS.md"
FIXTURES = ROOT / "tests" / "fixtures" / "submissions"
# attacks on the learner's kernel and on nbgrader's own trust in the notebook's metadata
# (the other attacks are the quick grader's in tests/test_hostile_submissions.py: the same verifier grades both)
HOSTILE = ("forged_records", "remarked_metadata", "escape_attempts", "os_exit_half_way")

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def block(tag: str) -> str:
    m = re.search(rf"<!-- ci: {tag} -->\n```bash\n(.*?)```", DOC.read_text(), re.S)
    assert m, f"docs/INSTRUCTORS.md has no '<!-- ci: {tag} -->' bash block"
    return m.group(1)


def run(script: str, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=5400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_release_collect_autograde_export(tmp_path):
    from test_hostile_submissions import build  # the fixtures' builder

    course = tmp_path / "course"
    env = dict(os.environ, TINYPAGED_COURSE=str(course), TINYPAGED_EXCHANGE=str(tmp_path / "exchange"),
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    release = block("release")
    assignment = re.search(r"export ASSIGNMENT=(\S+)", release).group(1)
    run(release, env)
    released = course / "release" / assignment / f"{assignment}.ipynb"
    assert released.exists()

    # collect: alice hands in the solution, bob the untouched notebook, and the attacks
    submitted = course / "submitted"
    mark = tmp_path / "ESCAPED"
    places = {"@ROOT@": ROOT, "@COURSE@": course, "@SUBMISSIONS@": submitted, "@MARK@": mark}
    expected = {"alice": None, "bob": 0.0}
    for student, nb in (("alice", ROOT / "solutions" / f"{assignment}.ipynb"), ("bob", released)):
        dest = submitted / student / assignment / f"{assignment}.ipynb"
        dest.parent.mkdir(parents=True)
        shutil.copy(released, dest)
        if student == "alice":  # what an honest student hands in: the released notebook, its answers written in
            answers = {nbk.grade_id(c): c["source"] for c in nbk.read(nb)["cells"] if nbk.is_solution(c)}
            handed = json.loads(dest.read_text())
            for cell in handed["cells"]:
                if nbk.is_solution(cell) and nbk.grade_id(cell) in answers:
                    cell["source"] = answers[nbk.grade_id(cell)]
            dest.write_text(json.dumps(handed))
    specs = {name: json.loads((FIXTURES / f"{name}.json").read_text()) for name in HOSTILE}
    for name, spec in specs.items():
        assert spec["base"].endswith(f"{assignment}.ipynb"), "the nbgrader attacks are written for this assignment"
        build(spec, submitted / name / assignment / f"{assignment}.ipynb", places)
        expected[name] = float(spec["expect"]["score"])
    source_before = digest(course / "source")
    submitted_before = digest(submitted)

    grading = run(f"export ASSIGNMENT={assignment}\n" + block("grade") + "\n", env)
    rows = {r["student_id"]: r for r in csv.DictReader(open(course / "grades.csv"))}
    source = nbk.read(ROOT / "solutions" / f"{assignment}.ipynb")
    auto = sum(nbk.points(c) for c in source["cells"] if nbk.is_test(c))
    written = sum(nbk.points(c) for c in source["cells"] if nbk.is_manual(c))
    expected["alice"] = auto
    for student, score in expected.items():
        r = rows[student]
        print(f"TABLE {student} expected={score:g} nbgrader={r['auto_score']} status={r['status']}")
        assert float(r["auto_score"]) == score, (student, r)
        assert float(r["auto_max"]) == auto and float(r["written_max"]) == written, r
        assert float(r["max_score"]) == auto + written
    assert rows["alice"]["status"] == "WRITTEN ANSWERS TO GRADE" and rows["alice"]["findings"].endswith(
        "nothing found (automatic 12/12; written answers graded by hand)")
    assert "killed" in rows["os_exit_half_way"]["findings"]  # the feedback run's death is on the submission's line
    assert "tamper" in rows["remarked_metadata"]["findings"] and rows["remarked_metadata"]["status"] == "FLAGGED"
    # nothing outside the scratch directories changed
    assert not mark.exists()
    assert digest(course / "source") == source_before and digest(submitted) == submitted_before
    with sqlite3.connect(course / "gradebook.db") as db:  # the gradebook holds what autograde stored, no more
        assert db.execute("select count(*) from submitted_assignment").fetchone()[0] == len(expected)
    assert "Traceback" not in grading.stderr[-5000:]
    # nbgrader's checksum includes the hidden tests, so it warned for every test cell of every honest notebook;
    # tinypaged compares with the released cells instead and names only real edits (tests/test_sealed_judge.py)
    assert "Attribute 'checksum'" not in grading.stdout + grading.stderr
