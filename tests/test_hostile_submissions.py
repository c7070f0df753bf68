"""Hostile submissions (tests/fixtures/submissions/*.json), graded by both graders: none gains a point, none reads
the answers or writes outside its scratch directory, and the honest ones keep full marks.

Each fixture is an edit of a generated exercise or a solution (see tests/fixtures/submissions/README.md;
``remark`` also rewrites a cell's nbgrader metadata, ``@ROOT@``, ``@COURSE@``, ``@SUBMISSIONS@`` and ``@MARK@``
stand for the repository, the course folder, the submissions' folder and a file no sandbox may create).
``run: code`` fixtures attack the grade through the solution cells (graded without the feedback run);
``run: kernel`` ones attack the learner's kernel (added cells: only the feedback run executes them).
Limits are small here (10 CPU seconds per check, 30 for the serving check) so the hangs cost little.
The ``run: kernel`` fixtures, the escape cell's own printout and the crashes are in
tests/test_hostile_submissions_kernel.py (a second file: pytest-xdist's ``--dist loadfile`` runs the two on both
workers); the helpers here serve both, and tests/test_instructors.py.
"""

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tinypaged.course import coursework
from tinypaged.course.grading import notebook as nbk

ROOT = coursework.ROOT
FIXTURES = ROOT / "tests" / "fixtures" / "submissions"
# a hang in the serving check costs its whole budget (300 CPU s by default; an honest one uses a few)
# (honest stage-2 and stage-3 work: the whole submission in 12-19 s of wall time on the project's slower AMD machine)
LIMITS = ["--cpu-timeout", "10", "--serving-cpu-timeout", "30", "--timeout", "60", "--idle", "30"]
WATCHED = [ROOT / "tinypaged" / "course" / "checks" / "stage02.py", ROOT / "solutions" / "02_block_table.ipynb"]

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def specs(run=None):
    out = [dict(json.loads(p.read_text()), fixture=p.stem) for p in sorted(FIXTURES.glob("*.json"))]
    return [s for s in out if run is None or s["run"] == run]


def build(spec: dict, path: Path, places: dict) -> Path:
    base = nbk.read(ROOT / spec["base"])
    stage = nbk.stage_of(base)
    solution = nbk.read(nbk.source_for_stage(stage, ROOT / "solutions"))
    sol_src = {nbk.grade_id(c): nbk.source_of(c) for c in solution["cells"] if nbk.grade_id(c)}
    by_id = {nbk.grade_id(c): c for c in base["cells"] if nbk.grade_id(c)}

    def fill(src):
        for k, v in places.items():
            src = src.replace(k, str(v))
        return src

    for gid, src in spec.get("replace", {}).items():
        by_id[gid]["source"] = fill(src.replace("@solution", sol_src[gid]))
    for gid, meta in spec.get("remark", {}).items():
        by_id[gid]["metadata"]["nbgrader"].update(meta)
    for gid, src in spec.get("insert_after", []):
        at = base["cells"].index(by_id[gid]) + 1
        base["cells"].insert(at, {"cell_type": "code", "metadata": {}, "source": fill(src), "outputs": [],
                                  "execution_count": None})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(base))
    return path


def digest(paths) -> dict:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def grade(paths, *args, timeout=3600):  # a last resort: a loaded machine is slow, never wrong
    proc = subprocess.run([sys.executable, "-m", "tinypaged.course", "grade", "--json", *args, *map(str, paths)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=dict(os.environ, PYTHONHASHSEED="0"))
    assert proc.stdout.strip().startswith("["), proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.returncode, {Path(r["notebook"]).parent.name: r for r in json.loads(proc.stdout)}


def check(spec, report, score, grader="quick"):
    print(f"TABLE {spec['fixture']} expected={spec['expect']['score']} {grader}={score} "
          f"seconds={report.get('seconds')}")
    exp = spec["expect"]
    rows = {t["grade_id"]: t for t in report["tests"]}
    detail = (spec["fixture"], coursework.format_report(report))
    assert not report.get("error"), detail
    assert score == exp["score"], detail
    for gid, (points, text) in exp.get("tests", {}).items():
        assert rows[gid]["score"] == points, detail
        assert text in rows[gid]["message"] + json.dumps(rows[gid]["checks"]), detail
    if "finding" in exp:
        assert exp["finding"] in coursework.summary(report), detail


def test_code_attacks_gain_nothing_and_honest_work_keeps_full_marks(tmp_path):
    before = digest(WATCHED)
    paths = [build(s, tmp_path / s["fixture"] / s["name"], {"@ROOT@": ROOT}) for s in specs("code")]
    rc, reports = grade(paths, "--no-execute", "--jobs", "2", "--csv", str(tmp_path / "grades.csv"), *LIMITS)
    assert rc == 1
    failed = []
    for spec in specs("code"):
        try:
            check(spec, reports[spec["fixture"]], reports[spec["fixture"]]["score"])
        except AssertionError as e:  # report every submission that went wrong, not only the first
            failed.append(str(e))
    assert not failed, "\n\n".join(failed)
    rows = {Path(r["notebook"]).parent.name: r for r in csv.DictReader(open(tmp_path / "grades.csv"))}
    assert len(rows) == len(specs("code"))  # one line per submission
    assert rows["honest_solution_renamed"]["status"] == "PASS" and rows["untouched"]["status"] == "FAIL"
    # the reference is not in the sandbox: reusing it fails like any wrong answer, with nothing to flag
    assert rows["reuse_hidden_from_scan"]["status"] == "FAIL"
    assert "killed" in rows["hang_in_check"]["findings"] and "gather_kv" in rows["hang_in_check"]["findings"]
    assert rows["honest_solution_renamed"]["written_max"] == "4" and rows["honest_solution_renamed"]["auto_max"] == "12"
    assert digest(WATCHED) == before


def test_the_sandbox_hides_the_answers_and_allows_writes_only_to_its_scratch(tmp_path):
    """The sandbox itself, with a shell: cheap, and independent of the notebooks."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    subs = tmp_path / "submissions"
    subs.mkdir()
    (subs / "bob.ipynb").write_text("{}")
    box = coursework.sandbox_factory(coursework.hidden_paths([subs / "bob.ipynb"]))(scratch)
    script = "; ".join([
        f"ls {ROOT}/solutions | wc -l",  # empty
        f"cat {subs}/bob.ipynb 2>/dev/null || echo no-submissions",
        f"touch {ROOT}/tinypaged/x 2>/dev/null || echo no-package-write",
        f"touch {Path.home()}/x 2>/dev/null || echo no-home-write",
        f"touch {tmp_path}/x 2>/dev/null || echo no-outside-write",
        "touch ./ok && echo scratch-write",
        "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=2)' 2>/dev/null "
        "|| echo no-network",
        "id -u",
    ])
    with box:
        out = subprocess.run(box.command(["bash", "-c", script]), capture_output=True, text=True, timeout=60,
                             cwd=scratch).stdout.split()
    assert out[:7] == ["0", "no-submissions", "no-package-write", "no-home-write", "no-outside-write",
                       "scratch-write", "no-network"], out
    if os.geteuid() == 0:
        assert out[7] == "65534"  # nobody
    assert not (ROOT / "tinypaged" / "x").exists() and not (tmp_path / "x").exists()


def test_an_environment_under_tmp_is_readable_inside_and_nothing_else_there(tmp_path, monkeypatch):
    """A Python environment under /tmp (a clone in /tmp, say) is bound in, read-only, over the sandbox's empty /tmp;
    its neighbours are not there."""
    from tinypaged.course.grading import sandbox

    env, other, scratch = tmp_path / "env", tmp_path / "other", tmp_path / "scratch"
    for d in (env, other, scratch):
        d.mkdir()
    (env / "marker").write_text("env-visible\n")
    (other / "marker").write_text("other-visible\n")
    real = sandbox._python_paths
    monkeypatch.setattr(sandbox, "_python_paths", lambda: real() + [env])
    box = coursework.sandbox_factory(coursework.hidden_paths())(scratch)
    script = f"cat {env}/marker; cat {other}/marker 2>/dev/null || echo other-hidden; touch {env}/x 2>/dev/null || echo ro"
    with box:
        out = subprocess.run(box.command(["bash", "-c", script]), capture_output=True, text=True, timeout=60,
                             cwd=scratch).stdout.split()
    assert out == ["env-visible", "other-hidden", "ro"], out
