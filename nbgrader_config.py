"""nbgrader configuration for the tinypaged course (read by every `nbgrader ...` command run from here).

Layout (nbgrader's): <course>/source/<assignment>/<assignment>.ipynb is staged from
solutions/<assignment>.ipynb by `python -m tinypaged.course release`; generate_assignment writes
<course>/release/, students' work goes to <course>/submitted/<student>/<assignment>/, autograde writes
<course>/autograded/, and `nbgrader export` writes grades.csv. <course> is $TINYPAGED_COURSE or course/.
See docs/INSTRUCTORS.md (it also says what the sandbox needs: bubblewrap).
"""

import os
from pathlib import Path

from nbconvert.preprocessors import ClearMetadataPreprocessor
from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, ClearHiddenTests, ClearOutput,
                                    DeduplicateIds, GetGrades, IgnorePattern, LimitOutput, OverwriteKernelspec,
                                    SaveAutoGrades)

from tinypaged.course.coursework import sanitize_html
from tinypaged.course.grading.nbgrader_verify import (CompareGivenCells, RecordFindings, SandboxedExecute,
                                                      SanitizeForFeedback, VerifyChecks, seal_nbgrader)

# autograde and generate_feedback copy nothing but the notebooks (nbgrader copies every other file of a
# submission folder, following links); a folder holding a link or any other file is refused (FLAGGED, 0, named);
# a failure of nbgrader's own steps is an AUTOGRADE FAILED line (a FAILED row), never a silent 0.
seal_nbgrader()

HERE = Path(__file__).resolve().parent
c = get_config()  # noqa: F821  (provided by traitlets when it loads this file)

c.CourseDirectory.root = os.environ.get("TINYPAGED_COURSE", str(HERE / "course"))
c.CourseDirectory.course_id = "tinypaged"
# The exchange (release_assignment / fetch_assignment / submit / collect) for a shared JupyterHub.
c.Exchange.root = os.environ.get("TINYPAGED_EXCHANGE", os.path.join(c.CourseDirectory.root, "exchange"))

# Solution regions become the stub the in-notebook checks recognise as "not implemented yet".
c.ClearSolutions.code_stub = {"python": 'raise NotImplementedError("not implemented yet")'}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# autograde never runs a submission in nbgrader's own environment: SandboxedExecute runs it under
# bubblewrap for the learner's feedback (limits in CPU seconds, so a loaded machine fails nothing), and
# VerifyChecks grades it from the learner's code alone, in a sandboxed checks' process
# (tinypaged/course/grading/). Without bwrap both refuse and the submission is flagged, with the reason.
# Locked and test cells are put back from the source as nbgrader does, but compared with the cells the learner was
# given (hidden tests removed): an edited, deleted or re-pointed test cell is a finding (FLAGGED) naming the cell,
# and an honest notebook gets no "checksum has changed" warning (nbgrader's checksum includes the hidden tests).
c.Autograde.sanitize_preprocessors = [ClearOutput, DeduplicateIds, OverwriteKernelspec, CompareGivenCells,
                                      CheckCellMetadata]
c.SandboxedExecute.cpu_timeout = 300
c.SandboxedExecute.timeout = 600
c.VerifyChecks.cpu_timeout = 300
# a firm ceiling per submission, whatever the per-cell and per-check limits add up to: wall seconds for the
# feedback run and as many for the checks (the job's total_wall), CPU seconds for everything it runs
c.SandboxedExecute.submission_timeout = c.VerifyChecks.submission_timeout = 900
c.SandboxedExecute.submission_cpu = c.VerifyChecks.submission_cpu = 3600
c.Autograde.autograde_preprocessors = [
    SandboxedExecute,
    VerifyChecks,
    IgnorePattern,
    ClearMetadataPreprocessor,
    LimitOutput,
    SaveAutoGrades,
    RecordFindings,
    AssignLatePenalties,
    CheckCellMetadata,
]
# `nbgrader generate_feedback`: the learner never sees the hidden tests' code (their seeds); the verdicts in the
# test cells name a failing hidden case by its number, with the visible hint only (tinypaged.course.grading.verify).
# ... and a learner's <script>, event handlers and javascript: links never reach it (nh3): SanitizeForFeedback cleans
# markdown cells and HTML outputs (nbgrader's feedback template renders markdown without clean_html)
c.GenerateFeedback.preprocessors = [GetGrades, ClearHiddenTests, SanitizeForFeedback, CSSHTMLHeaderPreprocessor]
c.HTMLExporter.sanitize_html = True
c.HTMLExporter.filters = {"clean_html": sanitize_html}
# `nbgrader export`: automatic and written points apart, a status and the findings line per submission.
c.ExportApp.plugin_class = "tinypaged.course.grading.nbgrader_verify.TinypagedCsvExport"
