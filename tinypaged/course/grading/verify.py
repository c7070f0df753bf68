"""Score a submission from evidence the learner's kernel never touches.

1. The learner's code is extracted from the cells the *instructor's source* marks as solution cells
   (:func:`~tinypaged.course.grading.notebook.module_cells`); the submission's metadata, its added
   cells and everything its kernel printed play no part.
2. That code is read (:mod:`~tinypaged.course.grading.scan`, the strict rules for solution cells) and
   then imported as a module in a fresh, sandboxed process (:mod:`~tinypaged.course.grading.evidence`).
3. Here the judge draws every check call's cases (:func:`build_job`; hidden ones from :func:`effective_seed`,
   a keyed digest of the notebook's seed), sends them to that process one call at a time as data
   (:mod:`~tinypaged.course.grading.wire`), computes the expected results from the package's references (or,
   for the serving checks, transformers or the package's engine) and compares them with what the probe
   observed (``checks.judge``).

Only each case's *steps* cross from the sandbox (with the case's ``todo``/``error`` state and, for a visible
case, its replay note): a record's other claims (``reuse``, a verdict, ``finished``) are ignored, a step value
must be plain JSON data (numbers, strings, lists, dicts; NaN and inf become strings, so they never equal a
number), and a record that is malformed or larger than :data:`MAX_RECORD_CHARS` scores 0 for its check with
the reason. An exception the sandbox reports is named by its class when that is one of Python's own, never by
its message (:func:`judge_error_text`). A serving check earns its points only when the checks of the parts it
runs pass in full (:func:`_gate_serving`): tokens alone could be produced without the learner's parts.

Then: a check whose target a solution cell wrote with the package's reference implementation scores 0
(read in the code here, in the grader's process); every test cell after a solution
cell that tampers scores 0; a check the grader refused something to (frames, files, ``exec`` ...)
scores 0; a check that killed its process scores 0 with the reason; a test cell scores
``points x (weight of passing cases) / (weight of all cases)``, rounded to 2 decimals.

``apply_to_notebook`` writes the verdicts into an executed notebook's test cells, in nbgrader's scoring
language (an error output: 0; a number: partial credit; nothing: full); what the kernel printed there stays,
as feedback (nbgrader's rule never reads printed text), except in a test cell with hidden cases. A failed
hidden check says which case failed, by number, with its hint: never the case's inputs or expected values.
"""

from __future__ import annotations

import ast
import math

from tinypaged.course import checks
from tinypaged.course.grading import notebook as nbk
from tinypaged.course.grading.scan import scan_notebook

GRADE_ERROR = "TinypagedGradeError"
MAX_RECORD_CHARS = 8 << 20  # a check's evidence (its steps as JSON) beyond this scores 0: a record's size is bounded
MAX_DEPTH = 32  # nesting of a step value (the references record at most a few levels)


class BadEvidence(ValueError):
    """A record from the sandbox that is not the plain data a case records: the check scores 0 with this reason."""


def _plain_data(value, budget: list[int], depth: int = 0):
    """``value`` as trusted plain data: JSON types only, non-finite floats as their ``repr`` (as
    :func:`~tinypaged.course.checks.plain` records them), at most ``budget[0]`` characters in all."""
    budget[0] -= 8
    if budget[0] < 0:
        raise BadEvidence(f"the evidence is larger than {MAX_RECORD_CHARS} characters")
    if depth > MAX_DEPTH:
        raise BadEvidence(f"a value nests deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        budget[0] -= len(str(value)) if abs(value) < 10 ** 18 else 4000
        if abs(value) >= 1 << 64:
            raise BadEvidence("an integer larger than 64 bits")
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        budget[0] -= len(value)
        if budget[0] < 0:
            raise BadEvidence(f"the evidence is larger than {MAX_RECORD_CHARS} characters")
        return value
    if isinstance(value, list):
        return [_plain_data(v, budget, depth + 1) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise BadEvidence("a dict with a key that is not a string")
        out = {k: _plain_data(v, budget, depth + 1) for k, v in value.items()}
        if "tensor" in out:  # a tensor as plain() records it: its shape, and that many numbers (or "nan"/"inf")
            shape, data = out["tensor"], out.get("data")
            if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                    for n in shape)):
                raise BadEvidence("a tensor whose shape is not a list of sizes")
            if not (isinstance(data, list) and len(data) == math.prod(shape)
                    and all(isinstance(x, (int, float, str)) and not isinstance(x, bool) for x in data)):
                raise BadEvidence(f"a tensor of shape {tuple(shape)} whose data is not {math.prod(shape)} numbers")
        return out
    raise BadEvidence(f"a value of type {type(value).__name__} (only JSON data crosses from the sandbox)")


def trusted_record(record, check: str, hidden: int | None, cases: int) -> dict:
    """The part of a sandbox's record the judge uses: per case, its steps (``[description, value]`` pairs), whether
    it stopped at the stub (``todo``), its error text and its replay note. Every other claim is dropped (``reuse``,
    a verdict, a status); anything malformed or oversized raises :class:`BadEvidence` naming what."""
    outcomes = record.get("outcomes") if isinstance(record, dict) else None
    if not isinstance(outcomes, list):
        raise BadEvidence("the record holds no list of outcomes")
    if len(outcomes) > cases:
        raise BadEvidence(f"{len(outcomes)} outcomes for {cases} case(s)")
    budget = [MAX_RECORD_CHARS]
    clean = []
    for n, o in enumerate(outcomes):
        if not isinstance(o, dict):
            raise BadEvidence(f"outcome {n + 1} is not an object")
        steps = o.get("steps", [])
        if not isinstance(steps, list) or not all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], str)
                                                  for s in steps):
            raise BadEvidence(f"outcome {n + 1}: steps must be [description, value] pairs")
        out = {"steps": [[_plain_data(d, budget), _plain_data(v, budget)] for d, v in steps]}
        if o.get("todo") is True:
            out["todo"] = True
        if isinstance(o.get("error"), str):
            out["error"] = judge_error_text(o["error"])
        if isinstance(o.get("note"), str):
            out["note"] = o["note"][:checks.MAX_NOTE]
        clean.append(out)
    return {"check": check, "hidden": hidden, "outcomes": clean, "reuse": None}


def trusted_evidence(job: dict, evidence) -> dict:
    """What :func:`score` reads from ``gather``'s result, restricted to the job's own calls and cells (an event
    the sandbox made up about a call or a cell the job does not have is dropped, never a crash)."""
    ev = evidence if isinstance(evidence, dict) else {}
    keys = {c["key"] for c in job["calls"]}
    cells = {c["index"] for c in job["cells"]}

    def index(k):
        try:
            return int(k)
        except (TypeError, ValueError):
            return None

    records = {k: v for k, v in (ev.get("records") or {}).items() if k in keys} \
        if isinstance(ev.get("records"), dict) else {}
    cell_res = {}
    for k, v in (ev.get("cells") or {}).items() if isinstance(ev.get("cells"), dict) else ():
        if index(k) in cells and isinstance(v, dict):
            cell_res[index(k)] = {"error": v["error"][:400] if isinstance(v.get("error"), str) else None,
                                  "refused": [r for r in v.get("refused", []) if isinstance(r, str)]
                                  if isinstance(v.get("refused"), list) else []}
    kills = [k for k in ev.get("kills", []) if isinstance(k, dict) and isinstance(k.get("why"), str)
             and (k.get("call") in keys if "call" in k else index(k.get("cell")) in cells if "cell" in k else True)]
    for k in kills:
        if not (isinstance(k.get("case"), int) and not isinstance(k.get("case"), bool)):
            k["case"] = None
    strings = {name: [r for r in ev.get(name, []) if isinstance(r, str)] for name in ("refused", "threads")}
    return {"records": records, "cells": cell_res, "kills": kills, **strings}


HARNESS_ERRORS = ("the observed values are not plain data", "NameError")


def judge_error_text(text) -> str:
    """What feedback says of an exception the sandbox reported: the class's name when it is one of Python's own
    exceptions (``IndexError``), else that the code raised a class of its own; never the message, which is text
    the sandbox made (a submission could put anything there, hidden inputs included)."""
    import builtins

    if not isinstance(text, str):
        return "an exception"
    if text in HARNESS_ERRORS:
        return text
    name = text.split(":", 1)[0].strip()
    cls = getattr(builtins, name, None) if name.isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        return name
    return "an exception of a class your code defines" if name.isidentifier() else "an exception"


def _gate_serving(tests: list[dict]) -> None:
    """A serving check (its expectation computed by the judge, e.g. transformers' tokens) earns its points only
    when every check of the parts it runs passed in full: what a served run observes (tokens) can be produced
    in the sandbox without the learner's parts, so forging it gains nothing."""
    verdicts = [v for t in tests for v in t["checks"]]
    for t in tests:
        changed = False
        for v in t["checks"]:
            try:
                c = checks.get(v["check"])
            except KeyError:
                continue
            if c.expected is None or v["passed"] <= 0:
                continue
            units = [u for u in verdicts if u is not v and _is_unit_of(u, c)]
            failing = sorted({u["check"] for u in units if u["status"] != checks.PASS})
            if failing:
                v.update(passed=0.0, status=checks.FAIL,
                         message=f"earns its points once {', '.join(failing)} pass(es) in full")
                changed = True
        if changed:
            _rescore(t)


def _is_unit_of(u: dict, serving: "checks.Check") -> bool:
    try:
        c = checks.get(u["check"])
    except KeyError:
        return False
    return c.expected is None and c.stage == serving.stage and c.target in serving.targets


def _rescore(row: dict) -> None:
    passed = sum(v["passed"] for v in row["checks"])
    total = sum(v["total"] for v in row["checks"])
    row["score"] = round(row["points"] * passed / total, 2) if total else 0.0
    statuses = [v["status"] for v in row["checks"]]
    row["status"] = checks.PASS if statuses and all(s == checks.PASS for s in statuses) else checks.FAIL
    first = next((v for v in row["checks"] if v["status"] != checks.PASS), None)
    if first is not None:
        where = " (hidden cases)" if first.get("hidden") is not None else ""
        row["message"] = f"{first['check']}{where}: {first['message']}"


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


KEY_ENV = "TINYPAGED_GRADER_KEY"  # hex: the judge's key for hidden seeds (default: a file in the grader's cache)


def grader_key() -> bytes:
    """The judge's secret for hidden seeds: ``$TINYPAGED_GRADER_KEY`` (hex), else 32 random bytes made once and
    kept in the grader's cache, readable by its owner only (no sandbox binds that folder, and a sandbox runs as
    another user). The same key gives the same hidden cases every time a class is graded on this machine."""
    import os
    import secrets

    if os.environ.get(KEY_ENV):
        return bytes.fromhex(os.environ[KEY_ENV])
    from tinypaged.course.grading.sandbox import grader_cache

    path = grader_cache() / "hidden-seed-key"
    if not path.exists():  # made whole, then linked into place: a second grader reads the first one's key
        tmp = path.with_name(f".hidden-seed-key-{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        return bytes.fromhex(f.read().strip())


def effective_seed(seed: int, key: bytes | None = None) -> int:
    """The seed the judge draws a hidden check's cases from: a keyed digest of the notebook's seed (56 bits). What
    a sandbox sees of hidden cases is derived from this number, which reveals nothing of the notebook's seed
    without the key; ``check(name, impl, hidden=effective_seed(...))`` in the full package replays the same
    cases (the instructor's report gives it)."""
    import hashlib
    import hmac

    digest = hmac.new(grader_key() if key is None else key, str(int(seed)).encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:7], "big")


def build_job(source_nb: dict, submission_nb: dict, stage: str, cell_cpu: int = 120, check_cpu: int = 300,
              serving_cpu: int | None = None, key: bytes | None = None) -> dict:
    """The judge's job: the module's cells and, per check call of the source's test cells, the cases the judge
    drew (hidden ones from :func:`effective_seed`), each encoded for the sandbox (:mod:`~.wire`). Visible calls
    come first, so no value of a hidden case exists in the sandbox while a visible case's result (shown in the
    feedback) is recorded. ``hidden`` is the effective seed; ``notebook_seed`` the one the notebook names (both
    stay here: :func:`~tinypaged.course.grading.evidence.sandbox_job` is what the sandbox gets)."""
    from tinypaged.course.grading import wire

    calls = []
    for i, cell in enumerate(source_nb["cells"]):
        if nbk.is_test(cell):
            for n, (name, target, hidden) in enumerate(check_calls(nbk.source_of(cell))):
                seed = effective_seed(hidden, key) if hidden is not None else None
                try:
                    c = checks.get(name)
                except KeyError:
                    c = None
                calls.append({"key": f"{nbk.grade_id(cell)}/{n}", "grade_id": nbk.grade_id(cell), "cell": i,
                              "check": name, "target": target, "hidden": seed, "notebook_seed": hidden,
                              "serving": c is not None and c.expected is not None,
                              "cases": [wire.encode_case(c.target, case) for case in c.cases(seed)] if c else []})
    calls.sort(key=lambda c: c["hidden"] is not None)
    job = {"stage": stage, "cells": nbk.module_cells(source_nb, submission_nb), "calls": calls,
           "cell_cpu": cell_cpu, "check_cpu": check_cpu}
    if serving_cpu is not None:  # else the probe's SERVING_CPU
        job["serving_cpu"] = serving_cpu
    return job


def grade(source_nb: dict, submission_nb: dict, stage: str, make_sandbox, cell_cpu: int = 120,
          check_cpu: int = 300, idle_s: float = 120.0, serving_cpu: int | None = None,
          total_wall: float | None = None) -> dict:
    """The grade report of one submission (see the module docstring). ``total_wall``: the wall-clock ceiling of
    its checks, all probes together (default: :data:`~tinypaged.course.grading.evidence.SUBMISSION_WALL`, or less
    when the budgets add up to less)."""
    from tinypaged.course.grading.evidence import gather

    job = build_job(source_nb, submission_nb, stage, cell_cpu, check_cpu, serving_cpu)
    if total_wall is not None:
        job["total_wall"] = float(total_wall)
    findings = scan_notebook([(c["index"], c["source"], c["learner"]) for c in job["cells"]])
    evidence = gather(job, make_sandbox, idle_s) if job["calls"] else \
        {"records": {}, "cells": {}, "kills": [], "refused": [], "threads": []}
    return score(source_nb, job, findings, evidence)


def score(source_nb: dict, job: dict, findings, evidence: dict) -> dict:
    evidence = trusted_evidence(job, evidence)
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
    cell_kill = next((k for k in evidence["kills"] if "cell" in k), None)
    tests = []
    for i, cell in enumerate(source_nb["cells"]):
        if nbk.is_test(cell):
            calls = [c for c in job["calls"] if c["cell"] == i]
            tests.append(_score_cell(i, cell, calls, evidence, kills, cell_kill, tamper_at, tamper_msg, reuse))
    _gate_serving(tests)
    manual = [{"grade_id": nbk.grade_id(c), "cell": i, "points": nbk.points(c)}
              for i, c in enumerate(source_nb["cells"]) if nbk.is_manual(c)]
    errors = [{"cell": int(i), "grade_id": next((c["grade_id"] for c in job["cells"] if c["index"] == int(i)), None),
               "error": judge_error_text(r["error"])} for i, r in sorted(evidence["cells"].items(), key=lambda kv: int(kv[0]))
              if r.get("error") and any(c["learner"] and c["index"] == int(i) for c in job["cells"])]
    counted = {id(f) for v in reuse.values() for f in v}
    rows = [dict(kind=f.kind, cell=f.cell, line=f.line, what=f.what, checks=list(f.checks),
                 counted=(id(f) in counted) if f.kind == "reuse" else f.cell == tamper_at) for f in findings]
    rows += [dict(kind="tamper", cell=f.cell, line=0, what=f.what, checks=[], counted=f.cell == tamper_at)
             for f in tamper if isinstance(f, _Runtime)]
    rows += [dict(kind="tamper", cell=None, line=0, what=f"refused at run time: {r}", checks=[], counted=True)
             for r in evidence["refused"] if not r.startswith("cell ")]
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


def _score_cell(i, cell, calls, evidence, kills, cell_kill, tamper_at, tamper_msg, reuse) -> dict:
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
            try:
                clean = trusted_record(rec, name, hidden, len(c.cases(hidden)))
                v = _learner_safe(c, clean, hidden, checks.judge(c, clean, hidden))
            except BadEvidence as e:
                v = {"check": name, "hidden": hidden, "passed": 0.0, "total": weight, "status": checks.FAIL,
                     "message": f"the evidence from the sandbox is not valid ({e}): 0 for this check"}
        if name in reuse:
            f = reuse[name][0]
            v.update(passed=0.0, status=checks.FAIL,
                     message=f"uses the package's reference implementation {f.what} (cell {f.cell}, line {f.line})")
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


def _learner_safe(c, record: dict, hidden: int | None, v: dict) -> dict:
    """A failed hidden check's message names the case by its number, with the case's hint: never its inputs, the
    expected values or any text the sandbox made (those stay in ``detail``, for the instructor's JSON report
    only, with the effective seed that replays the case in the full package)."""
    if hidden is None or v["status"] != checks.FAIL or not v.get("message"):
        return v
    got = record["outcomes"]
    for n, (case, want) in enumerate(zip(c.cases(hidden), checks.expected_outcomes(c.name, hidden))):
        if not checks.compare_case(want, got[n] if n < len(got) else None, case.tol)[0]:
            v["detail"] = v["message"]  # the instructor's JSON report only
            v["message"] = f"hidden case {n + 1}: FAIL" + (f" ({case.hint})" if case.hint else "")
            break
    return v


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
    # a test cell with hidden cases keeps nothing its kernel printed (it would show their inputs and answers)
    secret = {nbk.grade_id(c) for c in source_nb["cells"]
              if nbk.is_test(c) and any(h is not None for _, _, h in check_calls(nbk.source_of(c)))}
    seen = set()
    for cell in nb["cells"]:
        gid = nbk.grade_id(cell)
        if gid in rows and cell.get("cell_type") == "code" and gid not in seen:
            seen.add(gid)
            # what the kernel printed stays as feedback (a serving cell's payoff), all of it as stdout: nbgrader
            # gives no points to a cell with any stderr (the engine's INFO log line), and the score must come
            # from the verdict alone
            printed = [dict(o, name="stdout") for o in cell.get("outputs", [])
                       if isinstance(o, dict) and o.get("output_type") == "stream"] if gid not in secret else []
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
