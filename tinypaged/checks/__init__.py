"""Checks that grade a learner's implementation: the same ones in the notebooks, the tests and the CLI.

Each check is a function that takes the implementation (a function or class the learner wrote)
and raises ``AssertionError`` with a helpful message when it is wrong. ``check(name, impl)``
runs one and prints a single stable line:

    check block_allocator: PASS
    check block_allocator: FAIL - block 3 is owned twice after fork
    check block_allocator: not implemented yet

Checks are registered per stage (``stage01.py`` ... ``stage05.py``) with the notebook name the
learner's code lives under, so ``python -m tinypaged.coursework grade NOTEBOOK`` can find it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

PASS, FAIL, TODO = "PASS", "FAIL", "not implemented yet"


@dataclass
class Check:
    name: str
    stage: str  # "01" ... "05": the notebook prefix
    target: str  # the name the learner defines in the notebook
    run: Callable[[object], None]
    reference: Callable[[], object]  # returns tinypaged's own implementation
    points: int = 1


REGISTRY: dict[str, Check] = {}
STAGE_MODULES = ("stage01", "stage02", "stage03", "stage04", "stage05", "stage06")


def register(stage: str, target: str, reference: Callable[[], object], points: int = 1):
    """Decorator: ``@register("02", "slot_mapping", lambda: block_manager.slot_of)``."""

    def wrap(fn):
        REGISTRY[fn.__name__.removeprefix("check_")] = Check(fn.__name__.removeprefix("check_"), stage, target,
                                                             fn, reference, points)
        return fn

    return wrap


def _load_all() -> None:
    for mod in STAGE_MODULES:
        try:
            importlib.import_module(f"tinypaged.checks.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"tinypaged.checks.{mod}":
                raise


def get(name: str) -> Check:
    _load_all()
    if name not in REGISTRY:
        raise KeyError(f"No check named {name!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[name]


def checks_for_stage(stage: str) -> list[Check]:
    _load_all()
    return [c for c in REGISTRY.values() if c.stage == stage]


def evaluate(name: str, impl) -> tuple[str, str]:
    """Run one check quietly: (status, message)."""
    c = get(name)
    try:
        c.run(impl)
    except NotImplementedError:
        return TODO, ""
    except AssertionError as e:
        return FAIL, str(e) or "assertion failed"
    except Exception as e:  # a crash in the learner's code is a failure, not a crash of the notebook
        return FAIL, f"{type(e).__name__}: {e}"
    return PASS, ""


def check(name: str, impl) -> str:
    """Run one check and print its one-line verdict; returns the status."""
    status, msg = evaluate(name, impl)
    print(f"check {name}: {status}" + (f" - {msg}" if msg else ""))
    return status
