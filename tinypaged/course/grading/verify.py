"""Score a submission from evidence the learner's kernel never touches.

1. The learner's code is extracted from the cells the *instructor's source* marks as solution cells
   (:func:`~tinypaged.course.grading.notebook.module_cells`); the submission's metadata, its added
   cells and everything its kernel printed play no part.
2. That code is read (:mod:`~tinypaged.course.grading.scan`, the strict rules for solution cells) and
   then imported as a module in a fresh, sandboxed process that runs every check call of the source's
   test cells, hidden seeds included (:mod:`~tinypaged.course.grading.evidence`).
3. Here, in the grader's process, the expected results are computed from the package's references (or,
   for the serving checks, transformers) and compared with what the probe observed (``checks.judge``).

Then: a check whose target a solution cell wrote with the package's reference implementation scores 0
(read in the code, or caught calling it at run time in any thread); every test cell after a solution
cell that tampers scores 0; a check the grader refused something to (frames, files, ``exec`` ...)
scores 0; a check that killed its process scores 0 with the reason; a test cell scores
``points x (weight of passing cases) / (weight of all cases)``, rounded to 2 decimals.

``apply_to_notebook`` writes the verdicts into an executed notebook's test cells, in nbgrader's scoring
language (an error output: 0; a number: partial credit; nothing: full); what the kernel printed there stays,
as feedback (nbgrader's rule never reads printed text).
"""

from __future__ import annotations

import ast

from tinypaged.course import checks
from tinypaged.course.grading import notebook as nbk
from tinypaged.course.grading.scan import scan_notebook

GRADE_ERROR = "TinypagedGradeError"


def nbk_code(source: str) -> str:
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def check_calls(source: str) -> list[tuple[str, str, int | None]]:
    """The ``check(name, target[, hidden=SEED])`` calls of a (trusted) test cell: (name, target, seed),
    visible ones first, as the cell runs them."""
    try:
        tree = ast.parse(nbk_code(source))
    except SyntaxError:
        return []
    calls = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            continue
        fn = node.func
        if (fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None) != "check":
            continue
        hidden = None
        for kw in node.keywords:
            if kw.arg == "hidden" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, int):
                hidden = kw.value.value
        target = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
        calls.append((node.args[0].value, target, hidden))
    calls.sort(key=lambda c: c[2] is not None)
    return calls


def expected_calls(source: str) -> list[tuple[str, int | None]]:
    return [(name, hidden) for name, _, hidden in check_calls(source)]


def build_job(source_nb: dict, submission_nb: dict, stage: str, cell_cpu: int = 120, check_cpu: int = 300) -> dict:
    calls = []
    for i, cell in enumerate(source_nb["cells"]):
        if nbk.is_test(cell):
            for n, (name, target, hidden) in enumerate(check_calls(nbk.source_of(cell))):
                calls.append({"key": f"{nbk.grade_id(cell)}/{n}", "grade_id": nbk.grade_id(cell), "cell": i,
                              "check": name, "target": target, "hidden": hidden})
    return {"stage": stage, "cells": nbk.module_cells(source_nb, submission_nb), "calls": calls,
            "cell_cpu": cell_cpu, "check_cpu": check_cpu}


def grade(source_nb: dict, submission_nb: dict, stage: str, make_sandbox, cell_cpu: int = 120,
          check_cpu: int = 300, idle_s: float = 120.0) -> dict:
    """The grade report of one submission (see the module docstring)."""
    from tinypaged.course.grading.evidence import gather

    job = build_job(source_nb, submission_nb, stage, cell_cpu, check_cpu)
    findings = scan_notebook([(c["index"], c["source"], c["learner"]) for c in job["cells"]])
    evidence = gather(job, make_sandbox, idle_s) if job["calls"] else \
        {"records": {}, "cells": {}, "kills": [], "refused": [], "threads": []}
    return score(source_nb, job, findings, evidence)


def score(source_nb: dict, job: dict, findings, evidence: dict) -> dict:
    tamper = [f for f in findings if f.kind == "tamper"]
    for idx, res in sorted(evidence["cells"].items(), key=lambda kv: int(kv[0])):
        for r in res.get("refused", []):
            tamper.append(_Runtime(int(idx), r))
    tamper_at = min((f.cell for f in tamper), default=None)
    tamper_msg = next((f.describe() for f in tamper if f.cell == tamper_at), "")
    reuse: dict[str, list] = {}
    for f in findings:
        if f.kind == "reuse":
            for name in f.checks:
                if set(checks.get(name).targets) & set(f.binds):
                    reuse.setdefault(name, []).append(f)
    kills = {k["call"]: k for k in evidence["kills"] if "call" in k}
    # a piece caught calling a reference at run time taints every check that exercises it (a serving check)
    caught = {checks.get(r["check"]).target: r["reuse"] for r in evidence["records"].values()
              if isinstance(r, dict) and r.get("reuse") and r.get("check") in checks.REGISTRY}
    cell_kill = next((k for k in evidence["kills"] if "cell" in k), None)
    tests = []
    for i, cell in enumerate(source_nb["cells"]):
        if nbk.is_test(cell):
            calls = [c for c in job["calls"] if c["cell"] == i]
            tests.append(_score_cell(i, cell, calls, evidence, kills, cell_kill, tamper_at, tamper_msg, reuse, caught))
    manual = [{"grade_id": nbk.grade_id(c), "cell": i, "points": nbk.points(c)}
              for i, c in enumerate(source_nb["cells"]) if nbk.is_manual(c)]
    errors = [{"cell": int(i), "grade_id": next((c["grade_id"] for c in job["cells"] if c["index"] == int(i)), None),
               "error": r["error"]} for i, r in sorted(evidence["cells"].items(), key=lambda kv: int(kv[0]))
              if r.get("error") and any(c["learner"] and c["index"] == int(i) for c in job["cells"])]
    counted = {id(f) for v in reuse.values() for f in v}
    rows = [dict(kind=f.kind, cell=f.cell, line=f.line, what=f.what, checks=list(f.checks),
                 counted=(id(f) in counted) if f.kind == "reuse" else f.cell == tamper_at) for f in findings]
    rows += [dict(kind="tamper", cell=f.cell, line=0, what=f.what, checks=[], counted=f.cell == tamper_at)
             for f in tamper if isinstance(f, _Runtime)]
    rows += [dict(kind="tamper", cell=None, line=0, what=f"refused at run time: {r}", checks=[], counted=True)
             for r in evidence["refused"] if not r.startswith("cell ")]
    rows += [dict(kind="reuse", cell=None, line=0, what=f"at run time, check {r['check']}: {r['reuse']}", checks=[r["check"]],
                  counted=True, runtime=True)
             for r in {(r["check"], r["reuse"]): r for r in evidence["records"].values()
                       if isinstance(r, dict) and isinstance(r.get("reuse"), str)}.values()]
    rows += [dict(kind="killed", cell=k.get("cell"), line=0, what=_kill_text(k, job), checks=[], counted=True)
             for k in evidence["kills"]]
    rows += [dict(kind="threads", cell=None, line=0, what=t, checks=[], counted=True) for t in evidence["threads"]]
    return {
        "stage": job["stage"],
        "score": round(sum(t["score"] for t in tests), 2), "max_score": round(sum(t["points"] for t in tests), 2),
        "manual_points": round(sum(m["points"] for m in manual), 2),
        "tests": tests, "manual": manual, "errors": errors, "findings": rows,
    }


class _Runtime:
    """A refusal by the probe's audit hook while a solution cell ran: tampering found at run time."""
    kind = "tamper"

    def __init__(self, cell: int, what: str):
        self.cell, self.line, self.what, self.checks = cell, 0, f"refused at run time: {what}", ()

    def describe(self) -> str:
        return f"cell {self.cell}: {self.what}"


def _kill_text(k: dict, job: dict) -> str:
    if "call" in k:
        call = next(c for c in job["calls"] if c["key"] == k["call"])
        where = f"check {call['check']}" + (" (hidden cases)" if call["hidden"] is not None else "")
        if k.get("case") is not None:
            where += f", case {k['case'] + 1}"
        return f"your code {k['why']} in {where} (test cell {call['grade_id']})"
    if "cell" in k:
        gid = next((c["grade_id"] for c in job["cells"] if c["index"] == k["cell"]), None)
        return f"cell {k['cell']} ({gid}) {k['why']}: it and the cells after it did not run"
    return f"the checks' process {k['why']}"


def _score_cell(i, cell, calls, evidence, kills, cell_kill, tamper_at, tamper_msg, reuse, caught) -> dict:
    pts = nbk.points(cell)
    row = {"grade_id": nbk.grade_id(cell), "cell": i, "points": pts, "score": 0.0, "status": checks.FAIL,
           "message": "", "checks": []}
    if tamper_at is not None and tamper_at < i:
        row["message"] = f"0 points: {tamper_msg} (every test after it scores 0)"
        return row
    if not calls:
        row["message"] = "this test cell calls no tinypaged check: it cannot be verified"
        return row
    passed = total = 0.0
    for call in calls:
        name, hidden = call["check"], call["hidden"]
        try:
            c = checks.get(name)
        except KeyError:
            row["checks"].append({"check": name, "hidden": hidden, "status": checks.FAIL, "passed": 0, "total": 1,
                                  "message": f"unknown check {name!r}"})
            total += 1
            continue
        weight = sum(k.weight for k in c.cases(hidden))
        rec = evidence["records"].get(call["key"])
        refused = [r for r in evidence["refused"] if r.startswith(call["key"] + ":")]
        if rec is None:
            kill = kills.get(call["key"])
            if kill is not None:
                cases = c.cases(hidden)
                hint = cases[kill["case"]].hint if kill.get("case") is not None and kill["case"] < len(cases) else ""
                why = f"your code {kill['why']}" + (f" (hint: {hint})" if hint else "")
            elif cell_kill is not None:
                why = f"not run: {_cell_kill_short(cell_kill)}"
            else:
                why = "no result was recorded"
            v = {"check": name, "hidden": hidden, "passed": 0.0, "total": weight, "status": checks.FAIL, "message": why}
        else:
            v = checks.judge(c, rec, hidden)
        if name in reuse:
            f = reuse[name][0]
            v.update(passed=0.0, status=checks.FAIL,
                     message=f"uses the package's reference implementation {f.what} (cell {f.cell}, line {f.line})")
        tainted = sorted(set(c.uses) & set(caught))
        if tainted and name not in reuse:
            v.update(passed=0.0, status=checks.FAIL, message=f"uses your {tainted[0]}: {caught[tainted[0]]}")
        if refused:
            v.update(passed=0.0, status=checks.FAIL, message="grading refused what your code asked for: "
                     + refused[0].split(":", 1)[1].strip())
        row["checks"].append(v)
        passed += v["passed"]
        total += v["total"]
    row["score"] = round(pts * passed / total, 2) if total else 0.0
    statuses = [v["status"] for v in row["checks"]]
    if statuses and all(s == checks.PASS for s in statuses):
        row["status"] = checks.PASS
    elif statuses and all(s == checks.TODO for s in statuses):
        row["status"] = checks.TODO
    first = next((v for v in row["checks"] if v["status"] != checks.PASS), None)
    if first is not None:
        where = " (hidden cases)" if first.get("hidden") is not None else ""
        row["message"] = f"{first['check']}{where}: {first['message']}"
    return row


def _cell_kill_short(k: dict) -> str:
    return f"cell {k['cell']} {k['why']}"


def verdict_lines(row: dict) -> list[str]:
    lines = [f"{row['grade_id']}: {row['score']:g}/{row['points']:g} {row['status']}"]
    for v in row["checks"]:
        where = " (hidden cases)" if v.get("hidden") is not None else ""
        msg = f" - {v['message']}" if v.get("message") and v["message"] != checks.TODO else ""
        lines.append(f"  check {v['check']}{where}: {v['status']}{msg}")
    if not row["checks"] and row["message"]:
        lines.append("  " + row["message"])
    return lines


def apply_to_notebook(nb: dict, report: dict, source_nb: dict) -> dict:
    """Replace every test cell's outputs with the verified verdict, in nbgrader's scoring language; a test
    cell the submission lost (or whose grade_id it changed) is put back from the source at the end."""
    rows = {r["grade_id"]: r for r in report["tests"]}
    seen = set()
    for cell in nb["cells"]:
        gid = nbk.grade_id(cell)
        if gid in rows and cell.get("cell_type") == "code" and gid not in seen:
            seen.add(gid)
            # what the kernel printed stays as feedback (a serving cell's payoff), all of it as stdout: nbgrader
            # gives no points to a cell with any stderr (the engine's INFO log line), and the score must come
            # from the verdict alone
            printed = [dict(o, name="stdout") for o in cell.get("outputs", [])
                       if isinstance(o, dict) and o.get("output_type") == "stream"]
            cell["outputs"] = printed + _outputs(rows[gid], cell.get("execution_count"))
    for ref in source_nb["cells"]:
        gid = nbk.grade_id(ref)
        if gid in rows and gid not in seen:
            restored = {k: v for k, v in ref.items()}
            restored["outputs"] = _outputs(rows[gid], None)
            restored["execution_count"] = None
            nb["cells"].append(restored)
    return nb


def _outputs(row: dict, count) -> list[dict]:
    outputs = [{"output_type": "stream", "name": "stdout", "text": "\n".join(verdict_lines(row)) + "\n"}]
    if row["score"] <= 0:
        outputs.append({"output_type": "error", "ename": GRADE_ERROR, "evalue": row["message"] or "no points",
                        "traceback": [f"{GRADE_ERROR}: {row['message'] or 'no points'}"]})
    elif row["score"] < row["points"]:
        outputs.append({"output_type": "execute_result", "execution_count": count, "metadata": {},
                        "data": {"text/plain": f"{row['score']:g}"}})
    return outputs
