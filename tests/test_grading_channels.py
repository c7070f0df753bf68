"""What crosses between a submission's sandbox and the root grader, and the limits on one submission (#45, #49).

* files a learner controls are read without following links, only when regular, with a size cap (a FIFO named
  like a notebook cannot hang the grader);
* the feedback run needs no writable host folder: the notebook goes in on stdin, the cells come back as frames
  read with a byte cap; every writable path inside is a size-limited tmpfs (``/dev/shm`` too);
* one submission has a firm wall-clock and CPU ceiling across all its sandboxes (its cgroups are killed);
* the stage comes from the assignment's file name, never from ``metadata.tinypaged.stage``;
* a ``.venv`` that is a symbolic link works inside the sandbox, and an interpreter that cannot start is said in
  one line with the real maximum score;
* nbgrader: a submission folder with a link or an extra file is refused (FLAGGED, 0, named) and nothing but the
  notebook is copied; a failure of nbgrader's own steps is a FAILED row with its reason;
* the feedback HTML keeps no learner ``<script>``, event handler or ``javascript:`` link.

Cheap on purpose: hand-made notebooks, no model, the checks' process replaced where only the flow is tested.
"""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tinypaged.course import coursework
from tinypaged.course.grading import notebook as nbk
from tinypaged.course.grading import sandbox as sbx

ROOT = coursework.ROOT
ASSIGNMENT = "02_block_table"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
needs_cgroups = pytest.mark.skipif(os.geteuid() != 0 or sbx.cgroups_available() is not None,
                                   reason=f"no cgroup per submission here: {sbx.cgroups_available()}")


def cell(src: str) -> dict:
    return {"cell_type": "code", "metadata": {}, "source": src, "outputs": [], "execution_count": None}


def notebook(*sources: str, stage: str = "02") -> dict:
    return {"cells": [cell(s) for s in sources], "nbformat": 4, "nbformat_minor": 5,
            "metadata": {"tinypaged": {"stage": stage},
                         "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}


class Alarm:
    """Fail (instead of hanging the suite) when the block takes longer than ``seconds``: today's grader blocks
    forever on a FIFO."""

    def __init__(self, seconds: int):
        self.seconds = seconds

    def __enter__(self):
        def fail(*_):
            raise TimeoutError(f"blocked for more than {self.seconds} s")

        self.old = signal.signal(signal.SIGALRM, fail)
        signal.alarm(self.seconds)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.old)


# ---------------------------------------------------------------- reading what a learner controls

def test_a_fifo_a_device_link_or_a_huge_file_handed_in_is_refused_quickly(tmp_path):
    fifo = tmp_path / "fifo" / f"{ASSIGNMENT}.ipynb"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    with Alarm(5), pytest.raises(ValueError, match="not a regular file"):
        nbk.read(fifo)
    huge = tmp_path / "huge" / f"{ASSIGNMENT}.ipynb"
    huge.parent.mkdir()
    with open(huge, "wb") as f:
        f.truncate(nbk.MAX_NOTEBOOK_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ValueError, match="over the limit"):
        nbk.read(huge)
    link = tmp_path / "zero"
    link.symlink_to("/dev/zero")
    with Alarm(5), pytest.raises(ValueError, match="symbolic link"):
        nbk.read_capped(link)


# ---------------------------------------------------------------- the stage is the assignment's

def test_the_stage_comes_from_the_file_name_never_the_metadata(tmp_path, monkeypatch):
    """A stage-6 notebook handed in as 02_block_table.ipynb is graded as stage 02 (today: as stage 06, which it
    solves: full marks); a name that names no assignment is refused in one line."""
    from tinypaged.course.grading import verify

    seen = {}

    def fake_grade(source, sub, stage, make, **kw):
        seen.update(stage=stage, source_stage=source["metadata"]["tinypaged"]["stage"])
        return {"stage": stage, "score": 0.0, "max_score": 1.0, "tests": [], "errors": [], "findings": [],
                "manual": [], "manual_points": 0.0}

    monkeypatch.setattr(verify, "grade", fake_grade)
    six = nbk.read(ROOT / "solutions" / "06_serving_and_knobs.ipynb") \
        if (ROOT / "solutions" / "06_serving_and_knobs.ipynb").exists() else notebook("x = 1", stage="06")
    six["metadata"].setdefault("tinypaged", {})["stage"] = "06"
    handed = tmp_path / "alice" / f"{ASSIGNMENT}.ipynb"
    handed.parent.mkdir()
    handed.write_text(json.dumps(six))
    report = coursework.grade_notebook(handed, unsafe=True, execute=False)
    assert seen == {"stage": "02", "source_stage": "02"}, seen
    assert report["stage"] == "02" and any(f["kind"] == "stage" for f in report["findings"]), report

    other = tmp_path / "bob" / "homework.ipynb"
    other.parent.mkdir()
    other.write_text(json.dumps(six))
    report = coursework.grade_notebook(other, unsafe=True, execute=False)
    assert "names no assignment" in report["error"] and "\n" not in report["error"], report
    assert coursework.status(report) == "ERROR"


# ---------------------------------------------------------------- the feedback run's channel

@needs_bwrap
def test_the_feedback_run_writes_no_host_folder_and_its_output_is_capped(tmp_path, monkeypatch):
    """No /io inside; /dev/shm, /tmp and the working directory are tmpfs of ``scratch_mb``; cells come back as
    frames (a line the kernel forges on fd 1 is only printed text); a flood of output stops the run with the
    reason, keeping the cells before it."""
    from tinypaged.course.grading import execute

    monkeypatch.setattr(execute, "MAX_FRAMES_BYTES", 1 << 20)
    probe = ("import os, subprocess\n"
             "print('io' in os.listdir('/'))\n"
             "print(subprocess.run(['df', '-m', '--output=size,target', '/dev/shm', '/tmp', '.'], capture_output=True,"
             " text=True).stdout.split())\n"
             "os.write(1, b'{\"cell\": 1, \"outputs\": [], \"nonce\": \"guess\"}\\n')")
    flood = "print('x' * (3 << 20))"
    after = "print('never')"
    nb = notebook(probe, flood, after)

    def make(scratch):
        return sbx.Sandbox(scratch, scratch_mb=16, memory_bytes=2 << 30)

    t0 = time.monotonic()
    out = execute.run_notebook(nb, make, cell_timeout=60, total_timeout=120, cell_cpu=60, stage="02")
    assert time.monotonic() - t0 < 90
    first = "".join(o.get("text", "") for o in out["cells"][0]["outputs"])
    assert first.startswith("False\n"), first
    sizes = first.split("\n")[1]
    assert sizes.count("'16'") == 3 and "'/dev/shm'" in sizes, sizes
    stopped = out["metadata"]["tinypaged"]["stopped"]["why"]
    assert "sent back more than 1 MiB" in stopped, stopped
    assert out["cells"][2]["outputs"][0]["ename"] == execute.NOT_RUN


def test_frames_only_count_for_code_cells_of_the_notebook_sent():
    from tinypaged.course.grading.execute import apply_frames

    nb = notebook("a", "b")
    frames = [{"cell": 7, "outputs": []}, {"cell": True, "outputs": []}, {"cell": 0, "outputs": "no"},
              {"cell": 1, "outputs": [{"output_type": "stream", "name": "stdout", "text": "ok"}, {"bad": 1}],
               "execution_count": 1},
              {"cell": 1, "outputs": [{"output_type": "stream", "name": "stdout", "text": "second"}]}]
    out = apply_frames(nb, frames)
    assert out["cells"][0]["outputs"] == [] and out["cells"][1]["outputs"] == [
        {"output_type": "stream", "name": "stdout", "text": "ok"}]


# ---------------------------------------------------------------- one submission's ceiling

@needs_bwrap
@needs_cgroups
def test_a_submission_has_one_wall_clock_and_cpu_ceiling_across_its_sandboxes(tmp_path):
    budget = sbx.SubmissionBudget(wall_seconds=60, cpu_seconds=2)
    spins = 0
    t0 = time.monotonic()
    for n in range(3):  # each sandbox alone stays under 2 CPU seconds; together they do not
        (tmp_path / str(n)).mkdir()
        with sbx.Sandbox(tmp_path / str(n), budget=budget) as box:
            proc = subprocess.run(box.command(["python3", "-c", "import time\nt=time.process_time()\n"
                                               "while time.process_time() - t < 1.2: pass\nprint('spun')"]),
                                  capture_output=True, text=True, timeout=60)
        spins += proc.stdout.count("spun")
    assert spins == 1 and "CPU time" in budget.exceeded, (spins, budget.exceeded)
    assert "refused" in proc.stderr and proc.returncode != 0

    wall = sbx.SubmissionBudget(wall_seconds=2, cpu_seconds=None)
    (tmp_path / "w").mkdir()
    with sbx.Sandbox(tmp_path / "w", budget=wall) as box:
        subprocess.run(box.command(["sleep", "60"]), capture_output=True, timeout=60)
    assert "wall-clock ceiling of 2 s" in wall.exceeded and time.monotonic() - t0 < 40


def test_the_ceiling_is_a_flag_and_reaches_the_checks_job(monkeypatch):
    from tinypaged.course.grading import verify

    got = {}

    def grade(source, sub, stage, make, cell_cpu=120, check_cpu=300, idle_s=120.0, serving_cpu=None,
              total_wall=None):
        got["total_wall"] = total_wall
        return {}

    monkeypatch.setattr(verify, "grade", grade)
    coursework.grade_with_ceiling({}, {}, "02", None, 123)
    assert got == {"total_wall": 123}
    with pytest.raises(SystemExit):
        coursework.main(["grade", "--submission-timeout", "0", "x.ipynb"])


# ---------------------------------------------------------------- the interpreter inside

@needs_bwrap
def test_a_venv_that_is_a_symbolic_link_starts_inside_the_sandbox(tmp_path):
    venv = Path(sys.prefix).resolve()
    link = tmp_path / "linked-venv"
    link.symlink_to(venv)
    script = ("import subprocess, sys, tempfile\nfrom pathlib import Path\n"
              "from tinypaged.course.grading.sandbox import Sandbox, interpreter_problem\n"
              "make = lambda d: Sandbox(d)\n"
              "print(interpreter_problem(make))\n"
              "with tempfile.TemporaryDirectory() as d, Sandbox(Path(d)) as box:\n"
              "    print(subprocess.run(box.command([sys.executable, '-c', 'import sys; print(sys.prefix)']),"
              " capture_output=True, text=True).stdout.strip())\n")
    proc = subprocess.run([str(link / "bin" / "python"), "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.stdout.split() == ["None", str(link)], proc.stdout + proc.stderr[-2000:]


@needs_bwrap
def test_an_interpreter_that_cannot_start_is_said_in_one_line_with_the_real_maximum(tmp_path, monkeypatch):
    monkeypatch.setattr(sbx, "_python_paths", lambda: [])  # the environment is not bound in
    monkeypatch.setattr(sbx, "_python_aliases", lambda: [])
    monkeypatch.setattr(sbx, "_INTERPRETER_OK", {})
    handed = tmp_path / "alice" / f"{ASSIGNMENT}.ipynb"
    handed.parent.mkdir()
    shutil.copy(ROOT / "exercises" / f"{ASSIGNMENT}.ipynb", handed)
    report = coursework.grade_notebook(handed, execute=False)
    source = nbk.read(ROOT / "solutions" / f"{ASSIGNMENT}.ipynb")
    assert "cannot start inside the sandbox" in report["error"] and "\n" not in report["error"], report["error"]
    assert report["max_score"] == coursework.max_points(source) > 0


# ---------------------------------------------------------------- the feedback HTML

LEARNER_HTML = ('<script>alert("x1")</script><img src="x" onerror="alert(\'x2\')">'
                '<a href="javascript:alert(\'x3\')">x3</a>')


def hostile_feedback_nb() -> dict:
    nb = notebook("1")
    nb["cells"].insert(0, {"cell_type": "markdown", "metadata": {},
                           "source": LEARNER_HTML + "\n\n[click](javascript:alert('x4'))"})
    nb["cells"][1]["outputs"] = [
        {"output_type": "display_data", "metadata": {}, "data": {"text/html": LEARNER_HTML, "text/plain": "x"}},
        {"output_type": "display_data", "metadata": {}, "data": {"application/javascript": "alert('x5')"}}]
    return nb


def assert_clean(html: str):
    for bad in ("alert(", "onerror", "javascript:"):
        assert bad not in html, (bad, html[html.find(bad) - 200: html.find(bad) + 200])


def test_the_quick_graders_feedback_html_keeps_no_learner_script(tmp_path):
    report = {"notebook": "alice", "score": 0.0, "max_score": 1.0, "tests": [], "errors": [], "findings": [],
              "manual": [], "manual_points": 0.0}
    out = tmp_path / "fb.html"
    coursework.write_feedback(hostile_feedback_nb(), report, {"cells": []}, out)
    html = out.read_text()
    assert "x3</a>" in html or "x3" in html  # the text stays, its handler does not
    assert_clean(html)


def test_nbgraders_feedback_exporter_is_sanitized():
    import nbformat
    from nbconvert import HTMLExporter
    from traitlets.config.loader import PyFileConfigLoader

    cfg = PyFileConfigLoader(coursework.CONFIG.name, path=str(coursework.CONFIG.parent)).load_config()
    html, _ = HTMLExporter(config=cfg).from_notebook_node(nbformat.from_dict(hostile_feedback_nb()))
    assert_clean(html)


# ---------------------------------------------------------------- nbgrader: refused folders, failed steps

def test_nbgrader_refuses_links_and_extra_files_and_records_its_own_failures(tmp_path, monkeypatch):
    """alice hands in her notebook with a link to the instructor's source beside it, bob with a notes file, carol
    with a test cell whose nbgrader metadata nbgrader itself rejects. Nothing but notebooks reaches autograded/;
    alice and bob are FLAGGED with 0 and the reason; carol is FAILED with nbgrader's step and message (today:
    the link was copied into autograded/ and carol was a silent 0)."""
    from nbgrader.api import Gradebook

    from tinypaged.course.grading import nbgrader_verify

    course = tmp_path / "course"
    monkeypatch.delenv("TINYPAGED_EXCHANGE", raising=False)
    coursework.release(course, [ROOT / "solutions" / f"{ASSIGNMENT}.ipynb"])
    released = course / "release" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    submitted = course / "submitted"
    for student in ("alice", "bob", "carol"):
        (submitted / student / ASSIGNMENT).mkdir(parents=True)
        shutil.copy(released, submitted / student / ASSIGNMENT / f"{ASSIGNMENT}.ipynb")
    (submitted / "alice" / ASSIGNMENT / "answers.json").symlink_to(course / "source" / ASSIGNMENT /
                                                                    f"{ASSIGNMENT}.ipynb")
    (submitted / "bob" / ASSIGNMENT / "notes.txt").write_text("hi")
    carol = submitted / "carol" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    nb = json.loads(carol.read_text())
    solution = next(c for c in nb["cells"] if nbk.is_solution(c) and c["cell_type"] == "code")
    solution["metadata"]["nbgrader"].update(grade=True, solution=False, points="lots")  # a made-up graded cell
    carol.write_text(json.dumps(nb))

    api = coursework._nbgrader_api(course)
    for student in ("alice", "bob", "carol"):
        api.autograde(ASSIGNMENT, student, force=True, create=True)
    autograded = course / "autograded"
    copied = sorted(str(p.relative_to(autograded)) for p in autograded.rglob("*") if p.is_file()) \
        if autograded.exists() else []
    assert all(p.endswith(".ipynb") and "answers" not in p for p in copied), copied

    dest = tmp_path / "grades.csv"
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        nbgrader_verify.TinypagedCsvExport(to=str(dest)).export(gb)
    rows = {r["student_id"]: r for r in csv.DictReader(open(dest))}
    assert rows["alice"]["status"] == "FLAGGED" and float(rows["alice"]["auto_score"]) == 0, rows["alice"]
    assert "answers.json is a symbolic link" in rows["alice"]["findings"], rows["alice"]
    assert rows["bob"]["status"] == "FLAGGED" and "notes.txt is not part of the assignment" in rows["bob"]["findings"]
    assert rows["carol"]["status"] == "FAILED" and float(rows["carol"]["auto_score"]) == 0, rows["carol"]
    assert "AUTOGRADE FAILED: nbgrader's" in rows["carol"]["findings"], rows["carol"]
