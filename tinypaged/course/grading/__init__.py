"""Grading submitted notebooks so that the verdict never depends on code the learner could change.

* :mod:`~tinypaged.course.grading.notebook` - the notebook conventions (nbgrader cell metadata, the stage in
  ``metadata.tinypaged.stage``) and rebuilding a submission around the instructor's locked and test cells;
* :mod:`~tinypaged.course.grading.execute` - runs one notebook in its own kernel, in a subprocess, with
  per-cell and whole-notebook time limits;
* :mod:`~tinypaged.course.grading.scan` - reads the learner's cells for reuse of the package's reference
  implementations and for tampering with the package or the grader;
* :mod:`~tinypaged.course.grading.verify` - scores the executed notebook in the grader's own process:
  every test cell's records are compared with expected results computed here, never in the kernel;
* :mod:`~tinypaged.course.grading.nbgrader_verify` - the same verification as an nbgrader preprocessor.
"""
