"""The graded parts of the solution notebooks, where they live in the package, and the student edition.

What a lesson asks the learner to write is the engine's own code: every function and class that a solution
notebook's graded cells define (nbgrader ``solution: true`` code cells) has a definition of the same name in
the package, with the same body once docstrings, comments and annotations are set aside
(:func:`normalized`). :func:`graded_parts` reads them from the notebooks, :func:`locate` finds each in the
package, and ``tests/test_one_engine.py`` fails when a notebook and the package disagree.

The full package is therefore also the answer key. For graded work an instructor hands out the **student
edition** instead (``python -m tinypaged.course student-edition OUT [ASSIGNMENT ...]``): a copy of the installable
tree (``pyproject.toml``, ``tinypaged/``, ``kernels/``) in which every function body that an assignment's solution
cells mark with ``### BEGIN SOLUTION`` raises ``NotImplementedError`` naming the assignment and the part. Nothing
else changes, so lessons and exercises that do not use a graded part run as before, and a learner's own
definitions drive the engine through its plug-in seams (``kv_cache_manager=``, ``scheduler_cls=``,
``attention_backend=``). The solution notebooks (``solutions/``) are never copied.

The grader's sandbox imports a stricter edition (:func:`class_assignments`, ``write(..., references=True)``; built
by ``tinypaged.course.grading.sandbox.edition_for``): every graded part of every stage the class has not finished
(the assignment's own stage and all later ones) is a hand-over, and the package's own reference functions that
those stages' checks name (:data:`REFERENCE_FUNCTIONS`, e.g. ``paged_attention_reference``) raise instead, so
nothing in the sandbox computes an answer the learner is graded on. Every edition carries a marker module,
``tinypaged/_edition.py`` (:data:`MARKER`): ``tinypaged.course.checks.check`` refuses hidden cases there.
"""

from __future__ import annotations

import ast
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tinypaged.course.grading.notebook import BEGIN, END, grade_id, is_solution, source_of

ROOT = Path(__file__).resolve().parents[2]
# Where the engine's code lives (the classroom is not searched: it holds no second copy).
PACKAGE_DIRS = ("tinypaged", "kernels")
SKIP_DIRS = ("tinypaged/course",)


@dataclass
class GradedPart:
    """One top-level definition in a graded cell of a solution notebook."""

    assignment: str  # the notebook's stem, e.g. "02_block_table"
    grade_id: str  # the cell's nbgrader grade_id
    name: str  # the function or class name
    node: ast.AST  # its definition, parsed from the cell
    # functions (``name`` itself, or ``name.method`` for a class) whose body holds a solution region
    written: list[str] = field(default_factory=list)


def _strip_docstring(body: list) -> list:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:] or [ast.Pass()]
    return body


class _Normalize(ast.NodeTransformer):
    """Docstrings, annotations and comments aside (comments never reach the AST)."""

    def _function(self, node):
        self.generic_visit(node)
        node.body = _strip_docstring(node.body)
        node.returns = None
        args = node.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if a is not None:
                a.annotation = None
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node):
        self.generic_visit(node)
        node.body = _strip_docstring(node.body)
        return node

    def visit_AnnAssign(self, node):  # `x: int = 0` -> `x = 0`; a bare `x: int` -> `x`
        if node.value is None:
            return ast.Expr(node.target)
        return ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node)


def normalized(node: ast.AST) -> str:
    """A definition's shape for comparison: its AST without docstrings and annotations."""
    fresh = ast.parse(ast.unparse(node)).body[0]  # a private copy: the transformer edits in place
    return ast.dump(_Normalize().visit(fresh), annotate_fields=False, include_attributes=False)


def _solution_lines(source: str) -> list[tuple[int, int]]:
    """1-based (begin, end) line numbers of every BEGIN/END SOLUTION region of a cell."""
    regions, begin = [], None
    for no, line in enumerate(source.splitlines(), start=1):
        if line.strip() == BEGIN:
            begin = no
        elif line.strip() == END and begin is not None:
            regions.append((begin, no))
            begin = None
    return regions


def _written(node, regions, prefix="") -> list[str]:
    """The functions under ``node`` whose body contains (or lies inside) a solution region."""
    def overlaps(n):
        return any(b <= n.end_lineno and e >= n.lineno for b, e in regions)

    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [prefix + node.name] if overlaps(node) else []
    if isinstance(node, ast.ClassDef):
        out = []
        for child in node.body:
            out += _written(child, regions, prefix + node.name + ".")
        return out
    return []


def graded_parts(solutions: Path = ROOT / "solutions", assignments=None) -> list[GradedPart]:
    """Every top-level def or class of every graded code cell, in notebook order."""
    parts = []
    for nb_path in sorted(Path(solutions).glob("*.ipynb")):
        if assignments and nb_path.stem not in assignments:
            continue
        nb = json.loads(nb_path.read_text())
        for cell in nb["cells"]:
            if cell.get("cell_type") != "code" or not is_solution(cell):
                continue
            source = source_of(cell)
            regions = _solution_lines(source)
            tree = ast.parse("\n".join("" if l.lstrip().startswith("%") else l for l in source.splitlines()))
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    parts.append(GradedPart(nb_path.stem, grade_id(cell) or "", node.name, node,
                                            _written(node, regions)))
    return parts


def package_definitions(root: Path = ROOT) -> dict[str, list[tuple[Path, ast.AST]]]:
    """name -> [(file, top-level definition)] over the engine's code (tinypaged/ but the classroom, kernels/)."""
    found: dict[str, list] = {}
    for top in PACKAGE_DIRS:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(SKIP_DIRS):
                continue
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found.setdefault(node.name, []).append((path, node))
    return found


def locate(part: GradedPart, definitions) -> tuple[str, Path | None]:
    """("same", file) when the package defines the part with the same body; ("differs", file) when only its name
    matches; ("missing", None) when the package has no definition of that name."""
    candidates = definitions.get(part.name, [])
    if not candidates:
        return "missing", None
    want = normalized(part.node)
    for path, node in candidates:
        if normalized(node) == want:
            return "same", path
    return "differs", candidates[0][0]


# ---------------------------------------------------------------- the student edition

def _find(tree: ast.Module, dotted: str):
    node, body = None, tree.body
    for name in dotted.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == name), None)
        if node is None:
            return None
        body = node.body
    return node


def _forward(args: ast.arguments) -> str:
    """The call that hands a function's own parameters on unchanged: ``(self, a, b, *rest, c=c, **kw)``."""
    out = [a.arg for a in [*args.posonlyargs, *args.args]]
    if args.vararg:
        out.append("*" + args.vararg.arg)
    out += [f"{a.arg}={a.arg}" for a in args.kwonlyargs]
    if args.kwarg:
        out.append("**" + args.kwarg.arg)
    return ", ".join(out)


def _yields(fn) -> bool:
    """Whether ``fn`` itself (not a function nested in it) yields: a generator."""
    todo = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return False


WITHHOLD = "withhold"  # a stub's fourth field: raise (a reference function nobody writes), no hand-over


def stub_file(text: str, stubs: list[tuple]) -> str:
    """Replace the body of each (dotted function name, assignment, part) in ``text`` by a call to the learner's
    definition (:func:`tinypaged.course.handin.learner`), keeping its signature, decorators and docstring; a
    (dotted, assignment, part, ``WITHHOLD``) body raises :func:`tinypaged.course.handin.withheld` instead. Bodies
    are cut by line, bottom first."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    cuts = []
    for dotted, assignment, part, *kind in stubs:
        fn = _find(tree, dotted)
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise LookupError(f"{dotted} is not a function of this file")
        if kind == [WITHHOLD] and (any("jit" in ast.unparse(d) for d in fn.decorator_list) or _yields(fn)):
            raise ValueError(f"{dotted}: a kernel or a generator cannot be withheld by a raise")
        if any("jit" in ast.unparse(d) for d in fn.decorator_list):
            # a Triton kernel cannot call Python: the whole definition becomes a stand-in that launches theirs
            start = min(d.lineno for d in fn.decorator_list) - 1
            indent = " " * fn.col_offset
            cuts.append((start, fn.end_lineno,
                         f"{indent}from tinypaged.course.handin import KernelHandIn  # student edition\n"
                         f"{indent}{fn.name} = KernelHandIn({assignment!r}, {part!r})\n"))
            continue
        body = fn.body
        keep = 1 if _strip_docstring(body) is not body else 0
        first = body[keep] if keep < len(body) else None
        if first is None:  # only a docstring: add the stub after it
            start = end = body[0].end_lineno
        else:
            start, end = first.lineno - 1, body[-1].end_lineno
        if first is not None and first.lineno == fn.lineno:
            raise ValueError(f"{dotted}: a one-line body cannot be stubbed by line; give it its own line")
        indent = " " * (first.col_offset if first is not None else body[0].col_offset)
        call = (f"{indent}from tinypaged.course.handin import learner  # student edition: your code runs here\n"
                f"{indent}return learner({assignment!r}, {part!r})({_forward(fn.args)})\n")
        if kind == [WITHHOLD]:
            call = (f"{indent}from tinypaged.course.handin import withheld  # grader's edition: no reference inside\n"
                    f"{indent}raise withheld({assignment!r}, {part!r})\n")
        elif isinstance(fn, ast.AsyncFunctionDef) and _yields(fn):  # an async generator stays one (stage 8's stream)
            call = (f"{indent}from tinypaged.course.handin import learner  # student edition: your code runs here\n"
                    f"{indent}stream = learner({assignment!r}, {part!r})({_forward(fn.args)})\n"
                    f"{indent}try:\n{indent}    async for item in stream:\n{indent}        yield item\n"
                    f"{indent}finally:  # closed early (a client hung up): close theirs at once, so its finally runs\n"
                    f"{indent}    await stream.aclose()\n")
        cuts.append((start, end, call))
    for start, end, stub in sorted(cuts, reverse=True):
        lines[start:end] = [stub]
    out = "".join(lines)
    ast.parse(out)  # still Python
    return out


def plan(root: Path = ROOT, assignments=None) -> dict[Path, list[tuple[str, str, str]]]:
    """file -> [(dotted function, assignment, part)] for every written part of the chosen assignments found in the package."""
    definitions = package_definitions(root)
    todo: dict[Path, list] = {}
    for part in graded_parts(root / "solutions", assignments):
        for path, node in definitions.get(part.name, []):
            for dotted in part.written:
                if _find(ast.Module(body=[node], type_ignores=[]), dotted) is not None:
                    todo.setdefault(path, []).append((dotted, part.assignment, dotted))
    return todo


# ---------------------------------------------------------------- the grader's edition: the class's unfinished stages

def stage_of(assignment: str) -> str:
    """``"02"`` for ``02_block_table``."""
    return assignment.split("_", 1)[0]


def class_assignments(assignment: str, root: Path = ROOT) -> list[str]:
    """What the class has not finished when ``assignment`` is graded: the assignments of its stage and of every
    later stage (earlier stages keep their code: later engines are built on it)."""
    stage = stage_of(assignment)
    found = sorted(p.stem for p in (Path(root) / "solutions").glob("*.ipynb") if stage_of(p.stem) >= stage)
    if assignment not in found:
        raise ValueError(f"no solution notebook for {assignment!r}; known: {found}")
    return found


# The package's functions that the checks name as ``reference=`` or in ``forbidden=`` and that compute a graded
# part's answer, though no assignment has the learner write them: name -> (file, the stages whose checks name it).
# The grader's edition makes each raise (``withheld``) while any of those stages is unfinished. Held to what the
# checks name by tests/test_student_edition_class.py (``reference_functions`` finds them in the registry).
REFERENCE_FUNCTIONS = {
    "paged_attention_reference": ("kernels/reference.py", ("02", "05")),
    "gather_then_attend": ("kernels/reference.py", ("02", "05")),
    "merge_splits_reference": ("kernels/reference.py", ("05",)),
    "reshape_and_cache_reference": ("kernels/reference.py", ("05",)),
}
# Named by checks too, but kept: the engine runs them, and the answer they lead to goes through a graded part
# (the learner's, in the edition), or the engine cannot serve at all without them.
ENGINE_FUNCTIONS = {
    "attend_gathered": "the engine's prefill attention (and the torch backend's decode): every serving check runs it",
    "paged_context_slots": "slot numbers through gather_kv, which is the learner's in the edition",
    "paged_attention_decode": "the launcher of paged_attention_kernel and merge_splits_kernel, the learner's kernels",
    "reshape_and_cache": "the launcher of reshape_and_cache_kernel, the learner's kernel",
}


# Graded parts of a later stage that the engine would run in an earlier stage's serving check: none. Stage 4's
# ``schedule_step`` is avoided (those checks schedule with ``serving.OneAtATime``), stage 3's ``append_slot`` and
# ``free_table`` run only once blocks can be shared (``BlockManager.sharing``), and stage 6's ``max_concurrency`` only
# fills a log line that tolerates it unwritten. A part listed here (stage -> {part: where the engine runs it}) would
# be kept in that stage's grader edition: a gap in "no answer inside", which tests/test_student_edition_class.py
# refuses.
ENGINE_NEEDS: dict[str, dict[str, str]] = {}


def engine_needs(assignment: str) -> set[str]:
    """The later stages' graded parts kept in the grader's edition for ``assignment`` (:data:`ENGINE_NEEDS`)."""
    return set(ENGINE_NEEDS.get(stage_of(assignment), ()))


def _package_file(obj, root: Path) -> str | None:
    """``obj``'s file relative to the repository (``tinypaged/...`` or ``kernels/...``), None outside the package."""
    import inspect

    try:
        path = Path(inspect.getsourcefile(obj)).resolve()
    except (TypeError, OSError):
        return None
    for top in PACKAGE_DIRS:
        base = (Path(root) / top).resolve()
        if path == base or base in path.parents:
            rel = path.relative_to(Path(root).resolve()).as_posix()
            return None if rel.startswith(SKIP_DIRS) else rel
    return None


def reference_functions(stages=None, root: Path = ROOT) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Found in the checks' registry (this process's package must be the full one): every plain function of the
    engine's code that a check of ``stages`` (None: all) names as its reference or forbids, that is not a graded
    part (those are hand-overs already) nor one of :data:`ENGINE_FUNCTIONS`: name -> (file, stages naming it)."""
    import types

    from tinypaged.course import checks

    checks._load_all()
    graded = {(path.relative_to(root).as_posix(), dotted)
              for path, stubs in plan(root).items() for dotted, _, _ in stubs}
    found: dict[str, tuple[str, set]] = {}
    for check in checks.REGISTRY.values():
        if stages is not None and check.stage not in stages:
            continue
        for obj in [check.reference(), *check.forbidden_objects()]:
            if not isinstance(obj, types.FunctionType) or obj.__name__ in ENGINE_FUNCTIONS:
                continue
            rel = _package_file(obj, root)
            if rel is None or "." in obj.__qualname__ or (rel, obj.__qualname__) in graded:
                continue
            if obj.__qualname__ in found and found[obj.__qualname__][0] != rel:
                raise LookupError(f"two reference functions named {obj.__qualname__}: "
                                  f"{found[obj.__qualname__][0]}, {rel}")
            found.setdefault(obj.__qualname__, (rel, set()))[1].add(check.stage)
    return {name: (rel, tuple(sorted(named))) for name, (rel, named) in sorted(found.items())}


def withheld_references(stages, root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """What the grader's edition for ``stages`` withholds: name -> (file, the first of ``stages`` naming it);
    :data:`REFERENCE_FUNCTIONS` together with whatever the registry names besides (:func:`reference_functions`)."""
    stages = set(stages)
    everything = {name: (rel, tuple(named)) for name, (rel, named) in REFERENCE_FUNCTIONS.items()}
    for name, (rel, named) in reference_functions(stages, root).items():
        everything[name] = (rel, tuple(sorted(set(everything.get(name, (rel, ()))[1]) | set(named))))
    out = {}
    for name, (rel, named) in sorted(everything.items()):
        mine = sorted(stages & set(named))
        if mine:
            out[name] = (rel, mine[0])
    return out


def _store_visible_expectations(out: Path, assignments) -> None:
    """The visible cases' expected outcomes of every check, computed here with the full package, as data: the
    edition's references are stubs, and its checks read this file (``checks.STORED_EXPECTED``) instead."""
    from tinypaged.course import checks

    checks._load_all()
    stages = {a[:2] for a in assignments} if assignments else None
    stored = {}
    for name, check in sorted(checks.REGISTRY.items()):
        # a check with its own ``expected`` (the serving checks: transformers' tokens) needs no reference, unless
        # that expectation is computed with the graded code itself (stage 9's routing decisions)
        if (check.expected is None or check.expected_uses_reference) and (stages is None or check.stage in stages):
            stored[name] = checks.expected_outcomes(name, None)
    target = out / Path(checks.STORED_EXPECTED).relative_to(Path(checks.__file__).resolve().parents[3])
    target.write_text(json.dumps(stored, indent=1) + "\n")


def _edition_path(rel: Path) -> Path:
    return Path("tinypaged", *rel.parts) if rel.parts[0] == "kernels" else rel


MARKER = "tinypaged/_edition.py"  # in every edition (never in the package): what it is, and what it stubs


def write(out: Path, assignments=None, root: Path = ROOT, expectations: bool = True,
          references: bool = False, keep=()) -> dict[str, list[str]]:
    """Write the student edition into ``out`` (which must not exist); returns file -> stubbed functions.
    ``expectations=False``: without the visible cases' expected outcomes (the grader's sandbox edition).
    ``references=True``: the reference functions that the checks of the assignments' stages name raise
    (:func:`withheld_references`; the grader's edition, with ``assignments`` from :func:`class_assignments`).
    ``keep``: graded parts (dotted names) left as the package has them (:func:`engine_needs`)."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; the student edition is written into a new folder")
    known = {p.stem for p in (root / "solutions").glob("*.ipynb")}
    unknown = set(assignments or ()) - known
    if unknown:
        raise ValueError(f"no solution notebook for {sorted(unknown)}; known: {sorted(known)}")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    out.mkdir(parents=True)
    # a plain package: kernels/ goes inside tinypaged/, so the edition imports from a folder on PYTHONPATH as
    # well as from `pip install OUT` (its pyproject.toml loses the mapping of tinypaged.kernels to kernels/)
    shutil.copytree(root / "tinypaged", out / "tinypaged", ignore=ignore, symlinks=False)
    shutil.copytree(root / "kernels", out / "tinypaged" / "kernels", ignore=ignore, symlinks=False)
    shutil.copy2(root / "README.md", out / "README.md")
    pyproject = (root / "pyproject.toml").read_text()
    (out / "pyproject.toml").write_text(pyproject.replace(', "tinypaged.kernels" = "kernels"', ""))
    report = {}
    todo = {path: [stub for stub in stubs if stub[0] not in set(keep)]
            for path, stubs in plan(root, assignments).items()}
    todo = {path: stubs for path, stubs in todo.items() if stubs}
    withheld = {}
    if references:
        stages = {stage_of(a) for a in assignments} if assignments else {stage_of(p) for p in known}
        by_stage = {stage_of(a): a for a in sorted(assignments or known, reverse=True)}  # the stage's first
        withheld = withheld_references(stages, root)
        for name, (rel, stage) in withheld.items():
            todo.setdefault(root / rel, []).append((name, by_stage[stage], name, WITHHOLD))
    for path, stubs in todo.items():
        rel = path.relative_to(root)
        target = out / _edition_path(rel)
        target.write_text(stub_file(target.read_text(), stubs))
        report[_edition_path(rel).as_posix()] = [d for d, *_ in stubs]
    (out / MARKER).write_text(
        '"""This tree is tinypaged\'s student edition (tinypaged.course.student_edition), not the package: graded '
        'bodies hand over to the\nlearner\'s definitions, and the hidden checks are graded by the grader only."""\n\n'
        f"ASSIGNMENTS = {tuple(sorted(assignments or known))!r}  # whose graded parts are hand-overs\n"
        f"WITHHELD = {tuple(sorted(withheld))!r}  # reference functions that raise\n"
        f"KEPT = {tuple(sorted(keep))!r}  # graded parts of those assignments kept for the engine\n")
    if expectations:
        _store_visible_expectations(out, assignments)
    (out / "STUDENT_EDITION.txt").write_text(
        "tinypaged, student edition: the bodies below raise NotImplementedError; the exercises ask for them.\n"
        + "".join(f"{f}: {', '.join(fns)}\n" for f, fns in sorted(report.items())))
    return report
