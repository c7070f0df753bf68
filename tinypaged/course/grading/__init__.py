"""Grading submitted notebooks so that the verdict never depends on code the learner could change.

The judge never runs beside learner code, and only data crosses between them (the trust model:
docs/INSTRUCTORS.md). The **sandbox** holds the learner's code and the student edition of the class's stage
(every graded part of every stage not yet finished is a stub, and no reference implementation of a graded part
is there); it answers the judge's calls with data. The **judge**, in the grader's own process with the full
package, owns everything else: it draws each check's cases (hidden ones from a keyed digest of the notebook's
seed, so no seed ever enters the sandbox), sends them one call at a time as data (the part's name, the case's
driver by name and its inputs), takes back plain JSON (each case's steps, an exception's class), computes every
expected value itself (a serving check's tokens too) and writes the verdict and the feedback in its own words.

* :mod:`~tinypaged.course.grading.notebook` - the notebook conventions (nbgrader cell metadata, the stage from
  the assignment's file name), the learner's module extracted by the instructor's ``grade_id`` and the notebook
  rebuilt around the instructor's locked and test cells (for the feedback run); a symbolic link handed in as a
  notebook is refused;
* :mod:`~tinypaged.course.grading.scan` - reads the solution cells for reuse of the package's reference
  implementations and for tampering (a finding for the instructor; the seal does not depend on it);
* :mod:`~tinypaged.course.grading.sandbox` - bubblewrap (listed binds: the student edition, the environment, the
  model), a cgroup per submission, size-limited tmpfs for every writable path, prlimit and setpriv around every
  untrusted process;
* :mod:`~tinypaged.course.grading.wire` - a case as data: the judge encodes, the sandbox rebuilds;
* :mod:`~tinypaged.course.grading.probe` - the sandbox's process: imports the learner's module and answers each
  call with the case's observed steps;
* :mod:`~tinypaged.course.grading.evidence` - runs the probe in the sandbox (again after whatever killed it), feeds
  it the calls one at a time and validates what comes back (plain data of the job's own calls, nothing else);
* :mod:`~tinypaged.course.grading.verify` - the judge: builds the job, computes the expectations, scores, and
  writes verdicts that quote nothing the sandbox wrote;
* :mod:`~tinypaged.course.grading.execute` - runs the notebook in a sandboxed kernel: the learner's feedback;
* :mod:`~tinypaged.course.grading.nbgrader_verify` - the same, for nbgrader's autograde and export; test cells
  compared with those the learner was given (tampering flagged, no checksum noise).
"""
