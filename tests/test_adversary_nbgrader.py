"""Issue #45's attacks on nbgrader's path: the crafted submissions of tests/test_adversary.py (see its docstring),
collected into a scratch course released from an instructor's notebook that holds secrets, graded with
``nbgrader autograde`` (the sandboxed feedback run and tinypaged's verifier, nbgrader_config.py), then
``nbgrader generate_feedback`` and ``nbgrader export``. Stage 2 and stage 8 are two courses graded at once; the
hazards (a FIFO or links left in ``/io`` for the root grader) are autograded one student at a time after the batch.

Beside the quick grader's checks: files beside a submission (symbolic links to ``/etc/shadow``, the instructor's
notebook, another learner's notebook and a secret file; a plain extra file) must not be copied into ``autograded/``
or ``feedback/``; tampered test-cell metadata and a shadowed grade_id are FLAGGED, not a silent 0.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import os
import sys
import threading
from pathlib import Path

import pytest

from test_adversary import (HAZARD_BOUND_S, MAX_PAGE, RSS_CAP, ROOT, Secrets, build_all, env, hazard_notebooks,
                            instructor_notebook, kernel_results, link_folder, live_scripts, surviving_sleepers,
                            watched_run)
from tinypaged.course import coursework
from tinypaged.course.grading import notebook as nbk

BATCH_BOUND_S = 600  # one `nbgrader autograde` of a batch (7 submissions, one after another)
FEEDBACK_HTML = "{course}/feedback/{student}/{a}/{a}.html"

pytestmark = pytest.mark.skipif(__import__("shutil").which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed")


# tests/test_adversary.py's LIMITS, as nbgrader_config.py's knobs (nbgrader's own defaults are 600 s and 300 s)
NB_LIMITS = ["--SandboxedExecute.timeout=10", "--SandboxedExecute.cpu_timeout=10", "--VerifyChecks.cpu_timeout=10",
             "--VerifyChecks.idle=10"]


def nbgrader(course: Path, *args: str, timeout: float = BATCH_BOUND_S) -> dict:
    e = dict(env(), TINYPAGED_COURSE=str(course), TINYPAGED_EXCHANGE=str(course / "exchange"))
    limits = NB_LIMITS if args[0] == "autograde" else []
    return watched_run([str(Path(sys.executable).parent / "nbgrader"), *args, *limits], e, timeout)


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def release(course: Path, secrets: Secrets, name: str, tmp: Path) -> Path:
    """The instructor's notebook (with the secrets) released through nbgrader: the released notebook's path."""
    src = tmp / f"instructor-{course.name}" / f"{name}.ipynb"
    src.parent.mkdir(parents=True)
    src.write_text(json.dumps(instructor_notebook(ROOT / "solutions" / f"{name}.ipynb", secrets)))
    old = os.environ.pop("TINYPAGED_EXCHANGE", None)
    try:
        coursework.release(course, [src])
    finally:
        if old is not None:
            os.environ["TINYPAGED_EXCHANGE"] = old
    return course / "release" / name / f"{name}.ipynb"


def hand_in(course: Path, student: str, assignment: str, nb_path: Path) -> Path:
    dest = course / "submitted" / student / assignment / f"{assignment}.ipynb"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(nb_path.read_bytes())
    return dest


def export(course: Path) -> dict:
    run = nbgrader(course, "export", "--to", str(course / "grades.csv"), timeout=300)
    assert run["rc"] == 0, run["stderr"][-3000:]
    return {r["student_id"]: r for r in csv.DictReader(open(course / "grades.csv"))}


STUDENTS_02 = {"untouched": "bob", "partial": "carol", "code_partial": "mallory", "code_fake": "faker",
               "kernel_misc": "kmisc",
               "kernel_drip": "kdrip", "stage6_as_02": "eve", "tampered_meta": "tamperer"}
STUDENTS_08 = {"untouched_08": "bob8", "code_08": "mallory8"}
HAZARD_STUDENTS = {"hazard_fifo": "hz_fifo", "hazard_zero": "hz_zero", "hazard_hostlink": "hz_hostlink",
                   "hazard_flood": "hz_flood"}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adversary-nbgrader")
    secrets = Secrets()
    # three courses, graded at once: stage 2's batch, stage 8's, and stage 2's hazards (one student at a time)
    c2, c8, chz = tmp / "course02", tmp / "course08", tmp / "course02-hazards"
    rel02 = release(c2, secrets, "02_block_table", tmp)
    rel08 = release(c8, secrets, "08_serve_over_http", tmp)
    release(chz, secrets, "02_block_table", tmp)
    source02 = c2 / "source" / "02_block_table" / "02_block_table.ipynb"
    bob = c2 / "submitted" / "bob" / "02_block_table" / "02_block_table.ipynb"
    # the crafted notebooks, built from the released notebooks; the payloads read the course's own paths
    built = build_all(tmp / "build", secrets, nbk.read(rel02), nbk.read(rel08), source02, tmp / "build" / "subs",
                      {"the gradebook": str(c2 / "gradebook.db"), "bob's autograded notebook":
                       str(c2 / "autograded" / "bob" / "02_block_table" / "02_block_table.ipynb")},
                      other=bob, listed=c2 / "submitted")
    for name, student in {**STUDENTS_02, **STUDENTS_08}.items():
        course, a = (c8, "08_serve_over_http") if name in STUDENTS_08 else (c2, "02_block_table")
        hand_in(course, student, a, built[name])
    # linker: the untouched exercise, and beside it links to what it must not see and a plain extra file
    hand_in(c2, "linker", "02_block_table", rel02)
    link_folder(c2 / "submitted" / "linker" / "02_block_table",
                {"shadow": "/etc/shadow", "instructor.ipynb": str(source02), "bob.ipynb": str(bob),
                 "notes.txt": str(tmp / "build" / "course-notes.txt")})
    before = {"source02": digest(c2 / "source"), "submitted02": digest(c2 / "submitted")}

    runs = {}

    def hazards():  # one at a time, each its own autograde: one that hangs or grows hides nothing else
        for name, nb in hazard_notebooks(nbk.read(rel02), chz / "source" / "02_block_table" /
                                         "02_block_table.ipynb").items():
            p = tmp / "build" / name / "02_block_table.ipynb"
            p.parent.mkdir(parents=True)
            p.write_text(json.dumps(nb))
            hand_in(chz, HAZARD_STUDENTS[name], "02_block_table", p)
            runs[name] = nbgrader(chz, "autograde", "02_block_table", f"--student={HAZARD_STUDENTS[name]}",
                                  timeout=HAZARD_BOUND_S)
        runs["feedback-hazards"] = nbgrader(chz, "generate_feedback", "02_block_table", "--force", timeout=300)

    def batch08():
        runs["batch08"] = nbgrader(c8, "autograde", "08_serve_over_http")
        runs["feedback08"] = nbgrader(c8, "generate_feedback", "08_serve_over_http", "--force", timeout=300)

    threads = [threading.Thread(target=hazards), threading.Thread(target=batch08)]
    for t in threads:
        t.start()
    runs["batch02"] = nbgrader(c2, "autograde", "02_block_table")
    runs["feedback02"] = nbgrader(c2, "generate_feedback", "02_block_table", "--force", timeout=300)
    for t in threads:
        t.join()
    rows = {**export(c2), **export(c8), **export(chz)}
    for name, run in runs.items():
        print(f"RUN {name}: rc={run['rc']} wall={run['wall']:.0f}s peak={run['peak'] >> 20}MiB "
              f"stopped={run['stopped']}")
    for student, r in rows.items():
        print(f"  {student}: {r['auto_score']}/{r['auto_max']} {r['status']} | {r['findings'][:300]}")
    return {"tmp": tmp, "secrets": secrets, "c2": c2, "c8": c8, "chz": chz, "runs": runs, "rows": rows,
            "before": before, "bob": bob}


def course_of(g, student):
    if student in STUDENTS_08.values():
        return g["c8"], "08_serve_over_http"
    return (g["chz"] if student in HAZARD_STUDENTS.values() else g["c2"]), "02_block_table"


def feedback_page(g, student) -> str:
    course, a = course_of(g, student)
    p = Path(FEEDBACK_HTML.format(course=course, student=student, a=a))
    return p.read_text(errors="replace") if p.exists() else ""


def score(g, student) -> float:
    return float(g["rows"][student]["auto_score"])


def test_every_autograde_finished_within_its_bounds(graded):
    bad = {n: (r["stopped"], round(r["wall"]), r["peak"] >> 20) for n, r in graded["runs"].items()
           if r["stopped"] or r["peak"] > RSS_CAP}
    assert not bad, f"stopped by the watchdog (why, wall s, peak MiB): {bad}"
    students = [*STUDENTS_02.values(), *STUDENTS_08.values(), *HAZARD_STUDENTS.values(), "linker"]
    missing = {s: graded["rows"].get(s, {}).get("status") for s in students
               if graded["rows"].get(s, {}).get("status") in (None, "MISSING")}
    assert not missing, f"submissions autograde left without a grade: {missing}"


def test_baselines(graded):
    assert score(graded, "bob") == 0 and score(graded, "bob8") == 0
    assert score(graded, "carol") == 3, graded["rows"]["carol"]


@pytest.mark.parametrize("student, baseline", [("mallory", "carol"), ("faker", "bob"), ("mallory8", "bob8"),
                                               ("kmisc", "bob"), ("linker", "bob"),
                                               ("kdrip", "bob"), ("eve", "bob"), ("tamperer", "carol"),
                                               ("hz_fifo", "bob"), ("hz_zero", "bob"), ("hz_hostlink", "bob"),
                                               ("hz_flood", "bob")])
def test_no_crafted_submission_gains_a_point(graded, student, baseline):
    assert student in graded["rows"], f"{student} has no row in nbgrader's export"
    assert score(graded, student) <= score(graded, baseline), (graded["rows"][student], graded["rows"][baseline])


@pytest.mark.parametrize("student", ["mallory", "tamperer", "eve", "linker"])
def test_tampering_is_flagged_never_a_silent_zero(graded, student):
    """Tampering with what the judge reads (test cells, metadata, the folder) and mallory's visible reads are
    flagged; faker's and mallory8's patches inside the sandbox only earn nothing (test_no_crafted_...)."""
    r = graded["rows"][student]
    assert r["status"] in ("FLAGGED", "FAILED") and r["findings"], r


def test_no_secret_and_no_script_reaches_a_learner(graded):
    secrets, leaks = graded["secrets"], []
    for student in [*STUDENTS_02.values(), *STUDENTS_08.values(), *HAZARD_STUDENTS.values(), "linker"]:
        page = feedback_page(graded, student)
        row = graded["rows"].get(student, {})
        if not page:  # a refused or failed submission gets no feedback page; any other must have one
            if not (row.get("status") == "FAILED" or "refused" in row.get("findings", "")):
                leaks.append(f"{student}: no feedback page (status {row.get('status')})")
            continue
        leaks += [f"{student} feedback: {label}" for label in secrets.found(page, other=student != "bob")]
        leaks += [f"{student} feedback: the sandbox could {hit}" for hit in
                  __import__("re").findall(r"(?:READ|LIST)-OK:[^ <\"]+", page)]
        leaks += [f"{student} feedback: live script {s}" for s in live_scripts(page)]
    assert not leaks, "\n".join(leaks)


def test_nothing_beside_a_submission_is_copied_and_nothing_outside_is_read(graded):
    secrets, found = graded["secrets"], []
    # autograded/ is the instructor's (nbgrader puts the hidden tests back there): the seeds may be in it, the rest not
    keep = {k: v for k, v in secrets.table().items() if not k.startswith("hidden seed") and k != "hidden comment"}
    for course in (graded["c2"], graded["c8"], graded["chz"]):
        for top in ("autograded", "feedback"):
            for p in sorted((course / top).rglob("*")):
                if p.is_symlink():
                    found.append(f"{p.relative_to(course)} is a symbolic link (to {os.readlink(p)})")
                    continue
                if not p.is_file():
                    continue
                student = p.relative_to(course / top).parts[0]
                text = p.read_bytes().decode(errors="replace")
                for label, s in keep.items():
                    if s in text and not (student == "bob" and label == "another learner's notebook"):
                        found.append(f"{p.relative_to(course)}: {label}")
            extra = sorted(str(p.relative_to(course)) for p in (course / top).rglob("*")
                           if p.name in ("shadow", "instructor.ipynb", "bob.ipynb", "notes.txt"))
            found += [f"copied from beside the submission: {e}" for e in extra]
    assert not found, "\n".join(found)
    assert not (graded["tmp"] / "build" / "ESCAPED").exists()
    assert digest(graded["c2"] / "source") == graded["before"]["source02"]
    after = digest(graded["c2"] / "submitted")
    assert {k: after.get(k) for k in graded["before"]["submitted02"]} == graded["before"]["submitted02"]


def test_the_feedback_kernel_is_bounded_and_cleaned_up(graded):
    results = kernel_results(feedback_page(graded, "kmisc"))
    assert results, "the kernel's results are not in kmisc's feedback"
    assert results.get("write outside") != "WRITE-OK", results
    assert results.get("host-writable mounts") == [], results.get("host-writable mounts")
    over = {k: v for k, v in results.items() if k.startswith("disk ") and v << 20 >= 1 << 30}
    assert not over, f"no disk limit where the feedback run writes (MiB): {over}"
    assert not surviving_sleepers(graded["secrets"]), "the fork bomb's children outlived the grading"
    for student in ("kmisc", "kdrip"):  # the SIGINT-proof hang and the CPU drip were stopped, and said so
        assert "killed" in graded["rows"][student]["findings"] or "feedback run" in graded["rows"][student]["findings"], \
            graded["rows"][student]


@pytest.mark.parametrize("student", sorted(HAZARD_STUDENTS.values()))
def test_what_the_feedback_run_leaves_behind_stays_small(graded, student):
    """A FIFO, links or a 96 MiB flood from the feedback run: the autograded notebook and the feedback stay small."""
    course, a = course_of(graded, student)
    sizes = {str(p.relative_to(course)): p.stat().st_size for top in ("autograded", "feedback")
             for p in (course / top / student).rglob("*") if p.is_file() and not p.is_symlink()}
    assert sizes and all(n < MAX_PAGE for n in sizes.values()), sizes
