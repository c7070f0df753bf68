"""No monkey-patching in the package: components talk through methods they own.

The rule this test enforces, on every module of ``tinypaged/`` (parsed with ``ast``):
an assignment (``=``, or ``setattr(obj, name, value)``) whose target is an attribute is a
*patch*, and fails the test, when

1. the object is an imported module (``module.func = ...``), whatever the value; or
2. the object is not ``self``/``cls`` and the value is callable code: a ``lambda``, a name bound
   by a ``def`` (and never by ``=``) in the same module, ``functools.partial(...)`` or ``types.MethodType(...)``
   (``engine.step = step_and_publish``, ``manager.allocate = lambda ...``); or
3. the object is ``self``/``cls`` and the attribute is a method the class defines (rebinding
   one's own method; a property is data, written through its setter).

Plain data attributes (``self.compiled = None``, ``obj.count = 3``) and storing a callback in
one's own attribute (``self.on_done = fn``) are not patches. The exceptions are listed in
``ALLOWED`` as ``(path, line text)`` with a reason; keep that list tiny.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tinypaged"

# (path relative to the package, stripped source line) -> reason
ALLOWED: dict[tuple[str, str], str] = {
    ("course/grading/probe.py", "sys.stdout = sys.stderr"):
        "redirects the interpreter's output stream (data), not a function",
}

_FACTORIES = {"partial", "MethodType"}


def _imported_modules(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _is_code(value: ast.AST, defs: set[str]) -> bool:
    if isinstance(value, ast.Lambda):
        return True
    if isinstance(value, ast.Name):
        return value.id in defs
    if isinstance(value, ast.Call):
        f = value.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        return name in _FACTORIES
    return False


def _is_property(decorator: ast.AST) -> bool:
    """``@property``, ``@functools.cached_property``, ``@name.setter`` (and ``.getter``, ``.deleter``)."""
    if isinstance(decorator, ast.Name):
        return decorator.id in ("property", "cached_property")
    return isinstance(decorator, ast.Attribute) and decorator.attr in ("cached_property", "setter", "getter", "deleter")


def find_patches(source: str, path: str = "<src>") -> list[str]:
    """Return ``path:line: text`` for every patch in ``source`` (rule in the module docstring)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    modules = _imported_modules(tree)
    data = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Name)}
    defs = {n.name for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} - data  # a def-only name
    methods_of: dict[int, set[str]] = {}
    class_of: dict[int, ast.ClassDef] = {}
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            funcs = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            own = {n.name for n in funcs} - {n.name for n in funcs if any(_is_property(d) for d in n.decorator_list)}
            methods_of[id(cls)] = own
            for sub in ast.walk(cls):
                class_of.setdefault(id(sub), cls)  # outermost class wins; good enough here
    found: list[str] = []

    def check(node: ast.AST, obj: ast.AST, attr: str | None, value: ast.AST) -> None:
        base = obj.id if isinstance(obj, ast.Name) else None
        bad = False
        if base in modules:
            bad = True
        elif base in ("self", "cls"):
            cls = class_of.get(id(node))
            bad = cls is not None and attr is not None and attr in methods_of[id(cls)]
        else:
            bad = _is_code(value, defs)
        if bad:
            text = lines[node.lineno - 1].strip()
            if (path, text) not in ALLOWED and f"{path}:{node.lineno}: {text}" not in found:
                found.append(f"{path}:{node.lineno}: {text}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                pairs = [(t, node.value)]
                if isinstance(t, ast.Tuple):  # a, b = f, g pairs up; a, b = saved checks each with saved
                    values = node.value.elts if isinstance(node.value, ast.Tuple) \
                        and len(node.value.elts) == len(t.elts) else [node.value] * len(t.elts)
                    pairs = list(zip(t.elts, values))
                for tt, value in pairs:
                    if isinstance(tt, ast.Attribute):
                        check(node, tt.value, tt.attr, value)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" \
                and len(node.args) == 3:
            obj, name, value = node.args
            attr = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None
            check(node, obj, attr, value)
    return found


def test_rule_catches_patches_and_spares_data():
    bad = '''
import json
def step_and_publish(): pass
class A:
    def go(self): pass
    def __init__(self, engine):
        engine.step = step_and_publish
        engine.kv.allocate = lambda n: n
        setattr(engine, "step", step_and_publish)
        engine.kv.register, engine.kv.n = step_and_publish, 3
        json.dumps = str
        self.go = print
'''
    found = find_patches(bad)
    assert len(found) == 6 and not any("kv.n" in f and "register" not in f for f in found), found
    good = '''
class A:
    def __init__(self, fn):
        self.compiled = None
        self.on_done = fn
        self.count = 3
        self.ids = {1}

    @property
    def ids(self):
        return self._ids

    @ids.setter
    def ids(self, value):
        self._ids = set(value)
'''
    assert find_patches(good) == []


def test_package_has_no_monkeypatch():
    found: list[str] = []
    for f in sorted(PACKAGE.rglob("*.py")):
        found += find_patches(f.read_text(), str(f.relative_to(PACKAGE)))
    assert not found, "monkey-patching (see tests/test_no_monkeypatch.py for the rule):\n" + "\n".join(found)
