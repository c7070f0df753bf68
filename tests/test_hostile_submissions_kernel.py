"""Hostile submissions, the learner's-kernel side (``run: kernel`` fixtures, graded with the feedback run): none
gains a point or leaves its sandbox, a patched package raises no later score, the escape cell's own printout
shows every attempt failed, and a crash or exit costs only its own step. The fixtures, their builder and the
limits are tests/test_hostile_submissions.py's (split from it so that the two files run on both workers).
"""

import json
import re
import shutil

import pytest

from test_hostile_submissions import FIXTURES, LIMITS, ROOT, WATCHED, build, check, digest, grade, specs
from tinypaged.course import coursework
from tinypaged.course.grading import notebook as nbk

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


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
