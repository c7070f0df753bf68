"""Score an executed notebook in the grader's process: the learner's kernel only ever supplies observations.

For every autograded test cell, the instructor's source says which checks it runs
(``check("slot_mapping", slot_mapping)``, ``check("slot_mapping", slot_mapping, hidden=SEED)``). The
kernel displayed one record per check: the steps it observed. Here the expected steps are computed
from tinypaged's reference implementation (or, for serving checks, from transformers) and compared;
nothing the kernel printed or returned decides a verdict. Then:

* a check whose target a learner cell wrote with the package's reference implementation scores 0
  (static finding from :mod:`~tinypaged.course.grading.scan`, or the record's own runtime finding);
* every test cell after a learner cell that tampers with the package or the grader scores 0;
* a test cell scores ``points x (weight of passing cases) / (weight of all cases)``.

``apply_to_notebook`` rewrites the test cells' outputs with these verdicts, so nbgrader's own
scoring (an error output: 0; a number: partial credit; nothing: full) reproduces them.
"""

from __future__ import annotations

import ast
import json

from tinypaged.course import checks
from tinypaged.course.grading import notebook as nbk
from tinypaged.course.grading.scan import scan_notebook

GRADE_ERROR = "TinypagedGradeError"


def expected_calls(source: str) -> list[tuple[str, int | None]]:
    """The ``check(name, impl[, hidden=SEED])`` calls of a (trusted) test cell, in order."""
    try:
        tree = ast.parse(nbk_code(source))
    except SyntaxError:
        return []
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
            if name != "check":
                continue
            hidden = None
            for kw in node.keywords:
                if kw.arg == "hidden" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, int):
                    hidden = kw.value.value
            calls.append((node.args[0].value, hidden))
    calls.sort(key=lambda c: c[1] is not None)  # visible first, as the cell runs them
    return calls


def nbk_code(source: str) -> str:
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def records_of(cell) -> dict[tuple[str, int | None], dict]:
    found = {}
    for out in cell.get("outputs", []):
        data = out.get("data", {}) if isinstance(out, dict) else {}
        rec = data.get(checks.RECORD_MIME)
        if isinstance(rec, str):
            try:
                rec = json.loads(rec)
            except json.JSONDecodeError:
                continue
        if isinstance(rec, dict) and isinstance(rec.get("check"), str):
            hidden = rec.get("hidden") if isinstance(rec.get("hidden"), int) else None
            found.setdefault((rec["check"], hidden), rec)
    return found


def errors_of(cell) -> list[str]:
    return [f"{o.get('ename')}: {o.get('evalue')}" for o in cell.get("outputs", [])
            if isinstance(o, dict) and o.get("output_type") == "error"]


def is_learner(cell) -> bool:
    """The learner controls this cell: marked by ``assemble``, or (under nbgrader) a solution cell or a
    cell nbgrader knows nothing about."""
    role = nbk.role(cell)
    if role is not None:
        return role == nbk.LEARNER
    return nbk.is_solution(cell) or not nbk.grade_id(cell)


def verify(nb: dict) -> dict:
    """The grade report of an executed notebook (see the module docstring)."""
    cells = nb["cells"]
    code = [(i, nbk.source_of(c), is_learner(c)) for i, c in enumerate(cells) if c.get("cell_type") == "code"]
    findings = scan_notebook(code)
    tamper_at = min((f.cell for f in findings if f.kind == "tamper"), default=None)
    tamper_msg = next((f.describe() for f in findings if f.kind == "tamper" and f.cell == tamper_at), "")
    reuse: dict[str, list] = {}
    for f in findings:
        if f.kind != "reuse":
            continue
        for name in f.checks:
            c = checks.get(name)
            if set(c.targets) & set(f.binds):
                reuse.setdefault(name, []).append(f)

    tests, manual, errors = [], [], []
    for i, cell in enumerate(cells):
        gid = nbk.grade_id(cell)
        if cell.get("cell_type") == "code" and is_learner(cell):
            for e in errors_of(cell):
                errors.append({"cell": i, "grade_id": gid, "error": e})
        if nbk.is_manual(cell):
            manual.append({"grade_id": gid, "cell": i, "points": nbk.points(cell)})
        if not nbk.is_test(cell):
            continue
        tests.append(_score_cell(i, cell, tamper_at, tamper_msg, reuse))
    score = round(sum(t["score"] for t in tests), 2)
    possible = round(sum(t["points"] for t in tests), 2)
    return {
        "stage": nb.get("metadata", {}).get("tinypaged", {}).get("stage"),
        "score": score, "max_score": possible,
        "manual_points": sum(m["points"] for m in manual),
        "tests": tests, "manual": manual, "errors": errors,
        "findings": [dict(kind=f.kind, cell=f.cell, line=f.line, what=f.what, checks=list(f.checks),
                          counted=any(f in v for v in reuse.values()) if f.kind == "reuse" else f.cell == tamper_at)
                     for f in findings],
    }


def _score_cell(i: int, cell, tamper_at, tamper_msg, reuse) -> dict:
    pts = nbk.points(cell)
    row = {"grade_id": nbk.grade_id(cell), "cell": i, "points": pts, "score": 0.0, "status": checks.FAIL,
           "message": "", "checks": []}
    calls = expected_calls(nbk.source_of(cell))
    errs = sorted(errors_of(cell), key=lambda e: not e.startswith(("CellTimeoutError", "NotRun", "DeadKernel")))
    if tamper_at is not None and tamper_at < i:
        row["message"] = f"0 points: {tamper_msg} (every test after it scores 0)"
        return row
    if not calls:  # a plain test cell: nbgrader's rule (no error: full points); it cannot be verified
        row["score"] = 0.0 if errs else pts
        row["status"] = "unverified " + (checks.FAIL if errs else checks.PASS)
        row["message"] = errs[0] if errs else ""
        return row
    recs = records_of(cell)
    passed = total = 0.0
    statuses = []
    for name, hidden in calls:
        try:
            c = checks.get(name)
        except KeyError:
            row["checks"].append({"check": name, "hidden": hidden, "status": checks.FAIL, "passed": 0, "total": 1,
                                  "message": f"unknown check {name!r}"})
            total += 1
            continue
        rec = recs.get((name, hidden))
        if rec is None:
            why = f"no result: the test cell raised {errs[0]}" if errs else "no result was recorded"
            v = {"check": name, "hidden": hidden, "passed": 0.0, "total": sum(k.weight for k in c.cases(hidden)),
                 "status": checks.FAIL, "message": why}
        else:
            v = checks.judge(c, rec, hidden)
        if name in reuse and v["passed"]:
            f = reuse[name][0]
            v.update(passed=0.0, status=checks.FAIL,
                     message=f"uses the package's reference implementation {f.what} (cell {f.cell}, line {f.line})")
        elif name in reuse:
            f = reuse[name][0]
            v["message"] = f"uses the package's reference implementation {f.what} (cell {f.cell}, line {f.line})"
            v["status"] = checks.FAIL
        row["checks"].append(v)
        passed += v["passed"]
        total += v["total"]
        statuses.append(v["status"])
    row["score"] = round(pts * passed / total, 2) if total else 0.0
    if statuses and all(s == checks.PASS for s in statuses):
        row["status"] = checks.PASS
    elif statuses and all(s == checks.TODO for s in statuses):
        row["status"] = checks.TODO
    first = next((v for v in row["checks"] if v["status"] != checks.PASS), None)
    if first is not None:
        where = " (hidden cases)" if first.get("hidden") is not None else ""
        row["message"] = f"{first['check']}{where}: {first['message']}"
    return row


def verdict_lines(row: dict) -> list[str]:
    lines = [f"{row['grade_id']}: {row['score']:g}/{row['points']:g} {row['status']}"]
    for v in row["checks"]:
        where = " (hidden cases)" if v.get("hidden") is not None else ""
        msg = f" - {v['message']}" if v.get("message") and v["message"] != checks.TODO else ""
        lines.append(f"  check {v['check']}{where}: {v['status']}{msg}")
    if not row["checks"] and row["message"]:
        lines.append("  " + row["message"])
    return lines


def apply_to_notebook(nb: dict, report: dict) -> dict:
    """Replace every test cell's outputs with the verified verdict, in nbgrader's scoring language."""
    rows = {r["cell"]: r for r in report["tests"]}
    for i, cell in enumerate(nb["cells"]):
        row = rows.get(i)
        if row is None:
            continue
        outputs = [{"output_type": "stream", "name": "stdout", "text": "\n".join(verdict_lines(row)) + "\n"}]
        if row["score"] <= 0:
            outputs.append({"output_type": "error", "ename": GRADE_ERROR, "evalue": row["message"] or "no points",
                            "traceback": [f"{GRADE_ERROR}: {row['message'] or 'no points'}"]})
        elif row["score"] < row["points"]:
            outputs.append({"output_type": "execute_result", "execution_count": cell.get("execution_count"),
                            "metadata": {}, "data": {"text/plain": f"{row['score']:g}"}})
        cell["outputs"] = outputs
    return nb
