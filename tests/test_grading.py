"""The quick grader on honest work, run for real (sandboxed feedback run included): the stage 2, 3 and 8
solutions get full marks, their untouched exercises none, with one CSV line per submission and HTML
feedback; a file that is not a notebook is an error; without bubblewrap grading refuses unless told
--unsafe-no-sandbox, which warns. The attacks are in tests/test_hostile_submissions.py."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tinypaged.course import coursework

ROOT = coursework.ROOT
STAGES = ("02_block_table", "03_prefix_sharing", "08_serve_over_http")  # small stages (08: a live server)


def grade(paths, *args, env=None):
    proc = subprocess.run([sys.executable, "-m", "tinypaged.course", "grade", "--json", *args, *map(str, paths)],
                          capture_output=True, text=True, cwd=ROOT, timeout=3600,
                          env=env or dict(os.environ, PYTHONHASHSEED="0"))
    return proc


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_solutions_full_marks_exercises_none_with_feedback(tmp_path):
    sols = [ROOT / "solutions" / f"{s}.ipynb" for s in STAGES]
    exs = [ROOT / "exercises" / f"{s}.ipynb" for s in STAGES]
    proc = grade(sols + exs, "--jobs", "2", "--csv", str(tmp_path / "grades.csv"), "--feedback", str(tmp_path / "fb"))
    assert proc.returncode == 1, proc.stderr[-3000:]  # the exercises score nothing
    reports = {r["notebook"]: r for r in json.loads(proc.stdout)}
    for sol in sols:
        r = reports[str(sol)]
        assert r["score"] == r["max_score"] > 0 and not r["errors"], coursework.format_report(r)
        assert not coursework.summary(r), coursework.summary(r)  # nothing found, nothing killed
    for ex in exs:
        r = reports[str(ex)]
        assert r["score"] == 0 and r["max_score"] > 0 and not r.get("error"), coursework.format_report(r)
        assert all(t["status"] == "not implemented yet" for t in r["tests"]), coursework.format_report(r)
    rows = list(csv.DictReader(open(tmp_path / "grades.csv")))
    assert [r["notebook"] for r in rows] == [str(p) for p in sols + exs]  # one line per submission
    first = rows[0]
    assert (first["status"], first["auto_score"], first["auto_max"], first["written_max"]) == ("PASS", "12", "12", "4")
    assert rows[len(sols)]["status"] == "FAIL"
    html = (tmp_path / "fb" / "solutions-02_block_table.html").read_text()
    assert "your engine :" in html and "transformers:" in html and "calls through your code:" in html  # the payoff
    assert "test_serve: 2/2 PASS" in html and "hidden=" not in html


def test_a_file_that_is_not_a_notebook_is_an_error(tmp_path):
    proc = grade([tmp_path / "missing.ipynb"], "--unsafe-no-sandbox")
    assert proc.returncode == 1 and "not a readable notebook" in proc.stdout


def test_without_bubblewrap_grading_refuses_unless_told_unsafe(tmp_path):
    env = dict(os.environ, PATH=str(Path(sys.executable).parent))  # no bwrap on PATH
    proc = grade([ROOT / "exercises" / "02_block_table.ipynb"], env=env)
    assert proc.returncode == 2 and "refusing to grade: no sandbox" in proc.stderr
    proc = grade([ROOT / "exercises" / "02_block_table.ipynb"], "--unsafe-no-sandbox", "--no-execute", env=env)
    assert "WARNING: grading WITHOUT a sandbox" in proc.stderr
    assert json.loads(proc.stdout)[0]["score"] == 0
