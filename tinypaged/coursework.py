"""Course machinery: exercises generated from solutions, and grading of a submitted notebook.

Solution notebooks (``solutions/NN_*.ipynb``) mark the code learners must write, nbgrader-style::

    def slot_mapping(block_table, positions, block_size):
        ### BEGIN SOLUTION
        return [...]
        ### END SOLUTION

``generate`` replaces each region with ``raise NotImplementedError("not implemented yet")`` at the
same indentation, clears outputs, and writes ``exercises/NN_*.ipynb``. ``check`` fails when an
exercise has drifted from its solution. ``grade`` runs a submitted notebook's code and scores it
with the stage's checks (the same checks the notebook itself calls).

    python -m tinypaged.coursework generate
    python -m tinypaged.coursework check
    python -m tinypaged.coursework grade exercises/02_block_table.ipynb
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import linecache
import re
import sys
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("not implemented yet")'
ROOT = Path(__file__).resolve().parent.parent


def strip_solutions(source: str) -> str:
    """Replace every BEGIN/END SOLUTION region with a NotImplementedError at its indentation."""
    out, inside = [], False
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError("nested BEGIN SOLUTION")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{STUB}\n")
        elif stripped == END:
            if not inside:
                raise ValueError("END SOLUTION without BEGIN SOLUTION")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("BEGIN SOLUTION without END SOLUTION")
    return "".join(out)


def exercise_from_solution(nb: dict) -> dict:
    nb = json.loads(json.dumps(nb))
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        cell["source"] = strip_solutions(src).splitlines(keepends=True)
        cell["outputs"] = []
        cell["execution_count"] = None
    nb.setdefault("metadata", {})["tinypaged"] = {"generated_from": "solutions", "do_not_edit": True}
    return nb


def _dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def pairs(root: Path = ROOT):
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        yield sol, root / "exercises" / sol.name


def generate(root: Path = ROOT) -> list[Path]:
    written = []
    for sol, ex in pairs(root):
        text = _dump(exercise_from_solution(json.loads(sol.read_text())))
        if not ex.exists() or ex.read_text() != text:
            ex.parent.mkdir(exist_ok=True)
            ex.write_text(text)
            written.append(ex)
    return written


def drifted(root: Path = ROOT) -> list[str]:
    """Exercises that are missing or differ from what their solution generates."""
    bad = []
    for sol, ex in pairs(root):
        expected = _dump(exercise_from_solution(json.loads(sol.read_text())))
        if not ex.exists() or ex.read_text() != expected:
            bad.append(ex.name)
    return bad


def notebook_namespace(path: Path) -> dict:
    """Execute a notebook's code cells in one namespace (skipping IPython-only lines), quietly.

    A cell that raises is skipped (its later cells still run), so one unfinished exercise does
    not hide the others from the grader.
    """
    nb = json.loads(Path(path).read_text())
    ns: dict = {"__name__": "__submission__"}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        src = "\n".join(l for l in src.splitlines() if not re.match(r"\s*[%!]", l))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            # Register the cell's source (as IPython does): compiled @triton.jit kernels read it.
            name = f"<{path} cell {len(linecache.cache)}>"
            linecache.cache[name] = (len(src), None, src.splitlines(keepends=True), name)
            try:
                exec(compile(src, name, "exec"), ns)
            except Exception:
                pass
    return ns


def grade(path: Path) -> tuple[int, int, list[tuple[str, str, str]]]:
    """Score a notebook with its stage's checks: (points earned, points possible, per-check rows)."""
    from tinypaged import checks

    stage = Path(path).name[:2]
    ns = notebook_namespace(path)
    earned, possible, rows = 0, 0, []
    for c in checks.checks_for_stage(stage):
        possible += c.points
        impl = ns.get(c.target)
        if impl is None:
            rows.append((c.name, checks.TODO, f"{c.target} is not defined"))
            continue
        status, msg = checks.evaluate(c.name, impl)
        earned += c.points if status == checks.PASS else 0
        rows.append((c.name, status, msg))
    return earned, possible, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tinypaged.coursework", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("generate", help="write exercises/ from solutions/")
    sub.add_parser("check", help="fail if an exercise differs from its generated form")
    g = sub.add_parser("grade", help="score submitted notebooks with the stage's checks")
    g.add_argument("notebooks", nargs="+", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "generate":
        for p in generate():
            print(f"wrote {p.relative_to(ROOT)}")
        return 0
    if args.cmd == "check":
        bad = drifted()
        if bad:
            print("exercises out of date (run: python -m tinypaged.coursework generate): " + ", ".join(bad))
            return 1
        print("exercises match their solutions")
        return 0
    status = 0
    for nb in args.notebooks:
        earned, possible, rows = grade(nb)
        print(f"{nb}: {earned}/{possible}")
        for name, st, msg in rows:
            print(f"  {name}: {st}" + (f" - {msg}" if msg else ""))
        status |= 0 if possible else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
