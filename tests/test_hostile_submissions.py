"""Hostile submissions (tests/fixtures/submissions/*.json), graded by both graders: none gains a point, none reads
the answers or writes outside its scratch directory, and the honest ones keep full marks.

Each fixture is an edit of a generated exercise or a solution (see tests/fixtures/submissions/README.md;
``remark`` also rewrites a cell's nbgrader metadata, ``@ROOT@``, ``@COURSE@``, ``@SUBMISSIONS@`` and ``@MARK@``
stand for the repository, the course folder, the submissions' folder and a file no sandbox may create).
``run: code`` fixtures attack the grade through the solution cells (graded without the feedback run);
``run: kernel`` ones attack the learner's kernel (added cells: only the feedback run executes them).
Limits are small here (20 CPU seconds per check) so the hangs cost little.
"""

import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tinypaged.course import coursework
from tinypaged.course.grading import notebook as nbk

ROOT = coursework.ROOT
FIXTURES = ROOT / "tests" / "fixtures" / "submissions"
LIMITS = ["--cpu-timeout", "20", "--timeout", "90", "--idle", "60"]
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


def test_kernel_attacks_gain_nothing_and_stay_in_their_sandbox(tmp_path):
    before = digest(WATCHED)
    subs = tmp_path / "submissions"
    mark = tmp_path / "ESCAPED"
    places = {"@ROOT@": ROOT, "@COURSE@": ROOT / "course", "@SUBMISSIONS@": subs, "@MARK@": mark}
    kernel = specs("kernel")
    paths = [build(s, subs / s["fixture"] / s["name"], places) for s in kernel]
    # the untouched exercise right after the patch attempt: a patched package would raise its score
    paths.insert(paths.index(subs / "patch_package" / "02_block_table.ipynb") + 1,
                 build(json.loads((FIXTURES / "untouched.json").read_text()),
                       subs / "after_patch" / "02_block_table.ipynb", places))
    feedback = tmp_path / "feedback"
    rc, reports = grade(paths, "--jobs", "2", "--feedback", str(feedback), *LIMITS)
    assert rc == 1
    failed = []
    for spec in kernel:
        try:
            check(spec, reports[spec["fixture"]], reports[spec["fixture"]]["score"])
        except AssertionError as e:
            failed.append(str(e))
    assert not failed, "\n\n".join(failed)
    assert reports["after_patch"]["score"] == 0
    assert not mark.exists() and digest(WATCHED) == before
    html = (feedback / "escape_attempts-02_block_table.html").read_text()  # the learner's feedback
    assert "ESCAPE RESULTS" in html and "test_serve: 2/2 PASS" in html
    assert "BEGIN HIDDEN TESTS" not in html and "hidden=5201" not in html


def test_escape_attempts_all_fail_inside_the_sandbox(tmp_path):
    """The escape cell's own printout (the feedback run), read from the executed notebook."""
    from tinypaged.course.grading.execute import run_notebook

    subs = tmp_path / "submissions"
    subs.mkdir()
    (subs / "someone_else.ipynb").write_text("{}")
    mark = tmp_path / "ESCAPED"
    spec = json.loads((FIXTURES / "escape_attempts.json").read_text())
    path = build(spec, subs / "mine" / "02_block_table.ipynb",
                 {"@ROOT@": ROOT, "@COURSE@": ROOT / "course", "@SUBMISSIONS@": subs, "@MARK@": mark})
    sub = nbk.read(path)
    source = nbk.read(ROOT / "solutions" / "02_block_table.ipynb")
    cells = [c for c in source["cells"] if nbk.grade_id(c) == "setup"]
    run = {**sub, "cells": cells + [c for c in nbk.assemble(source, sub)["cells"] if "ESCAPE RESULTS" in nbk.source_of(c)]}
    make = coursework.sandbox_factory(coursework.hidden_paths([path, subs / "someone_else.ipynb"]))
    executed = run_notebook(run, make, cell_timeout=120, cell_cpu=60)
    text = "".join(o.get("text", "") for c in executed["cells"] for o in c.get("outputs", []))
    m = re.search(r"ESCAPE RESULTS (\[.*\])", text)
    assert m, text
    results = dict(eval(m.group(1)))  # noqa: S307  (the list of pairs the cell printed)
    assert set(results) == {"read solutions", "list course source", "list other submissions", "write package",
                            "write gradebook", "write outside scratch", "network"}
    assert "DONE" not in results.values(), results
    assert not mark.exists()


def test_a_crash_or_exit_costs_only_its_own_step():
    """The checks' process dies three ways (SIGABRT in a check, as a Triton store out of bounds does; os._exit in
    a solution cell; os._exit in a check): each costs only its step, names it, and the other checks keep their points
    (read by the probe alone: the static reading would already refuse ``import os``)."""
    from tinypaged.course.grading import verify

    sol = nbk.read(ROOT / "solutions" / "01_contiguous_kv_cache.ipynb")
    keep = {"setup", "reservation_tokens", "test_reservation_tokens", "first_fit", "test_first_fit", "free_holes",
            "test_free_holes"}
    source = {**sol, "cells": [c for c in sol["cells"] if nbk.grade_id(c) in keep]}
    sub = json.loads(json.dumps(source))
    by_id = {nbk.grade_id(c): c for c in sub["cells"]}
    by_id["free_holes"]["source"] = "def free_holes(regions, capacity):\n    import os\n    os.abort()\n"
    by_id["first_fit"]["source"] = "import os\nos._exit(0)\n"  # the last solution cell
    job = verify.build_job(source, sub, "01", cell_cpu=60, check_cpu=60)
    from tinypaged.course.grading.evidence import gather

    ev = gather(job, coursework.sandbox_factory(coursework.hidden_paths()))
    rep = verify.score(source, job, [], ev)
    rows = {t["grade_id"]: t for t in rep["tests"]}
    assert rows["test_reservation_tokens"]["score"] == rows["test_reservation_tokens"]["points"] > 0, rows
    assert rows["test_free_holes"]["score"] == 0 and "SIGABRT" in rows["test_free_holes"]["message"], rows
    assert rows["test_first_fit"]["score"] == 0 and "not run" in rows["test_first_fit"]["message"], rows
    kills = " ".join(f["what"] for f in rep["findings"] if f["kind"] == "killed")
    assert "(first_fit)" in kills and "did not run" in kills and "check free_holes" in kills, kills


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
