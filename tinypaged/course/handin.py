"""The student edition's seam for graded parts: the engine calls the learner's own definitions.

In the student edition (:mod:`tinypaged.course.student_edition`) every graded body of the package is replaced by a
call through :func:`learner`, which finds the definition of the same name in the learner's running notebook (the
kernel's ``__main__``: what their cells defined) and returns it. So ``BlockTables.allocate_slots`` inside the
engine runs the learner's ``BlockTables.allocate_slots``, and a lesson that starts the engine runs on the learner's
parts. A part the learner has not written yet raises :class:`PartNotWritten` (a ``NotImplementedError``, so the
exercises' checks say "not implemented yet") naming the assignment and the part; in a notebook (IPython, not while
grading) that error prints one line saying where the part is written and where the cell's stored output is
(:func:`install_notebook_hook`) instead of a traceback. The grader's edition also withholds the package's own
reference functions of the stages the class has not finished (:func:`withheld`). The full package never calls
this module.
"""

from __future__ import annotations

import inspect
import os
import sys

MESSAGE = "student edition: {assignment}, part {part}: write it in the exercise (the full package has it)"
WITHHELD = ("student edition: {assignment}, part {part}: the package's reference for this stage's checks is "
            "withheld from the grader's edition (no answers inside)")
LESSON_LINE = ("this cell needs {part} from exercise {stage} ({assignment}; not written yet in your notebook): its "
               "stored output is in notebooks/{assignment}.ipynb, or read it on the course site, page {assignment}")
GRADING_ENV = "TINYPAGED_GRADING"  # tinypaged.course.checks.GRADING_ENV (not imported: this module stays light)


class PartNotWritten(NotImplementedError):
    """A graded part the running notebook has not defined (or, ``withheld``, a reference the edition does not hold)."""

    def __init__(self, assignment: str, part: str, withheld: bool = False):
        self.assignment, self.part, self.withheld = assignment, part, withheld
        super().__init__((WITHHELD if withheld else MESSAGE).format(assignment=assignment, part=part))

    def __reduce__(self):  # survives pickling (a worker process, a multiprocessing pool) with its fields
        return type(self), (self.assignment, self.part, self.withheld)

    def lesson_line(self) -> str:
        """The one line a lesson cell prints in place of the traceback."""
        return LESSON_LINE.format(part=self.part, stage=self.assignment.split("_", 1)[0], assignment=self.assignment)


LATER_LINE = ("this cell needs {name}, which an earlier cell makes with {part} from exercise {stage} ({assignment}; "
              "not written yet in your notebook): its stored output is in notebooks/{assignment}.ipynb, or read it on "
              "the course site, page {assignment}")
# names that a cell stopped by an unwritten part would have made -> that part's error (a later cell's NameError)
_UNMADE: dict[str, PartNotWritten] = {}


def _assigned_names(source: str) -> set[str]:
    """Every name a cell's code binds (assignments, loops, imports, definitions), wherever it does."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _current_cell(shell) -> str:
    try:
        return shell.history_manager.input_hist_parsed[-1]
    except (AttributeError, IndexError):
        return ""


def _show_one_line(shell, etype, value, tb, tb_offset=None):
    """IPython's custom exception handler: :class:`PartNotWritten` as one line, no traceback; a ``NameError`` for a
    name that a cell stopped by one would have made, one line naming that part; anything else as usual."""
    cause = value if isinstance(value, PartNotWritten) else None
    if cause is None and isinstance(value, NameError):
        cause = _UNMADE.get(getattr(value, "name", None))
    if cause is None:
        shell.showtraceback(running_compiled_code=True)  # what IPython shows without this handler
        return
    for name in _assigned_names(_current_cell(shell)):
        _UNMADE.setdefault(name, cause)
    if cause is value:
        print(value.lesson_line())
    else:
        print(LATER_LINE.format(name=value.name, part=cause.part, stage=cause.assignment.split("_", 1)[0],
                                assignment=cause.assignment))


def install_notebook_hook() -> bool:
    """In an IPython kernel (never while grading: the grader reads errors as they are), show
    :class:`PartNotWritten` as one line (``set_custom_exc``), and from then on a ``NameError`` for what a cell it
    stopped would have defined. Idempotent; True when the hook is in place."""
    if os.environ.get(GRADING_ENV) == "1" or "IPython" not in sys.modules:
        return False
    try:
        shell = sys.modules["IPython"].get_ipython()
    except Exception:
        return False
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return False
    mine = (PartNotWritten, NameError)
    current = tuple(getattr(shell, "custom_exceptions", ()))
    if current == mine:
        return True
    if current:  # someone else's handler: leave it alone
        return False
    shell.set_custom_exc(mine, _show_one_line)
    return True


def _missing(assignment: str, part: str, withheld: bool = False) -> PartNotWritten:
    install_notebook_hook()  # before the raise reaches the kernel: IPython matches the handler's types then
    return PartNotWritten(assignment, part, withheld)


def withheld(assignment: str, part: str) -> PartNotWritten:
    """The error a withheld reference function raises in the grader's edition (``raise withheld(...)``)."""
    return _missing(assignment, part, withheld=True)


def learner(assignment: str, part: str):
    """The learner's function for ``part`` (``name`` or ``Class.method``), unwrapped from a property or
    staticmethod; :class:`PartNotWritten` when the notebook has not defined it (or defined it as the edition's own)."""
    obj = sys.modules.get("__main__")
    for name in part.split("."):
        try:
            obj = inspect.getattr_static(obj, name)
        except AttributeError:
            raise _missing(assignment, part) from None
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    # the package's own stub (a notebook that imported the edition's class instead of writing it) is not an answer
    if not callable(obj) or str(getattr(obj, "__module__", "")).startswith("tinypaged."):
        raise _missing(assignment, part)
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
