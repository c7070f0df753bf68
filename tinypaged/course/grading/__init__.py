"""Grading submitted notebooks so that the verdict never depends on code the learner could change.

* :mod:`~tinypaged.course.grading.notebook` - the notebook conventions (nbgrader cell metadata, the stage in
  ``metadata.tinypaged.stage``), the learner's module extracted by the instructor's ``grade_id`` and the
  notebook rebuilt around the instructor's locked and test cells (for the feedback run);
* :mod:`~tinypaged.course.grading.scan` - reads the solution cells for reuse of the package's reference
  implementations and for tampering (strictly: what a solution never needs);
* :mod:`~tinypaged.course.grading.sandbox` - bubblewrap, prlimit and setpriv around every untrusted process;
* :mod:`~tinypaged.course.grading.probe` - the checks' process: imports the learner's module and observes;
* :mod:`~tinypaged.course.grading.evidence` - runs the probe in the sandbox, again after whatever killed it;
* :mod:`~tinypaged.course.grading.verify` - judges the observations in the grader's process (the grade);
* :mod:`~tinypaged.course.grading.execute` - runs the notebook in a sandboxed kernel: the learner's feedback;
* :mod:`~tinypaged.course.grading.nbgrader_verify` - the same, for nbgrader's autograde and export.
"""
