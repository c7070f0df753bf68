"""Grading submitted notebooks so that the verdict never depends on code the learner could change.

The verdict is computed where learner code never runs (the trust model: docs/INSTRUCTORS.md): the sandbox
runs the learner's code over the student edition (no references, no expected values) and records each case's
steps as data; the grader's process picks the inputs, computes every expectation from the full package and
compares. Nothing else the sandbox says is taken, so forging evidence gains nothing.

* :mod:`~tinypaged.course.grading.notebook` - the notebook conventions (nbgrader cell metadata, the stage in
  ``metadata.tinypaged.stage``), the learner's module extracted by the instructor's ``grade_id`` and the
  notebook rebuilt around the instructor's locked and test cells (for the feedback run); a symbolic link
  handed in as a notebook is refused;
* :mod:`~tinypaged.course.grading.scan` - reads the solution cells for reuse of the package's reference
  implementations and for tampering (strictly: what a solution never needs);
* :mod:`~tinypaged.course.grading.sandbox` - bubblewrap (listed binds: the student edition, the environment, the
  model), a cgroup per submission, prlimit and setpriv around every untrusted process;
* :mod:`~tinypaged.course.grading.probe` - the checks' process, on the student edition (no answers inside):
  imports the learner's module and records each case's steps;
* :mod:`~tinypaged.course.grading.evidence` - runs the probe in the sandbox, again after whatever killed it, and
  validates what comes back (plain data of the job's own calls, nothing else);
* :mod:`~tinypaged.course.grading.verify` - judges the observations in the grader's process (the grade): only
  each case's steps, validated as plain data (NaN and inf never pass; malformed or oversized: 0, with the reason);
* :mod:`~tinypaged.course.grading.execute` - runs the notebook in a sandboxed kernel: the learner's feedback;
* :mod:`~tinypaged.course.grading.nbgrader_verify` - the same, for nbgrader's autograde and export; test cells
  compared with those the learner was given (tampering flagged, no checksum noise).
"""
