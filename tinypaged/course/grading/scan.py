"""Read the learner's cells (never run them) for reuse of reference implementations and for tampering.

Two kinds of finding, each with the cell, the line and what was found:

* ``reuse``: the code names one of the package's reference implementations, by import
  (``from tinypaged.attention.backends import slot_mapping``), through a module
  (``attention.slot_mapping``, ``import tinypaged.course.checks.stage03 as ref; ref.fork``) or by aliasing
  (``slot_mapping = tinypaged.attention.backends.slot_mapping``). The checks whose forbidden list names it
  score 0.
* ``tamper``: the code changes the package or the interpreter under the grader: assigning to or
  deleting a module's attributes (monkeypatching), ``setattr`` on a module, touching the grader
  (``tinypaged.course.checks`` beyond ``check``, ``tinypaged.course.grading``, ``tinypaged.course.coursework``), ``sys.modules``,
  trace hooks, ``gc`` object walks, ``builtins``, ``importlib``, ``exec``/``eval``, the grading
  switch. Every test cell after it scores 0.

Names are resolved through every import and simple alias in the notebook, given cells included, so
``from tinypaged import contiguous`` in a given cell makes ``contiguous.first_fit`` in a solution
cell a reuse. The runtime checks in ``tinypaged.course.checks`` (identity, shared code objects, a trace
hook) back this up for what a static reading cannot see.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
from dataclasses import dataclass

GRADER_MODULES = ("tinypaged.course.checks", "tinypaged.course.grading", "tinypaged.course.coursework")
ALLOWED_GRADER_NAMES = ("tinypaged.course.checks.check",)
SENSITIVE = ("sys.modules", "sys.settrace", "sys.setprofile", "sys.gettrace", "sys._getframe", "sys.meta_path",
             "sys.path_hooks", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "builtins", "importlib",
             "threading.settrace", "ctypes")
SENSITIVE_CALLS = ("__import__", "exec", "eval", "compile", "get_ipython", "breakpoint")
SENSITIVE_STRINGS = ("TINYPAGED_GRADING", "application/vnd.tinypaged")

# Solution cells are read more strictly (they are what grading imports): a solution needs none of this.
ALLOWED_IMPORTS = frozenset({
    "math", "cmath", "collections", "itertools", "functools", "heapq", "bisect", "typing", "dataclasses", "enum",
    "random", "statistics", "copy", "hashlib", "operator", "numbers", "fractions", "decimal", "string", "re",
    "abc", "array", "torch", "triton", "numpy", "tinypaged", "__future__"})
ALLOWED_DUNDERS = frozenset({
    "__init__", "__name__", "__qualname__", "__class__", "__len__", "__iter__", "__next__", "__getitem__",
    "__setitem__", "__delitem__", "__contains__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__hash__", "__repr__", "__str__", "__call__", "__enter__", "__exit__", "__post_init__", "__slots__",
    "__doc__", "__bool__", "__add__", "__sub__", "__mul__", "__iadd__", "__future__", "__annotations__"})
BANNED_NAMES = frozenset({
    "getattr", "setattr", "delattr", "vars", "globals", "locals", "eval", "exec", "compile", "__import__",
    "open", "breakpoint", "input", "exit", "quit", "memoryview", "__builtins__", "__loader__", "__spec__",
    "get_ipython", "attrgetter", "methodcaller", "help", "dir"})
BANNED_ATTRS = frozenset({
    "sys", "os", "gc", "builtins", "importlib", "inspect", "ctypes", "subprocess", "modules", "monitoring",
    "settrace", "setprofile", "_getframe", "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "tb_frame",
    "tb_next", "gi_frame", "cr_frame", "ag_frame", "co_code", "attrgetter", "methodcaller", "system", "popen",
    "_current_frames", "signal", "threading", "_thread", "multiprocessing", "setrlimit", "environ"})


@dataclass
class Finding:
    kind: str  # "reuse" or "tamper"
    cell: int  # index in the executed notebook
    line: int
    what: str
    checks: tuple[str, ...] = ()
    binds: tuple[str, ...] = ()  # names the cell defines: a reuse counts against the checks of those names

    def describe(self) -> str:
        if self.kind == "reuse":
            return f"cell {self.cell}, line {self.line}: uses the package's reference implementation {self.what}"
        return f"cell {self.cell}, line {self.line}: {self.what}"


def _import_all_tinypaged() -> None:
    import tinypaged

    for info in pkgutil.walk_packages(tinypaged.__path__, "tinypaged."):
        if info.name.startswith("tinypaged.course.grading"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # an optional module that cannot load here names nothing
            pass


def forbidden_names() -> dict[str, set[str]]:
    """Dotted name -> the checks that forbid it: every name under which a forbidden object is reachable."""
    from tinypaged.course import checks

    checks._load_all()
    _import_all_tinypaged()
    by_id: dict[int, set[str]] = {}
    objects: dict[int, object] = {}
    for c in checks.REGISTRY.values():
        for obj in c.forbidden_objects():
            if obj is None:
                continue
            by_id.setdefault(id(obj), set()).add(c.name)
            objects[id(obj)] = obj
    names: dict[str, set[str]] = {}
    for key, obj in objects.items():
        qual = getattr(obj, "__qualname__", None)
        if getattr(obj, "__module__", None) and qual:
            names.setdefault(f"{obj.__module__}.{qual}", set()).update(by_id[key])
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("tinypaged") or mod is None:
            continue
        for attr, val in list(vars(mod).items()):
            if id(val) in objects and objects[id(val)] is val:
                names.setdefault(f"{modname}.{attr}", set()).update(by_id[id(val)])
    return names


def _code(source: str) -> str:
    """IPython magics and shell escapes are not Python: blank them (keeping line numbers)."""
    return "\n".join("" if re.match(r"\s*[%!]", line) else line for line in source.splitlines())


class Scanner:
    def __init__(self, forbidden: dict[str, set[str]] | None = None):
        self.forbidden = forbidden if forbidden is not None else forbidden_names()
        self.aliases: dict[str, str] = {}

    # -- names ------------------------------------------------------------------------------
    def resolve(self, node) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id if node.id in ("sys", "gc", "builtins", "importlib") else None)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            base = self.resolve(node.args[0])
            return f"{base}.{node.args[1].value}" if base else None
        return None

    def learn(self, tree) -> None:
        """Imports and ``x = <module path>`` aliases anywhere in the code."""
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if a.name != "*":
                        self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                path = self.resolve(node.value)
                if path and path.split(".")[0] in ("tinypaged", "sys", "gc", "builtins", "importlib"):
                    self.aliases[node.targets[0].id] = path

    # -- findings ---------------------------------------------------------------------------
    def _reuse(self, path: str) -> set[str]:
        hit = set()
        for name, owners in self.forbidden.items():
            if path == name or path.startswith(name + "."):
                hit |= owners
        return hit

    def scan(self, source: str, cell: int) -> list[Finding]:
        try:
            tree = ast.parse(_code(source))
        except SyntaxError:
            return []  # the cell's own SyntaxError is reported from its execution
        self.learn(tree)
        found: list[Finding] = []

        def add(kind, node, what, checks=()):
            found.append(Finding(kind, cell, getattr(node, "lineno", 0), what, tuple(sorted(checks))))

        for node in ast.walk(tree):
            paths = []
            if isinstance(node, (ast.Name, ast.Attribute)) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                                                              and node.func.id == "getattr"):
                p = self.resolve(node)
                if p:
                    paths.append(p)
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if a.name == "*":
                        owners = set().union(*(o for n, o in self.forbidden.items() if n.rsplit(".", 1)[0] == node.module)) \
                            if any(n.rsplit(".", 1)[0] == node.module for n in self.forbidden) else set()
                        if owners:
                            add("reuse", node, f"from {node.module} import *", owners)
                    else:
                        paths.append(f"{node.module}.{a.name}")
            if isinstance(node, ast.Import):
                paths.extend(a.name for a in node.names)
            for p in paths:
                owners = self._reuse(p)
                if owners:
                    add("reuse", node, p, owners)
                if _under(p, GRADER_MODULES) and p not in ALLOWED_GRADER_NAMES:
                    add("tamper", node, f"touches the grader ({p})")
                if _under(p, SENSITIVE):
                    add("tamper", node, f"uses {p}, which can change how the grader runs")
            # monkeypatching: assigning to / deleting an attribute of a module
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            for tgt in targets:
                for sub in ast.walk(tgt):
                    if isinstance(sub, ast.Attribute):
                        base = self.resolve(sub.value)
                        if base and self._is_module_path(base):
                            add("tamper", node, f"monkeypatches {base}.{sub.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                fn = node.func.id
                if fn in ("setattr", "delattr", "vars") and node.args:
                    base = self.resolve(node.args[0])
                    if base and self._is_module_path(base):
                        add("tamper", node, f"{fn}() on {base}")
                if fn == "getattr" and node.args and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
                    base = self.resolve(node.args[0])
                    if base and base.startswith("tinypaged"):
                        add("tamper", node, f"looks up names of {base} dynamically")
                if fn in SENSITIVE_CALLS and fn not in self.aliases:
                    add("tamper", node, f"calls {fn}(), which can run code the grader cannot read")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and any(s in node.value for s in SENSITIVE_STRINGS):
                add("tamper", node, "names the grader's switches")
        return _dedupe(found)

    def _is_module_path(self, path: str) -> bool:
        """``path`` is inside tinypaged or the interpreter's machinery (patching torch or numpy cannot
        change a verdict: verdicts are computed outside the learner's process)."""
        return path.split(".")[0] in ("tinypaged", "sys", "gc", "builtins", "importlib", "IPython")


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


def bound_names(source: str) -> set[str]:
    """Names a cell defines or (re)binds anywhere: the targets a reuse in this cell can stand in for."""
    try:
        tree = ast.parse(_code(source))
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _dedupe(found: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in found:
        key = (f.kind, f.cell, f.line, f.what if f.kind == "reuse" else "")
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def strict_findings(source: str, index: int) -> list[Finding]:
    """What a solution cell may not do at all (the module grading imports is built from these cells)."""
    try:
        tree = ast.parse(_code(source))
    except SyntaxError:
        return []
    found = []

    def add(node, what):
        found.append(Finding("tamper", index, getattr(node, "lineno", 0), what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] not in ALLOWED_IMPORTS:
                    add(node, f"imports {a.name}, which a solution cell may not use")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level or mod.split(".")[0] not in ALLOWED_IMPORTS:
                add(node, f"imports from {mod or '.'}, which a solution cell may not use")
            elif mod.startswith(GRADER_MODULES) and any(f"{mod}.{a.name}" not in ALLOWED_GRADER_NAMES
                                                        for a in node.names):
                add(node, f"touches the grader ({mod})")
        elif isinstance(node, ast.Attribute):
            if (node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in ALLOWED_DUNDERS) \
                    or node.attr in BANNED_ATTRS:
                add(node, f"reaches .{node.attr}, which a solution never needs")
        elif isinstance(node, ast.Name) and node.id in BANNED_NAMES:
            add(node, f"uses {node.id}, which a solution cell may not use")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.search(r"__\w+__", node.value) and not set(re.findall(r"__\w+__", node.value)) <= ALLOWED_DUNDERS:
            add(node, "names a dunder attribute in a string")
    return found


def scan_notebook(cells: list[tuple[int, str, bool]], forbidden: dict[str, set[str]] | None = None) -> list[Finding]:
    """``cells``: (index, source, is the learner's) in execution order; only the learner's are judged."""
    scanner = Scanner(forbidden)
    found = []
    for index, source, learner in cells:
        if learner:
            binds = tuple(sorted(bound_names(source)))
            for f in scanner.scan(source, index) + strict_findings(source, index):
                f.binds = binds
                found.append(f)
        else:
            try:
                scanner.learn(ast.parse(_code(source)))
            except SyntaxError:
                pass
    return found
