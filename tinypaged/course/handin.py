"""The student edition's seam for graded parts: the engine calls the learner's own definitions.

In the student edition (:mod:`tinypaged.course.student_edition`) every graded body of the package is replaced by a
call through :func:`learner`, which finds the definition of the same name in the learner's running notebook (the
kernel's ``__main__``: what their cells defined) and returns it. So ``BlockTables.allocate_slots`` inside the
engine runs the learner's ``BlockTables.allocate_slots``, and a lesson that starts the engine runs on the learner's
parts. A part the learner has not written yet raises ``NotImplementedError`` naming the assignment and the part.
The full package never calls this module.
"""

from __future__ import annotations

import inspect
import sys

MESSAGE = "student edition: {assignment}, part {part}: write it in the exercise (the full package has it)"


def learner(assignment: str, part: str):
    """The learner's function for ``part`` (``name`` or ``Class.method``), unwrapped from a property or
    staticmethod; NotImplementedError when the notebook has not defined it (or defined it as the edition's own)."""
    missing = NotImplementedError(MESSAGE.format(assignment=assignment, part=part))
    obj = sys.modules.get("__main__")
    for name in part.split("."):
        try:
            obj = inspect.getattr_static(obj, name)
        except AttributeError:
            raise missing from None
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    # the package's own stub (a notebook that imported the edition's class instead of writing it) is not an answer
    if not callable(obj) or str(getattr(obj, "__module__", "")).startswith("tinypaged."):
        raise missing
    return obj


class KernelHandIn:
    """In the student edition, a graded Triton kernel: launching it (``kernel[grid](...)``) launches the learner's
    kernel of the same name, so the engine's launcher runs their code, compiled or interpreted alike."""

    def __init__(self, assignment: str, part: str):
        self.assignment, self.part = assignment, part

    def __getitem__(self, grid):
        return learner(self.assignment, self.part)[grid]

    def __repr__(self) -> str:
        return f"<student edition: {self.assignment}'s {self.part}, the learner's kernel>"
