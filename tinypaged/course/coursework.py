"""Course machinery: nbgrader assignments from the solution notebooks, and grading that cannot be gamed.

    python -m tinypaged.course generate          # exercises/ from solutions/ (nbgrader generate_assignment)
    python -m tinypaged.course check             # fail if exercises/ drifted from solutions/
    python -m tinypaged.course lint              # check the solution notebooks' nbgrader metadata
    python -m tinypaged.course release           # the nbgrader course: source/ and release/ under course/
    python -m tinypaged.course grade NB... [--out DIR] [--json] [--csv FILE] [--feedback DIR] [--unsafe-no-sandbox]
    python -m tinypaged.course student-edition OUT [ASSIGNMENT ...]   # the package with the graded bodies stubbed

``solutions/NN_name.ipynb`` are nbgrader source notebooks (conventions in ``docs/INSTRUCTORS.md`` and
:mod:`tinypaged.course.grading.notebook`). ``generate`` runs nbgrader's ``generate_assignment`` on each in a
scratch course and copies the released notebook to ``exercises/``: solution regions become
``raise NotImplementedError("not implemented yet")``, hidden tests and outputs are removed, cells are locked.

``grade`` is the quick path without a gradebook: each notebook (its assignment, hence its stage, comes from its
**file name**, ``02_block_table.ipynb`` -> stage 02, :func:`~tinypaged.course.grading.notebook.assignment_of`;
never from ``metadata.tinypaged.stage``, which a learner can write: a mismatch is only noted; a name that names no
assignment is refused in one line) is graded by :func:`tinypaged.course.grading.verify.grade`
(the learner's code extracted by the instructor's ``grade_id`` and checked in a sandboxed process, the
verdicts judged here), then run in a sandboxed kernel for the learner's feedback. It refuses to run
without bubblewrap unless told ``--unsafe-no-sandbox``. Exit status 0 only if every notebook gets every
automatic point (2: no sandbox, or an output path refused).

Each submission has a firm ceiling, whatever the per-cell and per-check limits add up to
(:class:`~tinypaged.course.grading.sandbox.SubmissionBudget`): ``--submission-timeout`` wall seconds for the checks
and as many again for the feedback run (default 900 each), and ``--submission-cpu`` CPU seconds for everything it
runs (default 3600); the sandboxes' cgroups are killed when either is spent, and the report says so.
The feedback HTML is sanitized (:func:`sanitize_html`, ``nh3``): a learner's ``<script>``, event handlers and
``javascript:`` links never reach the page.

Outputs (``--out DIR``: ``DIR/grades.csv`` and ``DIR/feedback/``; or ``--csv``/``--feedback``) must lie outside
every submission's folder and outside the repository (:func:`output_problem`): they are created private (0700)
and hidden from every sandbox, so no learner's code reads another's grade or feedback.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from tinypaged.course.grading import notebook as nbk

ROOT = Path(__file__).resolve().parents[2]  # the repository (tinypaged/course/ -> ..)
CONFIG = ROOT / "nbgrader_config.py"


def pairs(root: Path = ROOT):
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        yield sol, root / "exercises" / sol.name


# ---------------------------------------------------------------- nbgrader generation

def _nbgrader_api(course_root: Path, config_file: Path = CONFIG):
    # nbgrader runs the `alembic` command of its own environment: make sure that is on PATH.
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    cfg = Config()
    if config_file.exists():
        cfg.merge(PyFileConfigLoader(config_file.name, path=str(config_file.parent)).load_config())
    cfg.CourseDirectory.root = str(course_root)
    cfg.CourseDirectory.db_url = f"sqlite:///{course_root / 'gradebook.db'}"
    if "TINYPAGED_EXCHANGE" not in os.environ:
        cfg.Exchange.root = str(course_root / "exchange")
    (course_root / "exchange").mkdir(parents=True, exist_ok=True)
    return NbGraderAPI(config=cfg)


def course_root() -> Path:
    """The course directory nbgrader_config.py names ($TINYPAGED_COURSE, else course/ in the repository)."""
    from traitlets.config.loader import PyFileConfigLoader

    return Path(PyFileConfigLoader(CONFIG.name, path=str(CONFIG.parent)).load_config().CourseDirectory.root)


def release(course_root: Path, solutions: list[Path]) -> dict[Path, Path]:
    """Stage each solution as an nbgrader assignment (``source/NN_name/NN_name.ipynb``) and run
    ``generate_assignment``: returns solution -> released notebook."""
    api = _nbgrader_api(course_root)
    released = {}
    for sol in solutions:
        problems = lint_notebook(sol)
        if problems:
            raise ValueError(f"{sol.name} breaks the assignment conventions:\n  " + "\n  ".join(problems))
        name = sol.stem
        src_dir = course_root / "source" / name
        src_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(sol, src_dir / sol.name)
        result = api.generate_assignment(name, force=True, create=True)
        out = course_root / "release" / name / sol.name
        if not result.get("success") or not out.exists():
            raise RuntimeError(f"nbgrader generate_assignment {name} failed:\n{result.get('log', '')}{result.get('error', '')}")
        released[sol] = out
    return released


def _exercise_text(released: Path) -> str:
    """The released notebook as committed in exercises/: without the solution run's traces (execution
    timestamps, the interpreter's version), so re-running a solution does not change its exercise."""
    nb = json.loads(released.read_text())
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
    meta = nb.setdefault("metadata", {})
    meta["language_info"] = {"name": meta.get("language_info", {}).get("name", "python")}
    meta.setdefault("tinypaged", {})["generated_from"] = "solutions"
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def _generated(root: Path) -> dict[Path, str]:
    sols = [s for s, _ in pairs(root)]
    with tempfile.TemporaryDirectory(prefix="tinypaged-course-") as tmp:
        return {root / "exercises" / s.name: _exercise_text(out) for s, out in release(Path(tmp), sols).items()}


def generate(root: Path = ROOT) -> list[Path]:
    """Write ``exercises/`` from ``solutions/`` through nbgrader; returns the files that changed."""
    written = []
    for ex, text in _generated(root).items():
        if not ex.exists() or ex.read_text() != text:
            ex.parent.mkdir(exist_ok=True)
            ex.write_text(text)
            written.append(ex)
    return written


def drifted(root: Path = ROOT) -> list[str]:
    """Exercises that are missing or differ from what their solution generates."""
    return [ex.name for ex, text in _generated(root).items() if not ex.exists() or ex.read_text() != text]


# ---------------------------------------------------------------- conventions

def lint_notebook(path: Path) -> list[str]:
    """What breaks the conventions in a solution notebook (empty: fine)."""
    from tinypaged.course import checks
    from tinypaged.course.grading.verify import expected_calls

    nb = nbk.read(path)
    problems = []
    stage = nb.get("metadata", {}).get("tinypaged", {}).get("stage")
    if stage != path.name[:2]:
        problems.append(f"metadata.tinypaged.stage must be {path.name[:2]!r} (got {stage!r})")
    ids = set()
    tests = 0
    for i, cell in enumerate(nb["cells"]):
        src = nbk.source_of(cell)
        meta = nbk.nbgrader_meta(cell)
        where = f"cell {i}"
        gid = nbk.grade_id(cell)
        if meta:
            if not gid:
                problems.append(f"{where}: nbgrader metadata without a grade_id")
            elif gid in ids:
                problems.append(f"{where}: duplicate grade_id {gid!r}")
            ids.add(gid)
            for key in ("grade", "solution", "locked"):
                if not isinstance(meta.get(key), bool):
                    problems.append(f"{where} ({gid}): nbgrader.{key} must be true or false")
            if meta.get("grade") and not (isinstance(meta.get("points"), (int, float)) and meta["points"] > 0):
                problems.append(f"{where} ({gid}): a graded cell needs points > 0")
        if nbk.BEGIN in src and not nbk.is_solution(cell):
            problems.append(f"{where}: '{nbk.BEGIN}' outside a solution cell (nbgrader.solution: true)")
        if nbk.BEGIN_HIDDEN in src and not nbk.is_test(cell):
            problems.append(f"{where}: '{nbk.BEGIN_HIDDEN}' outside a test cell (nbgrader.grade: true)")
        if cell.get("cell_type") == "code" and not meta:
            problems.append(f"{where}: a code cell without nbgrader metadata (make it read-only: locked: true)")
        if nbk.is_solution(cell) and cell.get("cell_type") == "code" and nbk.BEGIN not in src:
            problems.append(f"{where} ({gid}): a solution cell without '{nbk.BEGIN}'")
        if nbk.is_test(cell):
            tests += 1
            calls = expected_calls(src)
            if not calls:
                problems.append(f"{where} ({gid}): a test cell that calls no tinypaged check")
            for name, hidden in calls:
                try:
                    checks.get(name)
                except KeyError:
                    problems.append(f"{where} ({gid}): unknown check {name!r}")
            serving = all(name in checks.REGISTRY and checks.REGISTRY[name].expected is not None for name, _ in calls)
            if serving:  # a serving check compares with transformers on fixed prompts: no hidden cases
                continue
            if not any(h is not None for _, h in calls):
                problems.append(f"{where} ({gid}): no hidden cases (### BEGIN HIDDEN TESTS ... check(..., hidden=SEED))")
            elif nbk.BEGIN_HIDDEN not in src:
                problems.append(f"{where} ({gid}): hidden checks must sit between the HIDDEN TESTS markers")
    if not tests:
        problems.append("no autograded test cell")
    return problems


# ---------------------------------------------------------------- grading

def hidden_paths(submissions: list[Path] = ()) -> list[Path]:
    """What no submission may read: the answers, the course (gradebook, source/, every submission) and the
    notebooks being graded (their folder, or the files themselves when that folder holds the package)."""
    paths = [ROOT / "solutions", ROOT / "instructor", ROOT / "course", ROOT / ".git"]
    for env in ("TINYPAGED_COURSE", "TINYPAGED_EXCHANGE"):
        if os.environ.get(env):
            paths.append(Path(os.environ[env]))
    try:
        paths.append(course_root())
    except Exception:  # nbgrader_config.py unreadable: the defaults above still hold
        pass
    folders = [Path(sub).resolve().parent for sub in submissions]
    for sub, folder in zip(submissions, folders):
        paths.append(Path(sub).resolve() if folder in ROOT.parents or folder == ROOT else folder)
    if len(folders) > 1:  # submissions/<student>/...: the folder that holds them all (its names too)
        common = Path(os.path.commonpath(folders))
        if common not in (Path("/"), Path("/tmp"), Path.home()) and common != ROOT and common not in ROOT.parents:
            paths.append(common)
    return [p.resolve() for p in paths]


def output_problem(flag: str, path: Path, submissions: list[Path]) -> str | None:
    """Why grading must not write ``path`` (given as ``flag``), or None: inside a submission's folder (the next
    learner's run, or that learner's, could read it) or inside the repository (the package's checkout)."""
    real = Path(path).resolve()
    for sub in submissions:
        folder = Path(sub).resolve().parent
        if real == folder or folder in real.parents:
            return f"{flag} {path} is inside the folder of the submission {sub}: write grading outputs elsewhere"
    if real == ROOT or ROOT in real.parents:
        return (f"{flag} {path} is inside the repository ({ROOT}): write grading outputs outside it "
                f"(e.g. --out ../graded)")
    return None


def private_dir(path: Path) -> Path:
    """``path`` created (with its parents) and made readable by its owner only."""
    Path(path).mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return Path(path)


SUBMISSION_TIMEOUT = 900  # wall seconds for one submission's checks, and as many for its feedback run
SUBMISSION_CPU = 3600  # CPU seconds for everything one submission runs


def sandbox_factory(hide: list[Path], unsafe: bool = False, cpu_seconds: int = 1800, memory_gb: float = 8.0,
                    budget=None):
    """``scratch -> Sandbox``: the recipe every sandboxed run of one submission uses (``budget``: that
    submission's :class:`~tinypaged.course.grading.sandbox.SubmissionBudget`, shared by all its sandboxes)."""
    from tinypaged.course.grading.sandbox import Sandbox

    return lambda scratch: Sandbox(scratch, hide=list(hide), cpu_seconds=cpu_seconds,
                                   memory_bytes=int(memory_gb * (1 << 30)), unsafe=unsafe, budget=budget)


def grade_with_ceiling(source: dict, sub: dict, stage: str, make, total_wall: float, **kw) -> dict:
    """:func:`tinypaged.course.grading.verify.grade` with the submission's wall-clock ceiling for the checks'
    process (the job's ``total_wall``); the sandboxes' :class:`~tinypaged.course.grading.sandbox.SubmissionBudget`
    enforces the same ceiling from outside."""
    from tinypaged.course.grading import verify

    return verify.grade(source, sub, stage, make, total_wall=total_wall, **kw)


def max_points(source: dict) -> float:
    """The automatic points of an assignment: its test cells' points (what a report's ``max_score`` is even
    when grading failed, so an error never reads as 0/0)."""
    return round(sum(nbk.points(c) for c in source["cells"] if nbk.is_test(c)), 2)


def budget_finding(budget) -> list[dict]:
    """The finding for a submission stopped by its budget (none when it stayed within)."""
    if budget is None or not budget.exceeded:
        return []
    return [dict(kind="killed", cell=None, line=0, checks=[], what=budget.exceeded + ": what was left was stopped",
                 counted=False)]


# Tags and attributes a feedback page keeps from a learner's markdown and outputs (nh3's defaults, plus ``class``
# for the highlighted code and the tables' alignment): no script, style, iframe, form or event handler survives.
_KEEP_ATTRIBUTES = {"*": {"class", "title", "lang", "align"}}
_URL_SCHEMES = {"http", "https", "mailto"}


def sanitize_html(html: str) -> str:
    """``html`` from a learner (rendered markdown, an output's ``text/html`` or SVG) made safe to show: ``nh3``
    keeps only harmless tags and attributes: no ``<script>``, no ``on*=`` handler, no ``javascript:`` URL."""
    import nh3

    if isinstance(html, bytes):
        html = html.decode(errors="replace")
    attributes = {tag: set(names) for tag, names in nh3.ALLOWED_ATTRIBUTES.items()}
    for tag, names in _KEEP_ATTRIBUTES.items():
        attributes[tag] = attributes.get(tag, set()) | names
    return nh3.clean(html, attributes=attributes, url_schemes=_URL_SCHEMES)


def feedback_exporter():
    """nbconvert's HTML exporter with sanitizing on (``sanitize_html``: no JavaScript outputs, markdown and HTML
    passed through ``clean_html``) and ``clean_html`` being :func:`sanitize_html`."""
    from nbconvert import HTMLExporter

    return HTMLExporter(sanitize_html=True, filters={"clean_html": sanitize_html})


def grade_notebook(path: Path, solutions: Path = ROOT / "solutions", *, unsafe: bool = False,
                   execute: bool = True, feedback: Path | None = None, cell_timeout: int = 600,
                   cpu_timeout: int = 300, notebook_timeout: int | None = None, idle: float = 120.0,
                   hide: list[Path] = (), serving_cpu: int | None = None,
                   submission_timeout: float = SUBMISSION_TIMEOUT, submission_cpu: float = SUBMISSION_CPU) -> dict:
    """Grade one submitted notebook (:func:`tinypaged.course.grading.verify.grade`), then run it for the
    learner's feedback (no grade is taken from that run); the report as a dict.

    The assignment (and stage) is the file name's (:func:`~tinypaged.course.grading.notebook.assignment_of`),
    never the notebook's metadata. The checks get at most ``submission_timeout`` wall seconds, the feedback run as
    many (or ``notebook_timeout``, if smaller), and everything together ``submission_cpu`` CPU seconds. Once the
    instructor's notebook is known, ``max_score`` is its real total, even when grading fails."""
    import time

    from tinypaged.course.grading.execute import run_notebook
    from tinypaged.course.grading.sandbox import SandboxUnavailable, SubmissionBudget, interpreter_problem

    t0 = time.monotonic()
    report: dict = {"notebook": str(path), "score": 0.0, "max_score": 0.0, "tests": [], "errors": [],
                    "findings": [], "manual": [], "manual_points": 0.0}
    try:
        try:
            assignment = nbk.assignment_of(path, solutions)
        except ValueError as e:
            nbk.read(path)  # an unreadable file is named as such first
            raise e
        stage = assignment[:2]
        source_path = Path(solutions) / f"{assignment}.ipynb"
        source = nbk.read(source_path)
        report.update(stage=stage, max_score=max_points(source))
        sub = nbk.read(path)
    except (ValueError, FileNotFoundError) as e:
        report["error"] = str(e)
        return report
    mismatch = nbk.stage_mismatch(sub, stage)
    if mismatch:
        report["findings"].append(dict(kind="stage", cell=None, line=0, checks=[], what=mismatch, counted=False))
    budget = SubmissionBudget(submission_timeout, submission_cpu).phase(submission_timeout, "the checks")
    make = sandbox_factory([*hidden_paths([path]), Path(solutions), *hide], unsafe, budget=budget)
    try:
        why = interpreter_problem(make)
        if why is not None:
            raise _Unstartable(why)
        graded = grade_with_ceiling(source, sub, stage, make, submission_timeout, cell_cpu=cpu_timeout,
                                    check_cpu=cpu_timeout, idle_s=idle, serving_cpu=serving_cpu)
        graded["findings"] = report["findings"] + graded.get("findings", []) + budget_finding(budget)
        report.update(graded)
        if execute and not budget.exceeded:
            limit = submission_timeout if notebook_timeout is None else min(notebook_timeout, submission_timeout)
            budget.phase(limit, "the feedback run")
            executed = run_notebook(nbk.assemble(source, sub), make, cell_timeout, limit, cpu_timeout, stage=stage)
            stopped = executed.get("metadata", {}).get("tinypaged", {}).get("stopped")
            if stopped:
                report["findings"].append(dict(kind="killed", cell=stopped.get("cell"), line=0, checks=[],
                                               what=f"feedback run: {stopped['why']}", counted=False))
            if feedback is not None:  # named after the folder too: every submission may be called NN_name.ipynb
                out = Path(feedback) / f"{Path(path).resolve().parent.name}-{Path(path).stem}.html"
                write_feedback(executed, report, source, out)
                report["feedback"] = str(out)
    except (SandboxUnavailable, _Unstartable) as e:
        report["error"] = str(e)
    except Exception as e:  # grading itself failed: an error on the submission's line, never a silent 0
        report["error"] = f"grading failed: {type(e).__name__}: {e}"
    report["max_score"] = report.get("max_score") or max_points(source)
    report.update(notebook=str(path), stage=stage, seconds=round(time.monotonic() - t0, 1),
                  source=str(source_path.relative_to(solutions.parent))
                  if source_path.is_relative_to(solutions.parent) else str(source_path))
    return report


class _Unstartable(RuntimeError):
    """The grader's interpreter cannot start inside the sandbox (one line): grading stops, blaming no one's code."""


def write_feedback(executed: dict, report: dict, source: dict, path: Path) -> None:
    """The learner's notebook as HTML: their outputs, each test cell's verified verdict, hidden tests removed."""
    import copy

    import nbformat

    from tinypaged.course.grading.verify import apply_to_notebook

    nb = apply_to_notebook(copy.deepcopy(executed), report, source)
    for cell in nb["cells"]:
        if nbk.is_test(cell):
            cell["source"] = re.sub(rf"\n?{nbk.BEGIN_HIDDEN}.*?{nbk.END_HIDDEN}\n?", "\n", nbk.source_of(cell),
                                    flags=re.S)
    nb["cells"].insert(0, {"cell_type": "markdown", "metadata": {}, "source": "```\n" + format_report(report) + "\n```"})
    path.parent.mkdir(parents=True, exist_ok=True)
    body, _ = feedback_exporter().from_notebook_node(nbformat.from_dict(nb))
    path.write_text(body)


def summary(r: dict) -> str:
    """One line for the findings of a report (tampering, reuse, killed runs, refusals): "" when clean."""
    parts = []
    if r.get("error"):
        parts.append(f"AUTOGRADE FAILED: {r['error']}")
    for f in r.get("findings", []):
        if f.get("counted") or f["kind"] == "killed":
            where = f"cell {f['cell']}, line {f['line']}: " if f.get("cell") is not None and f.get("line") else \
                (f"cell {f['cell']}: " if f.get("cell") is not None else "")
            what = f"uses the package's {f['what']}" if f["kind"] == "reuse" and not f.get("runtime") else f["what"]
            parts.append(f"{f['kind']}: {where}{what}")
    return "; ".join(dict.fromkeys(parts))


def format_report(r: dict) -> str:
    from tinypaged.course.grading.verify import verdict_lines

    lines = [f"{r['notebook']}: {r['score']:g}/{r['max_score']:g}"]  # scripts/gpu_check.sh greps this line
    if r.get("stage"):
        lines.append(f"  stage {r['stage']}, graded against {r.get('source', '?')}"
                     + (f" in {r['seconds']:g} s" if r.get("seconds") is not None else ""))
    if r.get("error"):
        lines.append(f"  ERROR {r['error']}")
    for t in r["tests"]:
        lines.extend("  " + line for line in verdict_lines(t))
    for e in r["errors"]:
        lines.append(f"  your cell {e['grade_id'] or e['cell']} raised {e['error']}")
    for f in r["findings"]:
        if f.get("counted") or f["kind"] in ("killed", "stage"):
            what = f"uses the package's reference implementation {f['what']}" \
                if f["kind"] == "reuse" and not f.get("runtime") else f["what"]
            where = f"cell {f['cell']}, line {f['line']}: " if f.get("line") else ""
            lines.append(f"  {f['kind']}: {where}{what}")
    if r.get("manual_points"):
        lines.append(f"  + {r['manual_points']:g} points of written answers, graded by hand (not in the score above)")
    return "\n".join(lines)


CSV_FIELDS = ["notebook", "stage", "auto_score", "auto_max", "written_max", "status", "findings", "seconds"]


def write_csv(reports: list[dict], path: Path) -> None:
    """One row per submission: automatic points apart from the written ones (graded by hand), a status
    (PASS, FAIL, FLAGGED when something was found, ERROR when grading failed) and every finding on the row."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", newline="") as f:  # the owner's
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in reports:
            w.writerow([r["notebook"], r.get("stage"), f"{r['score']:g}", f"{r['max_score']:g}",
                        f"{r.get('manual_points', 0):g}", status(r), summary(r), r.get("seconds", "")])


def status(r: dict) -> str:
    if r.get("error"):
        return "ERROR"
    if any(f.get("counted") for f in r.get("findings", [])):
        return "FLAGGED"
    return "PASS" if _complete(r) else "FAIL"


def _complete(r: dict) -> bool:
    return not r.get("error") and r["max_score"] > 0 and r["score"] >= r["max_score"]


def _positive_int(text: str) -> int:
    """argparse's type for a count of seconds that must be at least 1 (argparse names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tinypaged.course", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("generate", help="write exercises/ from solutions/ (nbgrader generate_assignment)")
    sub.add_parser("check", help="fail if an exercise differs from its generated form")
    lint = sub.add_parser("lint", help="check solution notebooks against the assignment conventions")
    lint.add_argument("notebooks", nargs="*", type=Path)
    rel = sub.add_parser("release", help="set up the nbgrader course (source/, release/, gradebook)")
    rel.add_argument("assignments", nargs="*", help="assignment names (default: every solution notebook)")
    rel.add_argument("--course", type=Path, default=None, help="course root (default: nbgrader_config.py's)")
    se = sub.add_parser("student-edition", help="write the package with the assignments' graded bodies stubbed "
                                               "(tinypaged.course.student_edition)")
    se.add_argument("out", type=Path, help="a new folder for the edition (pip install it, or put it on PYTHONPATH)")
    se.add_argument("assignments", nargs="*", help="assignment names (default: every solution notebook)")
    g = sub.add_parser("grade", help="run and score submitted notebooks, each in its own kernel")
    g.add_argument("notebooks", nargs="+", type=Path)
    g.add_argument("--out", type=Path, help="write grades.csv and feedback/ into this folder (private, 0700; outside "
                   "the submissions' folders and the repository)")
    g.add_argument("--json", action="store_true", help="print the reports as JSON")
    g.add_argument("--csv", type=Path, help="also write one row per submission to this CSV file")
    g.add_argument("--feedback", type=Path, help="write each learner's notebook as HTML feedback into this folder")
    g.add_argument("--cpu-timeout", type=int, default=300,
                   help="CPU seconds per cell and per check (default 300; CPU time, so load does not trip it)")
    g.add_argument("--serving-cpu-timeout", type=_positive_int, default=None, metavar="SECONDS",
                   help="CPU seconds a serving check (one that loads a model) may use, never less than "
                        "--cpu-timeout (default 300)")
    g.add_argument("--timeout", type=int, default=600,
                   help="seconds a cell of the feedback run may go without using the CPU (a hang; default 600)")
    g.add_argument("--idle", type=float, default=120.0,
                   help="stop a check that uses no CPU for this many seconds (default 120)")
    g.add_argument("--notebook-timeout", type=int, default=None,
                   help="wall seconds per feedback run (default and at most: --submission-timeout)")
    g.add_argument("--submission-timeout", type=_positive_int, default=SUBMISSION_TIMEOUT, metavar="SECONDS",
                   help=f"firm wall-clock ceiling per submission: this many seconds for its checks and as many "
                        f"for its feedback run (default {SUBMISSION_TIMEOUT})")
    g.add_argument("--submission-cpu", type=_positive_int, default=SUBMISSION_CPU, metavar="SECONDS",
                   help=f"CPU seconds for everything one submission runs, all processes together (default "
                        f"{SUBMISSION_CPU}; enforced through cgroups)")
    g.add_argument("--no-execute", action="store_true",
                   help="grade only: skip the feedback run of the notebook (the grade never comes from it)")
    g.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="grade without bubblewrap: the submissions can read the answers and write anywhere you can")
    g.add_argument("--solutions", type=Path, default=ROOT / "solutions", help="the instructor's notebooks")
    g.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (default 1)")
    args = ap.parse_args(argv)

    if args.cmd == "generate":
        for p in generate():
            print(f"wrote {p.relative_to(ROOT)}")
        return 0
    if args.cmd == "check":
        bad = drifted()
        if bad:
            print("exercises out of date (run: python -m tinypaged.course generate): " + ", ".join(bad))
            return 1
        print("exercises match their solutions")
        return 0
    if args.cmd == "lint":
        status = 0
        for nb in args.notebooks or [s for s, _ in pairs()]:
            problems = lint_notebook(nb)
            print(f"{nb}: " + ("ok" if not problems else f"{len(problems)} problem(s)"))
            for p in problems:
                print(f"  {p}")
            status |= bool(problems)
        return status
    if args.cmd == "student-edition":
        from tinypaged.course import student_edition

        try:
            report = student_edition.write(args.out, args.assignments or None)
        except (FileExistsError, ValueError) as e:
            print(f"student-edition: {e}", file=sys.stderr)
            return 2
        for path, functions in sorted(report.items()):
            print(f"{path}: {len(functions)} stubbed ({', '.join(functions)})")
        print(f"wrote the student edition to {args.out} (install it with: pip install --no-deps {args.out})")
        return 0
    if args.cmd == "release":
        course = args.course or course_root()
        sols = [s for s, _ in pairs()]
        unknown = set(args.assignments) - {s.stem for s in sols}
        if unknown:
            print(f"no solution notebook for {sorted(unknown)}; known: {[s.stem for s in sols]}")
            return 1
        for sol, out in release(course, [s for s in sols if not args.assignments or s.stem in args.assignments]).items():
            print(f"released {out}")
        return 0

    from concurrent.futures import ThreadPoolExecutor

    from tinypaged.course.grading.sandbox import UNSAFE_WARNING, bwrap

    if args.unsafe_no_sandbox:
        print(UNSAFE_WARNING, file=sys.stderr)
    elif bwrap() is None:
        from tinypaged.course.grading.sandbox import INSTALL_HINT

        print(f"refusing to grade: no sandbox (bwrap not found; {INSTALL_HINT}). "
              "--unsafe-no-sandbox grades without one.", file=sys.stderr)
        return 2

    if args.out is not None:
        args.csv = args.csv or args.out / "grades.csv"
        args.feedback = args.feedback or args.out / "feedback"
    outputs = [(flag, p) for flag, p in (("--out", args.out), ("--csv", args.csv), ("--feedback", args.feedback))
               if p is not None]
    for flag, p in outputs:
        problem = output_problem(flag, p, args.notebooks)
        if problem:
            print(f"refusing to grade: {problem}", file=sys.stderr)
            return 2
    for folder in {args.out, args.feedback} - {None}:
        private_dir(folder)
    if args.csv is not None:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
    hide = [*hidden_paths(args.notebooks), *(p for _, p in outputs)]

    def one(nb):
        return grade_notebook(nb, args.solutions, unsafe=args.unsafe_no_sandbox, execute=not args.no_execute,
                              feedback=args.feedback, cell_timeout=args.timeout, cpu_timeout=args.cpu_timeout,
                              notebook_timeout=args.notebook_timeout, idle=args.idle, hide=hide,
                              serving_cpu=args.serving_cpu_timeout, submission_timeout=args.submission_timeout,
                              submission_cpu=args.submission_cpu)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # each notebook runs in its own sandboxed processes
        reports = list(pool.map(one, args.notebooks))
    if args.csv:
        write_csv(reports, args.csv)
    if args.json:
        print(json.dumps(reports, indent=1))
    else:
        print("\n".join(format_report(r) for r in reports))
    return 0 if all(_complete(r) for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
