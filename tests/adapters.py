"""The seam between the tests and the implementation under test (CS336-style).

By default every adapter returns tinypaged's own implementation. Set
``TINYPAGED_SUBMISSION=path/to/notebook.ipynb`` and the same tests check the functions and classes a
learner wrote in that notebook instead (the notebook's stage comes from its metadata):

    TINYPAGED_SUBMISSION=exercises/02_block_table.ipynb python -m pytest tests/test_checks.py

This runs the notebook's code in the test process: a quick self-test for learners, not grading
(``python -m tinypaged.course grade`` runs each notebook in its own kernel and verifies outside it).
"""

from __future__ import annotations

import contextlib
import io
import json
import linecache
import os
import re
from functools import lru_cache
from pathlib import Path

from tinypaged.course import checks
from tinypaged.course.grading.notebook import source_of, stage_of


def notebook_namespace(path: Path) -> dict:
    """Execute a notebook's code cells in one namespace (skipping IPython-only lines), quietly.

    A cell that raises is skipped (its later cells still run), so one unfinished part does not hide
    the others.
    """
    nb = json.loads(Path(path).read_text())
    ns: dict = {"__name__": "__submission__"}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "\n".join(line for line in source_of(cell).splitlines() if not re.match(r"\s*[%!]", line))
        name = f"<{path} cell {i}>"
        # Register the cell's source as IPython does: @triton.jit kernels read it back.
        linecache.cache[name] = (len(src), None, src.splitlines(keepends=True), name)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                exec(compile(src, name, "exec"), ns)
            except Exception:
                pass
    return ns


@lru_cache(maxsize=None)
def _submission(path: str) -> tuple[str | None, dict]:
    nb = json.loads(Path(path).read_text())
    return stage_of(nb, Path(path)), notebook_namespace(Path(path))


def implementation(check_name: str):
    """What the named check should run on: the submission's definition, or tinypaged's reference."""
    c = checks.get(check_name)
    sub = os.environ.get("TINYPAGED_SUBMISSION")
    if sub:
        stage, ns = _submission(sub)
        if stage == c.stage:
            if c.target not in ns:
                raise NotImplementedError(f"{c.target} is not defined in {sub}")
            return ns[c.target]
    return c.reference()


def under_test(check_name: str) -> bool:
    """Whether ``implementation(check_name)`` is a learner's (so reuse detection applies)."""
    sub = os.environ.get("TINYPAGED_SUBMISSION")
    return bool(sub) and _submission(sub)[0] == checks.get(check_name).stage
