"""docs/INSTRUCTORS.md's commands, verbatim, on a scratch course: release with nbgrader's
generate_assignment, three collected submissions, nbgrader autograde (with tinypaged's verifier) and
nbgrader export to CSV."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tinypaged.course import coursework
from tinypaged.course.grading import notebook as nbk

ROOT = coursework.ROOT
DOC = ROOT / "docs" / "INSTRUCTORS.md"


def block(tag: str) -> str:
    m = re.search(rf"<!-- ci: {tag} -->\n```bash\n(.*?)```", DOC.read_text(), re.S)
    assert m, f"docs/INSTRUCTORS.md has no '<!-- ci: {tag} -->' bash block"
    return m.group(1)


def run(script: str, env: dict) -> None:
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_release_collect_autograde_export(tmp_path):
    course = tmp_path / "course"
    env = dict(os.environ, TINYPAGED_COURSE=str(course), TINYPAGED_EXCHANGE=str(tmp_path / "exchange"),
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    release = block("release")
    assignment = re.search(r"export ASSIGNMENT=(\S+)", release).group(1)
    run(release, env)
    released = course / "release" / assignment / f"{assignment}.ipynb"
    assert released.exists()

    # collect: alice hands in the solution, bob the untouched notebook, mallory patches the checks
    patched = nbk.read(released)
    patched["cells"].insert(1, {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                                "source": "import tinypaged.course.checks as c\nc.check = lambda *a, **k: print('PASS')\n"})
    for student, nb in (("alice", ROOT / "solutions" / f"{assignment}.ipynb"), ("bob", released), ("mallory", None)):
        dest = course / "submitted" / student / assignment / f"{assignment}.ipynb"
        dest.parent.mkdir(parents=True)
        if nb is None:
            dest.write_text(json.dumps(patched))
        else:
            shutil.copy(nb, dest)

    run(f"export ASSIGNMENT={assignment}\n" + block("grade"), env)
    rows = {r["student_id"]: r for r in csv.DictReader(open(course / "grades.csv"))}
    source = nbk.read(ROOT / "solutions" / f"{assignment}.ipynb")
    auto = sum(nbk.points(c) for c in source["cells"] if nbk.is_test(c))
    total = auto + sum(nbk.points(c) for c in source["cells"] if nbk.is_manual(c))
    assert float(rows["alice"]["max_score"]) == total
    assert float(rows["alice"]["score"]) == auto  # the written answers wait for a human
    assert float(rows["bob"]["score"]) == 0
    assert float(rows["mallory"]["score"]) == 0
