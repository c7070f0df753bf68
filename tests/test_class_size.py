"""Every class in the package is at most 200 lines (issue #47: split a longer one by concern).

The rule this test enforces, on every module of ``tinypaged/`` (parsed with ``ast``): a class's length is the
number of source lines from its ``class`` line (its decorators included) to its last line, nested classes and
docstrings included; over ``LIMIT`` fails the test. A class still too long is listed in ``KNOWN`` as
``(path, class name)`` with the reason; the test also fails when a listed class has shrunk to ``LIMIT`` or fewer,
or is gone, so the list can only get shorter.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tinypaged"
LIMIT = 200

# (path relative to the package, class name) -> reason; empty since LLMEngine became the front end of an
# EngineCore (issue #47, 2026-12-04)
KNOWN: dict[tuple[str, str], str] = {}


def class_lengths(source: str) -> dict[str, int]:
    """``{qualified class name: lines}`` for every class in ``source``, nested ones as ``Outer.Inner``."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found[name] = child.end_lineno - first + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def package_classes() -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        for name, n in class_lengths(f.read_text()).items():
            out[(str(f.relative_to(PACKAGE)), name)] = n
    return out


def test_rule_measures_classes_with_decorators_and_nesting():
    source = '''
import dataclasses

@dataclasses.dataclass
class A:
    x: int = 0

    class B:
        """inner"""
        y = 1

def f():
    class C:
        pass
'''
    assert class_lengths(source) == {"A": 7, "A.B": 3, "C": 2}  # a class in a function: by its own name


def test_every_class_is_at_most_200_lines():
    sizes = package_classes()
    long = [f"{path}: class {name} is {n} lines" for (path, name), n in sorted(sizes.items())
            if n > LIMIT and (path, name) not in KNOWN]
    assert not long, f"classes over {LIMIT} lines (split by concern, see tests/test_class_size.py):\n" + \
        "\n".join(long)
    stale = [f"{path}: class {name} is " + (f"{sizes[(path, name)]} lines" if (path, name) in sizes else "gone")
             for path, name in KNOWN if sizes.get((path, name), 0) <= LIMIT]
    assert not stale, f"no longer over {LIMIT} lines: remove from KNOWN:\n" + "\n".join(stale)
