"""nbgrader preprocessor: replace the kernel's own test-cell verdicts with verified ones.

nbgrader scores a test cell by its outputs (an error: 0; a number: partial credit; else full), and
those outputs come from the learner's kernel, which the learner's code controls. ``VerifyChecks``
runs right after ``Execute`` (see ``nbgrader_config.py``): it scores the executed notebook with
:func:`tinypaged.course.grading.verify.verify` in nbgrader's process and rewrites every test cell's outputs
so nbgrader's rule yields the verified score.
"""

from __future__ import annotations

import json

from nbformat import from_dict
from nbgrader.preprocessors import NbGraderPreprocessor


class VerifyChecks(NbGraderPreprocessor):
    def preprocess(self, nb, resources):
        from tinypaged.course.grading.verify import apply_to_notebook, verify

        plain = json.loads(json.dumps(nb))
        report = verify(plain)
        for row in report["tests"]:
            self.log.info("%s: %s/%s %s %s", row["grade_id"], row["score"], row["points"], row["status"],
                          row["message"])
        for f in report["findings"]:
            if f.get("counted"):
                self.log.warning("%s in cell %s line %s: %s", f["kind"], f["cell"], f["line"], f["what"])
        apply_to_notebook(plain, report)
        for cell, new in zip(nb.cells, plain["cells"]):
            if cell.cell_type == "code":
                cell.outputs = [from_dict(o) for o in new["outputs"]]
        resources.setdefault("tinypaged", {})["report"] = report
        return nb, resources
