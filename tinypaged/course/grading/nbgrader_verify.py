"""nbgrader's ``autograde`` with the quick grader's protection (configured in ``nbgrader_config.py``).

* :class:`CompareGivenCells` replaces nbgrader's ``OverwriteCells`` (a sanitizing step): it puts the
  instructor's locked and test cells back as nbgrader does, but compares each with what the learner was
  *given* (the released cell: hidden tests removed), not with the instructor's source, so an honest
  notebook raises no "checksum has changed" warning; a test cell that was edited or deleted, or whose
  points, cell type or lock changed, is recorded in the notebook's ``metadata.tinypaged.tampered`` (set
  here only) and becomes a counted finding: the submission is FLAGGED, graded from the instructor's cells.
* :class:`SandboxedExecute` replaces nbgrader's ``Execute``: the submission runs in a kernel inside the
  sandbox (:mod:`~tinypaged.course.grading.sandbox`), never in nbgrader's own environment, so it cannot
  read ``source/``, the gradebook or other submissions, nor write anything but its scratch directory.
  That run is the learner's feedback only.
* :class:`VerifyChecks` grades the submission as the quick grader does
  (:func:`tinypaged.course.grading.verify.grade`: the learner's code extracted by the instructor's
  ``grade_id``, the checks in a sandboxed probe, the verdicts computed here) and writes the verdicts into
  the test cells so nbgrader's own rule (an error: 0; a number: partial credit) stores them. If grading
  itself fails, every test cell gets 0 and the submission is flagged (never a silent 0.0).
* :class:`RecordFindings` (after ``SaveAutoGrades``) puts one line per submission into the gradebook:
  the comment of the notebook's first graded cell says what was found (tampering, reuse, a killed run,
  an autograde failure), and the submitted notebook is flagged for a human to look at.
* :class:`TinypagedCsvExport` (``nbgrader export``) writes one row per student and assignment with the
  automatic and the written points apart, the status and that findings line.

* :class:`SealedAutograde` and :class:`SealedFeedback` (installed by :func:`seal_nbgrader`, which
  ``nbgrader_config.py`` calls) replace nbgrader's ``Autograde`` and ``GenerateFeedback`` converters: nothing but
  the graded notebooks is ever copied into ``autograded/`` or ``feedback/`` (nbgrader copies every other file of
  the folder, following links: the instructor's source, ``/etc/shadow``, another learner's notebook); a
  submission folder holding a symbolic link, anything that is not a regular file, or any file but the
  assignment's notebooks (and nbgrader's own ``timestamp.txt``) is refused before nbgrader reads a byte of it:
  FLAGGED, 0 for every graded cell, the reason in the gradebook's comment (:func:`record_refusal`); and a
  failure of nbgrader's own steps (``CheckCellMetadata`` on tampered metadata, a duplicated ``grade_id`` ...)
  is recorded as ``AUTOGRADE FAILED`` with the step and its message (a FAILED row), never a silent 0.
* The feedback HTML (``generate_feedback``) is sanitized: ``HTMLExporter.sanitize_html`` with ``clean_html``
  being :func:`tinypaged.course.coursework.sanitize_html` (``nh3``), set in ``nbgrader_config.py``.

The instructor's notebook comes from the course's ``source/<assignment>/<notebook>.ipynb`` (the same
files ``generate_assignment`` released), else from ``solutions/`` by the **notebook's name**
(:func:`~tinypaged.course.grading.notebook.assignment_of`), never by the stage its metadata claims.
Each submission runs under one :class:`~tinypaged.course.grading.sandbox.SubmissionBudget`
(``submission_timeout`` wall seconds for the feedback run and as many for the checks, ``submission_cpu`` CPU
seconds in all; configurable on ``SandboxedExecute`` and ``VerifyChecks``).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from nbformat import from_dict
from nbgrader.converters import Autograde, GenerateFeedback
from nbgrader.plugins import ExportPlugin
from nbgrader.preprocessors import NbGraderPreprocessor, OverwriteCells
from traitlets import Float, Integer

FINDINGS_PREFIX = "tinypaged grading: "
TAMPERED = "tampered"  # metadata.tinypaged.tampered: [{"grade_id", "what"}], written by CompareGivenCells only


def released_source(source: str) -> str:
    """A locked cell's code as generate_assignment released it: the hidden-tests region removed (as nbgrader's
    ClearHiddenTests does, line by line)."""
    from tinypaged.course.grading.notebook import strip_hidden

    return strip_hidden(source)


def _same_code(a: str, b: str) -> bool:
    """Equal but for trailing whitespace (an editor may strip it)."""
    return [line.rstrip() for line in a.rstrip().split("\n")] == [line.rstrip() for line in b.rstrip().split("\n")]


class CompareGivenCells(OverwriteCells):
    """nbgrader's ``OverwriteCells``, judging a locked cell against the released one (see the module docstring)."""

    def preprocess(self, nb, resources):
        from nbgrader.api import Gradebook

        from tinypaged.course.grading import notebook as nbk

        meta = resources["nbgrader"]
        found: list[dict] = []
        with Gradebook(meta["db_url"]) as gb:
            source_nb = gb.find_notebook(meta["notebook"], meta["assignment"])
            graded = {c.name: c for c in source_nb.grade_cells}
            locked = {c.name: c for c in source_nb.source_cells if c.locked}
            present = set()
            for cell in nb.cells:
                gid = nbk.grade_id(cell)
                if gid is None or gid in present or (gid not in locked and gid not in graded):
                    continue
                present.add(gid)
                what = []
                src = locked.get(gid)
                if src is not None:
                    if cell.cell_type != src.cell_type:
                        what.append(f"its type changed to {cell.cell_type}")
                    elif not _same_code(nbk.source_of(cell), released_source(src.source)):
                        what.append("its code was edited")
                    if not nbk.nbgrader_meta(cell).get("locked"):
                        what.append("it was unlocked")
                g = graded.get(gid)
                if g is not None and nbk.nbgrader_meta(cell).get("grade"):
                    try:
                        pts = float(nbk.nbgrader_meta(cell).get("points"))
                    except (TypeError, ValueError):
                        pts = None
                    if pts != float(g.max_score):
                        what.append(f"its points changed ({g.max_score:g} -> {nbk.nbgrader_meta(cell).get('points')})")
                elif g is not None:
                    what.append("it is no longer marked as graded")
                if what:
                    kind = "test cell" if g is not None and src is not None else "cell"
                    found.append({"grade_id": gid, "what": f"{kind} {gid!r}: " + ", ".join(what)})
                if src is not None:  # the instructor's marks, whatever the submission says (nbgrader keeps some)
                    cell.metadata.setdefault("nbgrader", {}).update(grade=g is not None, solution=False, locked=True)
                    if g is not None:
                        cell.metadata.nbgrader["points"] = float(g.max_score)
            for gid, g in graded.items():
                if gid not in present and gid in locked:
                    found.append({"grade_id": gid, "what": f"test cell {gid!r}: deleted"})
        for f in found:
            self.log.warning("tinypaged: %s (graded from the instructor's cell)", f["what"])
        nb.metadata.setdefault("tinypaged", {})[TAMPERED] = found  # whatever the submission said there
        return super().preprocess(nb, resources)

    def report_change(self, name, attr, old, new) -> None:
        # nbgrader's checksum is the source's (hidden tests included), which a released test cell never matches:
        # real edits are reported above, against the released cell, so this one is left out
        if attr == "checksum":
            self.log.debug("cell %s: put back from the source", name)
            return
        super().report_change(name, attr, old, new)


def _course_paths(resources) -> tuple[Path, str, str]:
    meta = resources.get("nbgrader", {})
    autograded = Path(resources.get("metadata", {}).get("path", "."))  # <course>/autograded/<student>/<assignment>
    return autograded.resolve().parents[2], meta.get("assignment", ""), meta.get("notebook", "")


def _source(resources, nb) -> tuple[dict, str]:
    from tinypaged.course import coursework
    from tinypaged.course.grading import notebook as nbk

    course, assignment, notebook = _course_paths(resources)
    src = course / "source" / assignment / f"{notebook}.ipynb"
    if not src.exists():  # by the notebook's (or assignment's) name, never by the stage its metadata claims
        solutions = coursework.ROOT / "solutions"
        try:
            name = nbk.assignment_of(Path(f"{notebook}.ipynb"), solutions)
        except ValueError:
            name = nbk.assignment_of(Path(f"{assignment}.ipynb"), solutions)
        src = solutions / f"{name}.ipynb"
    source = nbk.read(src)
    return source, nbk.stage_of(source, src) or ""


def _refuse_links(resources) -> None:
    """A submitted notebook (or its folder) that is a symbolic link is refused, naming it: nbgrader would read
    whatever it points to (``solutions/``) as the learner's work."""
    import os

    course, assignment, notebook = _course_paths(resources)
    student = resources.get("nbgrader", {}).get("student", "")
    path = course / "submitted" / student / assignment / f"{notebook}.ipynb"
    for p in (path, path.parent):
        if student and p.is_symlink():
            raise ValueError(f"{p} is a symbolic link (to {os.readlink(p)}): the submission must be the notebook file")


def _budget(resources, step, phase: str):
    """The submission's :class:`~tinypaged.course.grading.sandbox.SubmissionBudget` (made by the first step that
    runs it, shared through ``resources``), in a new phase with ``step``'s wall-clock ceiling."""
    from tinypaged.course.grading.sandbox import SubmissionBudget

    mine = resources.setdefault("tinypaged", {})
    if mine.get("budget") is None:
        mine["budget"] = SubmissionBudget(step.submission_timeout, step.submission_cpu)
    return mine["budget"].phase(step.submission_timeout, phase)


def _sandbox(resources, budget=None):
    from tinypaged.course import coursework

    course, _, _ = _course_paths(resources)
    return coursework.sandbox_factory([*coursework.hidden_paths(), course], budget=budget)


class SandboxedExecute(NbGraderPreprocessor):
    """Run the submission for feedback, in the sandbox (nbgrader's ``Execute`` would run it unprotected)."""

    timeout = Integer(600, help="seconds a cell may go without using the CPU (a hang) before its kernel is stopped"
                      ).tag(config=True)
    cpu_timeout = Integer(300, help="CPU seconds per cell").tag(config=True)
    submission_timeout = Integer(900, help="wall-clock seconds for the whole feedback run of one submission"
                                 ).tag(config=True)
    submission_cpu = Integer(3600, help="CPU seconds for everything one submission runs (its checks too)"
                             ).tag(config=True)

    def preprocess(self, nb, resources):
        from tinypaged.course.grading import notebook as nbk
        from tinypaged.course.grading.execute import run_notebook

        plain = json.loads(json.dumps(nb))
        try:
            source, stage = _source(resources, plain)
            run = nbk.assemble(source, plain)
            budget = _budget(resources, self, "the feedback run")
            executed = run_notebook(run, _sandbox(resources, budget), self.timeout, self.submission_timeout,
                                    self.cpu_timeout, stage=stage or None)
        except Exception as e:  # grading still happens (VerifyChecks); the feedback says why it is missing
            self.log.error("tinypaged: the feedback run failed: %s", e)
            resources.setdefault("tinypaged", {})["feedback_error"] = str(e)
            return nb, resources
        outputs = {nbk.grade_id(c): c for c in executed["cells"] if nbk.grade_id(c)}
        for cell in nb.cells:
            gid = nbk.grade_id(cell)
            if cell.cell_type == "code" and gid in outputs:
                cell.outputs = [from_dict(o) for o in outputs[gid].get("outputs", [])]
        stopped = executed.get("metadata", {}).get("tinypaged", {}).get("stopped")
        if stopped:
            resources.setdefault("tinypaged", {})["feedback_stopped"] = stopped
        return nb, resources


class VerifyChecks(NbGraderPreprocessor):
    cpu_timeout = Integer(300, help="CPU seconds per learner cell and per check").tag(config=True)
    idle = Float(120.0, help="stop a check that uses no CPU for this many seconds").tag(config=True)
    submission_timeout = Integer(900, help="wall-clock seconds for all the checks of one submission (the job's "
                                 "total_wall)").tag(config=True)
    submission_cpu = Integer(3600, help="CPU seconds for everything one submission runs").tag(config=True)

    def preprocess(self, nb, resources):
        from tinypaged.course import checks
        from tinypaged.course.grading import notebook as nbk
        from tinypaged.course.grading.verify import apply_to_notebook

        plain = json.loads(json.dumps(nb))
        source = None
        try:
            _refuse_links(resources)
            source, stage = _source(resources, plain)
            handed_in = nbk.stage_of(plain)
            if handed_in and stage and handed_in != stage:  # another assignment's notebook is refused, not graded
                raise ValueError(f"the submission is a stage {handed_in} notebook, not stage {stage} "
                                 f"({resources['nbgrader'].get('assignment')})")
            from tinypaged.course import coursework
            from tinypaged.course.grading.sandbox import interpreter_problem

            budget = _budget(resources, self, "the checks")
            make = _sandbox(resources, budget)
            why = interpreter_problem(make)
            if why is not None:
                raise RuntimeError(why)
            report = coursework.grade_with_ceiling(source, plain, stage, make, self.submission_timeout,
                                                   cell_cpu=self.cpu_timeout, check_cpu=self.cpu_timeout,
                                                   idle_s=self.idle)
            report["findings"] = report.get("findings", []) + coursework.budget_finding(budget)
        except Exception as e:  # a failed autograde is flagged with its reason, never a silent 0
            self.log.error("tinypaged: autograde failed: %s", e)
            real_max = sum(nbk.points(c) for c in (source or plain)["cells"] if nbk.is_test(c))
            report = {"error": f"{type(e).__name__}: {e}", "score": 0.0, "max_score": real_max, "findings": [],
                      "manual_points": 0.0, "errors": [],
                      "tests": [{"grade_id": nbk.grade_id(c), "cell": i, "points": nbk.points(c), "score": 0.0,
                                 "status": checks.FAIL, "message": f"autograde failed: {e}", "checks": []}
                                for i, c in enumerate((source or plain)["cells"]) if nbk.is_test(c)]}
        stopped = resources.get("tinypaged", {}).get("feedback_stopped")
        if stopped:
            report["findings"].append(dict(kind="killed", cell=stopped.get("cell"), line=0, checks=[],
                                           what=f"feedback run: {stopped['why']}", counted=False))
        tampered = nb.metadata.get("tinypaged", {}).get(TAMPERED, [])
        cells = {nbk.grade_id(c): i for i, c in enumerate((source or plain)["cells"]) if nbk.grade_id(c)}
        for t in tampered if isinstance(tampered, list) else []:
            if isinstance(t, dict) and isinstance(t.get("what"), str):
                report["findings"].append(dict(kind="tamper", cell=cells.get(t.get("grade_id")), line=0, checks=[],
                                               what=t["what"] + " (graded from the instructor's cell)", counted=True))
        apply_to_notebook(plain, report, source or plain)
        by_id = {nbk.grade_id(c): c for c in plain["cells"] if nbk.grade_id(c)}
        graded = {r["grade_id"] for r in report["tests"]}  # the source's test cells, whatever the metadata says
        for cell in nb.cells:
            gid = nbk.grade_id(cell)
            if cell.cell_type == "code" and gid in graded and gid in by_id:
                cell.outputs = [from_dict(o) for o in by_id[gid]["outputs"]]
        present = {nbk.grade_id(c) for c in nb.cells}
        for extra in plain["cells"][len(nb.cells):]:  # test cells the submission lost, restored with their verdicts
            if nbk.grade_id(extra) not in present:
                nb.cells.append(from_dict(extra))
        resources.setdefault("tinypaged", {})["report"] = report
        return nb, resources


class RecordFindings(NbGraderPreprocessor):
    """One line per submission in the gradebook for every finding, and the notebook flagged."""

    def preprocess(self, nb, resources):
        from nbgrader.api import Gradebook

        from tinypaged.course import coursework
        from tinypaged.course.grading import notebook as nbk

        report = resources.get("tinypaged", {}).get("report")
        if report is None:
            return nb, resources
        line = coursework.summary(report)
        meta = resources["nbgrader"]
        first = next((nbk.grade_id(c) for c in nb.cells if nbk.grade_id(c) and nbk.is_solution(c)), None)
        with Gradebook(meta["db_url"]) as gb:
            sub = gb.find_submission_notebook(meta["notebook"], meta["assignment"], meta["student"])
            sub.flagged = bool(line)
            for comment in sub.comments:  # an earlier run's line (a refusal, a failure) is not this run's
                if comment.auto_comment and comment.auto_comment.startswith(FINDINGS_PREFIX):
                    comment.auto_comment = None
            if first is not None:
                try:
                    comment = gb.find_comment(first, meta["notebook"], meta["assignment"], meta["student"])
                    comment.auto_comment = FINDINGS_PREFIX + (line or "nothing found") + \
                        f" (automatic {report['score']:g}/{report['max_score']:g}; written answers graded by hand)"
                except Exception:  # no comment row for that cell: the flag still marks the submission
                    pass
            gb.db.commit()
        if line:
            self.log.warning("tinypaged: %s: %s", meta["student"], line)
        return nb, resources


class TinypagedCsvExport(ExportPlugin):
    """nbgrader's CSV plus the automatic and written points apart, the status and the findings line."""

    def export(self, gradebook) -> None:
        import csv

        dest = self.to or "grades.csv"
        fields = ["assignment", "student_id", "auto_score", "auto_max", "written_score", "written_max", "score",
                  "max_score", "status", "findings"]
        with open(dest, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(fields)
            for assignment in gradebook.assignments:
                if self.assignment and assignment.name not in self.assignment:
                    continue
                for student in gradebook.students:
                    if self.student and student.id not in self.student:
                        continue
                    w.writerow(self._row(gradebook, assignment, student))

    @staticmethod
    def _row(gb, assignment, student) -> list:
        from nbgrader.api import MissingEntry

        auto_max = sum(c.max_score for nb in assignment.notebooks for c in nb.grade_cells if c.cell_type == "code")
        written_max = sum(c.max_score for nb in assignment.notebooks for c in nb.grade_cells if c.cell_type != "code")
        try:
            sub = gb.find_submission(assignment.name, student.id)
        except MissingEntry:
            return [assignment.name, student.id, 0, _r(auto_max), "", _r(written_max), 0, _r(assignment.max_score),
                    "MISSING", ""]
        auto = written = 0.0
        written_done = True
        findings, flagged = [], False
        for snb in sub.notebooks:
            flagged |= bool(snb.flagged)
            for g in snb.grades:
                if g.cell.cell_type == "code":
                    auto += g.score or 0.0
                else:
                    written += g.score or 0.0
                    written_done &= g.manual_score is not None
            for c in snb.comments:
                if c.auto_comment and c.auto_comment.startswith(FINDINGS_PREFIX):
                    findings.append(c.auto_comment[len(FINDINGS_PREFIX):])
        findings = list(dict.fromkeys(findings))
        status = "FAILED" if any("AUTOGRADE FAILED" in f for f in findings) else "FLAGGED" if flagged else \
            ("GRADED" if written_done else "WRITTEN ANSWERS TO GRADE")
        return [assignment.name, student.id, _r(auto), _r(auto_max), _r(written) if written_done else "",
                _r(written_max), _r(sub.score), _r(assignment.max_score), status, " | ".join(findings)]


def _r(x) -> str:
    return f"{round(float(x or 0), 2):g}"


# ---------------------------------------------------------------- nbgrader's converters, sealed

TIMESTAMP = "timestamp.txt"  # nbgrader's own record of when a submission was handed in (kept, checked)
MAX_TIMESTAMP_BYTES = 4096


def submission_problems(folder: Path, notebooks: list[str]) -> list[str]:
    """What makes a submission folder unsafe to hand to nbgrader (empty: fine). Invariants checked without
    following any link (``lstat``): the folder and its parent are real folders; every entry is a regular file;
    the only entries are the assignment's notebooks (``NAME.ipynb`` for NAME in ``notebooks``) and nbgrader's
    ``timestamp.txt``; a notebook is at most :data:`~tinypaged.course.grading.notebook.MAX_NOTEBOOK_BYTES`, the
    timestamp at most 4 KiB. Each problem is one line naming the entry."""
    from tinypaged.course.grading.notebook import MAX_NOTEBOOK_BYTES

    folder = Path(folder)
    problems = []
    for p in (folder.parent, folder):
        try:
            mode = os.lstat(p).st_mode
        except OSError as e:
            return [f"{p} cannot be read ({e.strerror})"]
        if stat.S_ISLNK(mode):
            return [f"{p} is a symbolic link (to {os.readlink(p)}): hand in the notebook file itself"]
        if not stat.S_ISDIR(mode):
            return [f"{p} is not a folder"]
    allowed = {f"{n}.ipynb": MAX_NOTEBOOK_BYTES for n in notebooks} | {TIMESTAMP: MAX_TIMESTAMP_BYTES}
    for name in sorted(os.listdir(folder)):
        st = os.lstat(folder / name)
        if stat.S_ISLNK(st.st_mode):
            problems.append(f"{name} is a symbolic link (to {os.readlink(folder / name)})")
        elif not stat.S_ISREG(st.st_mode):
            problems.append(f"{name} is not a regular file ({stat.filemode(st.st_mode)})")
        elif name not in allowed:
            problems.append(f"{name} is not part of the assignment (only {', '.join(sorted(allowed))})")
        elif st.st_size > allowed[name]:
            problems.append(f"{name} is {st.st_size} bytes, over the limit of {allowed[name]}")
    return problems


def _record(db_url: str, assignment: str, student: str, line: str, notebooks: list[str] | None = None) -> None:
    """Store ``line`` as the tinypaged comment of each listed notebook of the submission (all when None): every
    graded cell 0 (automatic) and needing no manual grade, the notebook flagged; the student and the submission
    are created when nbgrader has not made them yet."""
    from nbgrader.api import Gradebook

    with Gradebook(db_url) as gb:
        gb.update_or_create_student(student)
        sub = gb.update_or_create_submission(assignment, student)
        for snb in sub.notebooks:
            if notebooks is not None and snb.name not in notebooks:
                continue
            snb.flagged = True
            for g in snb.grades:
                g.auto_score, g.needs_manual_grade = 0.0, False
            for comment in snb.comments:  # every comment row: the export keeps one copy of the line
                comment.auto_comment = FINDINGS_PREFIX + line + " (automatic 0; written answers graded by hand)"
        gb.db.commit()


def record_refusal(db_url: str, assignment: str, student: str, problems: list[str]) -> str:
    """A refused submission in the gradebook: FLAGGED, 0, the reason as its findings line (returned)."""
    line = "refused: the submission folder " + "; ".join(problems)
    _record(db_url, assignment, student, line)
    return line


def _failed_step(exc: BaseException) -> str:
    """The nbconvert/nbgrader preprocessor whose code raised ``exc`` (its class name), else the exception's."""
    from nbconvert.preprocessors import Preprocessor

    name = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, Preprocessor):
            name = type(owner).__name__
        tb = tb.tb_next
    return name or type(exc).__name__


class _NotebooksOnly:
    """Mixin: ``init_assignment`` copies no file but the notebooks (nbgrader copies every other file of the input
    folder, and of the course's source folder, following links)."""

    def init_assignment(self, assignment_id: str, student_id: str) -> None:
        ignore = list(self.coursedir.ignore)
        self.coursedir.ignore = ignore + ["*"]  # nbgrader's find_all_files then finds nothing to copy
        try:
            super().init_assignment(assignment_id, student_id)
        finally:
            self.coursedir.ignore = ignore


class SealedAutograde(_NotebooksOnly, Autograde):
    """nbgrader's ``Autograde`` that refuses unsafe submission folders (:func:`submission_problems`), copies only
    the notebook, and records a failure of any of nbgrader's steps as ``AUTOGRADE FAILED`` with its reason."""

    def init_destination(self, assignment_id: str, student_id: str) -> bool:
        from nbgrader.api import Gradebook, MissingEntry

        folder = Path(self._format_source(assignment_id, student_id))
        try:
            with Gradebook(self.coursedir.db_url, self.coursedir.course_id) as gb:
                names = [n.name for n in gb.find_assignment(assignment_id).notebooks]
        except MissingEntry:
            names = [Path(n).stem for n in self.notebooks]
        problems = submission_problems(folder, names)
        if not problems:
            return super().init_destination(assignment_id, student_id)
        line = record_refusal(self.coursedir.db_url, assignment_id, student_id, problems)
        self.log.warning("tinypaged: %s: %s", student_id, line)
        dest = Path(self._format_dest(assignment_id, student_id))
        if dest.is_dir() and not dest.is_symlink():  # an earlier run's output is not this submission's grade
            import shutil

            shutil.rmtree(dest, ignore_errors=True)
        return False

    def convert_single_notebook(self, notebook_filename: str) -> None:
        try:
            super().convert_single_notebook(notebook_filename)
        except Exception as e:
            ids = self.init_single_notebook_resources(notebook_filename)["nbgrader"]
            said = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            line = f"AUTOGRADE FAILED: nbgrader's {_failed_step(e)} stopped: {said}"
            try:
                _record(self.coursedir.db_url, ids["assignment"], ids["student"], line, [ids["notebook"]])
            except Exception as db_error:  # the failure itself is still raised (and logged) by nbgrader
                self.log.error("tinypaged: could not record the failure: %s", db_error)
            self.log.error("tinypaged: %s: %s", ids["student"], line)
            raise


class SanitizeForFeedback(NbGraderPreprocessor):
    """Before ``generate_feedback`` renders a notebook: each markdown cell becomes its own HTML, cleaned
    (:func:`tinypaged.course.coursework.sanitize_html`, nh3), and every HTML, SVG or markdown output is cleaned the
    same way; JavaScript outputs are dropped. nbgrader's feedback template renders markdown without nbconvert's
    ``clean_html``, so a learner's ``<script>``, event handler or ``javascript:`` link would otherwise run in the
    page the learner (or an instructor) opens."""

    def preprocess(self, nb, resources):
        from nbconvert.filters.markdown import markdown2html

        from tinypaged.course.coursework import sanitize_html

        for cell in nb.cells:
            if cell.cell_type == "markdown":
                cell.source = sanitize_html(markdown2html(cell.source))
                cell.pop("attachments", None)
            elif cell.cell_type == "raw":
                cell.source = sanitize_html(cell.source)
            for out in cell.get("outputs", []):
                data = out.get("data")
                if not data:
                    continue
                for mime in list(data):
                    if "javascript" in mime or mime.startswith("application/vnd.jupyter.widget"):
                        del data[mime]
                    elif mime in ("text/html", "image/svg+xml"):
                        text = data[mime] if isinstance(data[mime], str) else "".join(data[mime])
                        data[mime] = sanitize_html(text)
                    elif mime == "text/markdown":
                        text = data[mime] if isinstance(data[mime], str) else "".join(data[mime])
                        data["text/html"] = sanitize_html(markdown2html(text))
                        del data[mime]
        return nb, resources


class SealedFeedback(_NotebooksOnly, GenerateFeedback):
    """nbgrader's ``GenerateFeedback`` that copies nothing from ``autograded/`` but the notebooks' HTML."""


def seal_nbgrader() -> None:
    """Make nbgrader's apps and API use :class:`SealedAutograde` and :class:`SealedFeedback` (called from
    ``nbgrader_config.py``, which every ``nbgrader`` command and ``coursework._nbgrader_api`` load first)."""
    from nbgrader.apps import api, autogradeapp, generatefeedbackapp

    autogradeapp.Autograde = api.Autograde = SealedAutograde
    generatefeedbackapp.GenerateFeedback = api.GenerateFeedback = SealedFeedback
