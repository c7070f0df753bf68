"""nbgrader configuration for the tinypaged course (read by every `nbgrader ...` command run from here).

Layout (nbgrader's): <course>/source/<assignment>/<assignment>.ipynb is staged from
solutions/<assignment>.ipynb by `python -m tinypaged.course release`; generate_assignment writes
<course>/release/, students' work goes to <course>/submitted/<student>/<assignment>/, autograde writes
<course>/autograded/, and `nbgrader export` writes grades.csv. <course> is $TINYPAGED_COURSE or course/.
See docs/INSTRUCTORS.md.
"""

import os
from pathlib import Path

from nbconvert.preprocessors import ClearMetadataPreprocessor
from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, Execute, IgnorePattern, LimitOutput,
                                    SaveAutoGrades)

from tinypaged.course.grading.nbgrader_verify import VerifyChecks

HERE = Path(__file__).resolve().parent
c = get_config()  # noqa: F821  (provided by traitlets when it loads this file)

c.CourseDirectory.root = os.environ.get("TINYPAGED_COURSE", str(HERE / "course"))
c.CourseDirectory.course_id = "tinypaged"
# The exchange (release_assignment / fetch_assignment / submit / collect) for a shared JupyterHub.
c.Exchange.root = os.environ.get("TINYPAGED_EXCHANGE", os.path.join(c.CourseDirectory.root, "exchange"))

# Solution regions become the stub the in-notebook checks recognise as "not implemented yet".
c.ClearSolutions.code_stub = {"python": 'raise NotImplementedError("not implemented yet")'}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# Each submission runs in its own kernel; a cell that runs longer than this is interrupted and the
# rest of the notebook still runs. The kernel emits check records (TINYPAGED_GRADING=1) and
# VerifyChecks scores them in nbgrader's own process, after execution and before grades are saved.
c.Execute.timeout = 120
os.environ["TINYPAGED_GRADING"] = "1"
c.Autograde.autograde_preprocessors = [
    Execute,
    VerifyChecks,
    IgnorePattern,
    ClearMetadataPreprocessor,
    LimitOutput,
    SaveAutoGrades,
    AssignLatePenalties,
    CheckCellMetadata,
]
