"""Checks that grade a learner's implementation: the same ones in the notebooks, the tests and the grader.

A check is a list of *cases*. A case runs the implementation under test on fixed (or seeded random)
inputs and records what it observed, step by step, as plain JSON values::

    def run(slot_mapping, t):
        t("slots of positions 0..9, table [7, 2, 9], block_size 4", slot_mapping([7, 2, 9], range(10), 4))

The expected steps come from running the same case with tinypaged's reference implementation, so
a check never states an answer twice. ``check(name, impl)`` compares the two in-process and prints
one stable line::

    check slot_mapping: PASS
    check slot_mapping: FAIL - case 'one block': block table [5], block_size 16, positions [0, 1, 2]: expected [80, 81, 82], got [0, 1, 2]
    check slot_mapping: not implemented yet

Grading never trusts that line (the learner's kernel could patch this module). In grading mode
(``TINYPAGED_GRADING=1``) ``check`` also displays a *record* of the observed steps; the grader, in
its own process, recomputes the expected steps and compares (``tinypaged.course.grading.verify``).

Hidden tests: ``check(name, impl, hidden=SEED)`` runs the check's hidden cases, random inputs drawn
from ``SEED``. The seeds live only in the instructor's notebooks (``### BEGIN HIDDEN TESTS``).

Checks are registered per stage (``stage01.py``, ...; add a module name to ``STAGE_MODULES`` for a
new stage) with the name the learner's code has in the notebook.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
import os
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable

PASS, FAIL, TODO = "PASS", "FAIL", "not implemented yet"
RECORD_MIME = "application/vnd.tinypaged.check+json"
GRADING_ENV = "TINYPAGED_GRADING"
MAX_SHOWN = 160  # characters of a value shown in a message
MAX_NOTE = 1500  # characters of a case's replay note shown in a message


# ---------------------------------------------------------------- cases and steps

class Trace:
    """The steps a case observed: ``t(description, value)`` records one and returns ``value``."""

    def __init__(self):
        self.steps: list[list] = []
        self.note: str | None = None  # shown after the verdict of a failing case (``note``)

    def __call__(self, description: str, value):
        self.steps.append([description, plain(value)])
        return value

    def replay(self, text: str) -> None:
        """Attach a note to the case, shown only if it fails: e.g. the shortest run of operations that still
        fails, so a random case can be replayed. Computed where the implementation runs; never compared."""
        self.note = str(text)[:MAX_NOTE]


@dataclass
class Case:
    """One scenario: ``run(impl, t)`` drives the implementation and records steps with ``t``."""

    label: str
    run: Callable[[Any, Trace], Any]
    hint: str = ""  # why it matters, shown when the case fails
    tol: float = 0.0  # absolute tolerance for numbers (tensors: max abs error)
    weight: float = 1.0
    # (text in a step's description, hint): a failing step whose description contains the text gets that hint
    # instead of ``hint`` (the first match wins), so a wrong return value is not explained by another step's hint
    step_hints: tuple[tuple[str, str], ...] = ()

    def hint_for(self, description: str | None) -> str:
        for text, hint in self.step_hints:
            if description is not None and text in description:
                return hint
        return self.hint


@dataclass
class Check:
    name: str
    stage: str  # "01", "02", ...: the notebook's stage
    target: str  # the name the learner defines in the notebook
    make_cases: Callable[[int | None], list[Case]]  # hidden seed (None: the visible cases) -> cases
    reference: Callable[[], object]  # tinypaged's own implementation
    points: int = 1  # suggested points (the notebook's test cell metadata is what counts)
    forbidden: Callable[[], list] | None = None  # what the learner may not reuse (default: the reference)
    expected: Callable[[int | None], list] | None = None  # expected outcomes without a reference impl
    trace: bool = True  # watch for calls into the forbidden code while the implementation runs
    uses: tuple[str, ...] = ()  # other learner names this check exercises (a serving check: all of a stage's)
    # ``expected`` computed with the package's graded code (not only transformers): the student edition, whose
    # graded bodies are stubs, must ship its visible outcomes as data like a reference-based check's
    expected_uses_reference: bool = False

    def cases(self, hidden: int | None = None) -> list[Case]:
        return self.make_cases(hidden)

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.target, *self.uses)

    def forbidden_objects(self) -> list:
        return list(self.forbidden()) if self.forbidden is not None else [self.reference()]


REGISTRY: dict[str, Check] = {}
# One module per stage; a new stage adds its module name here (missing modules are skipped).
STAGE_MODULES = ("stage01", "stage02", "stage03", "stage04", "stage05", "stage06", "stage07", "stage08", "stage09")


def register(stage: str, target: str, reference: Callable[[], object] | None = None, points: int = 1,
             forbidden: Callable[[], list] | None = None, expected=None, trace: bool = True, name: str | None = None,
             uses: tuple[str, ...] = (), expected_uses_reference: bool = False):
    """Decorator on a function ``cases(hidden) -> list[Case]``; the check is named after it (minus ``cases_``)."""

    def wrap(fn):
        check_name = name or fn.__name__.removeprefix("cases_")
        REGISTRY[check_name] = Check(check_name, stage, target, fn, reference or (lambda: None), points,
                                     forbidden, expected, trace, tuple(uses), expected_uses_reference)
        return fn

    return wrap


def _load_all() -> None:
    for mod in STAGE_MODULES:
        try:
            importlib.import_module(f"tinypaged.course.checks.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"tinypaged.course.checks.{mod}":
                raise


def get(name: str) -> Check:
    _load_all()
    if name not in REGISTRY:
        raise KeyError(f"No check named {name!r}; known: {sorted(REGISTRY)}")
    return REGISTRY[name]


def checks_for_stage(stage: str) -> list[Check]:
    _load_all()
    return [c for c in REGISTRY.values() if c.stage == stage]


# ---------------------------------------------------------------- plain values

def plain(value):
    """A JSON value for what an implementation returned (tensors keep shape and numbers)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, range)):
        return [plain(v) for v in value]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        # a subclass's own methods and __torch_function__ play no part: its data as a plain tensor
        with torch._C.DisableTorchFunctionSubclass():
            v = torch.Tensor.as_subclass(value, torch.Tensor)
        v = torch.Tensor.cpu(torch.Tensor.detach(v))
        if v.is_floating_point():
            v = v.double()
            data = [x if math.isfinite(x) else repr(x) for x in v.flatten().tolist()]
        else:
            data = v.flatten().tolist()
        return {"tensor": list(v.shape), "data": data}
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return plain(value.item())
        except Exception:
            pass
    return f"<{type(value).__name__}>"


def _show(value, other=None) -> str:
    """``value`` in at most about MAX_SHOWN characters. With ``other`` (the value it is compared with), a long
    value is cut around the first character where the two differ, at the same place in both, so that a message
    shows the difference rather than the prefix they share."""
    if isinstance(value, dict) and "tensor" in value:
        return f"a tensor of shape {tuple(value['tensor'])}"
    text = _text_of(value)
    if len(text) <= MAX_SHOWN:
        return text
    start = 0
    if other is not None and not (isinstance(other, dict) and "tensor" in other):
        start = max(0, _first_difference(text, _text_of(other)) - MAX_SHOWN // 4)  # the same in both texts
    head = "..." if start else ""
    body = text[start: start + MAX_SHOWN - 3 - len(head)]
    return head + body + ("..." if start + len(body) < len(text) else "")


def _text_of(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _show_both(want, got) -> str:
    """``expected ..., got ...``, each cut around their first difference; cut lists of different lengths say so."""
    shown_want, shown_got = _show(want, got), _show(got, want)
    sizes = ""
    if isinstance(want, list) and isinstance(got, list) and len(want) != len(got) and "..." in shown_want + shown_got:
        sizes = f" ({len(want)} items expected, {len(got)} received)"
    return f"expected {shown_want}, got {shown_got}{sizes}"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _error(a, b) -> float:
    """|a - b|, where NaN and infinity differ from everything but themselves (never NaN: ``nan > tol`` is False)."""
    if math.isfinite(a) and math.isfinite(b):
        return abs(a - b)
    same = (math.isnan(a) and math.isnan(b)) or a == b
    return 0.0 if same else math.inf


def differ(want, got, tol: float) -> str | None:
    """Why ``got`` is not ``want`` (None if it is), comparing numbers within ``tol``. A difference inside a
    list or dict is named by its path, once: ``at [0]['pages']: expected [1, 2], got [1]``."""
    found = _differ(want, got, tol)
    if found is None:
        return None
    path, why = found
    return f"at {''.join(f'[{p!r}]' for p in path)}: {why}" if path else why


def _differ(want, got, tol: float) -> tuple[list, str] | None:
    """(path to the first difference, why), or None."""
    if isinstance(want, dict) and "tensor" in want:
        if not (isinstance(got, dict) and "tensor" in got):
            return [], f"expected a tensor of shape {tuple(want['tensor'])}, got {_show(got)}"
        if got["tensor"] != want["tensor"]:
            return [], f"expected shape {tuple(want['tensor'])}, got shape {tuple(got['tensor'])}"
        w, g = want["data"], got["data"]
        if len(w) != len(g) or not all(_number(x) or isinstance(x, str) for x in g):
            return [], "the tensor's values are malformed"
        if any(isinstance(x, str) for x in g):
            return [], "the output holds inf or NaN (subtract the running max before exp?)"
        worst, at = 0.0, 0
        for i, (a, b) in enumerate(zip(w, g)):
            err = _error(a, b) if _number(a) else math.inf
            if err > worst:
                worst, at = err, i
        if worst > tol:
            shape, index, rest = want["tensor"], [], at
            for size in reversed(shape):
                index.append(rest % size)
                rest //= size
            where = list(reversed(index))
            return [], (f"max error {worst:.3g} at index {where} (expected {w[at]:.6g}, got {g[at]:.6g}; "
                        f"tolerance {tol:g})")
        return None
    if _number(want) and _number(got):
        return None if _error(want, got) <= tol else ([], f"expected {_show(want)}, got {_show(got)}")
    if isinstance(want, dict) and isinstance(got, dict) and want.keys() == got.keys():
        for k in want:  # name the first entry that differs
            found = _differ(want[k], got[k], tol)
            if found is not None:
                return [k, *found[0]], found[1]
        return None
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        if len(want) > 6 or any(isinstance(w, (list, dict)) for w in want):
            for i, (w, g) in enumerate(zip(want, got)):  # long or nested lists: the first item that differs
                found = _differ(w, g, tol)
                if found is not None:
                    return [i, *found[0]], found[1]
            return None
        if tol:
            return None if all(_differ(w, g, tol) is None for w, g in zip(want, got)) else \
                ([], _show_both(want, got))
    return None if want == got else ([], _show_both(want, got))


# ---------------------------------------------------------------- running cases

def _mentions_not_implemented(e: BaseException) -> bool:
    """NotImplementedError, possibly wrapped (Triton's interpreter and compiler wrap the stub's raise)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, NotImplementedError) or "NotImplementedError" in f"{e!r} {e}":
            return True
        e = e.__cause__ or e.__context__
    return False


def _codes_of(obj) -> set:
    """Code objects of a function, method, class (all its methods and properties) or module-level callable."""
    codes = set()
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if isinstance(obj, functools.partial):
        obj = obj.func
    fn = getattr(obj, "fn", None)  # a @triton.jit kernel wraps its Python function
    if isinstance(fn, types.FunctionType):
        codes.add(fn.__code__)
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        codes.add(getattr(obj, "__func__", obj).__code__)
    elif isinstance(obj, type):
        for klass in obj.__mro__:
            if klass.__module__ != "builtins":
                for attr in vars(klass).values():
                    if isinstance(attr, property):
                        attr = attr.fget
                    attr = getattr(attr, "__func__", attr)
                    if isinstance(attr, types.FunctionType):
                        codes.add(attr.__code__)
    return codes


def reuse_of_reference(check: Check, impl) -> str | None:
    """Why ``impl`` is (a wrapper around, a copy of, or a subclass of) the package's own code, or None."""
    if impl is None:
        return None
    forbidden = check.forbidden_objects()
    target = impl
    for _ in range(5):  # peel wrappers: functools.wraps, partial, bound methods
        if isinstance(target, functools.partial):
            target = target.func
        elif hasattr(target, "__wrapped__"):
            target = target.__wrapped__
        elif isinstance(target, types.MethodType):
            target = target.__func__
        else:
            break
    for ref in forbidden:
        if target is ref or impl is ref:
            return f"{check.target} is the package's own {_qualname(ref)}"
        if isinstance(target, type) and isinstance(ref, type) and issubclass(target, ref):
            return f"{check.target} subclasses the package's own {_qualname(ref)}"
    module = getattr(target, "__module__", None) or ""
    if module.startswith("tinypaged") and not module.startswith("tinypaged.interfaces"):
        return f"{check.target} is defined in the package ({module}), not in your notebook"
    # The reference's own code objects under another name (copied functions, borrowed methods).
    shared = _codes_of(target) & set().union(*(_codes_of(r) for r in forbidden)) if forbidden else set()
    if shared:
        return f"{check.target} runs the code of the package's own {sorted(c.co_qualname for c in shared)[0]}"
    return None


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def _ours() -> tuple[str, ...]:
    """Directories of code that is not the learner's: tinypaged, its kernels, the standard library, site-packages."""
    import sysconfig

    import tinypaged

    dirs = {os.path.dirname(os.path.abspath(tinypaged.__file__))}
    kernels = sys.modules.get("tinypaged.kernels")
    if kernels is not None and getattr(kernels, "__file__", None):
        dirs.add(os.path.dirname(os.path.abspath(kernels.__file__)))
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.abspath(path))
    return tuple(d + os.sep for d in dirs)


class _Tripwire:
    """A trace function that notes calls into forbidden code made (directly or not) by the learner's code.

    The check's own code may use reference helpers to set up a case; only a forbidden call with a
    learner frame between it and the case runner counts.
    """

    def __init__(self, codes):
        self.codes = codes
        self.hits: list[str] = []
        self.ours = _ours()
        self.base = None  # the case runner's frame

    def _learner_on_stack(self, frame) -> bool:
        f = frame.f_back
        while f is not None and f is not self.base:
            name = f.f_code.co_filename
            if not (name.startswith(self.ours) or name.startswith("<frozen")):
                return True
            f = f.f_back
        return False

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code in self.codes and self._learner_on_stack(frame):
            self.hits.append(frame.f_code.co_qualname)
        return None


def run_case(case: Case, impl, tripwire: _Tripwire | None = None) -> dict:
    """Run one case: ``{"steps": [[description, value], ...]}`` plus ``"todo"`` or ``"error"`` if it stopped."""
    t = Trace()
    out: dict = {}
    previous = sys.gettrace()
    try:
        if tripwire is not None:
            tripwire.base = sys._getframe()
            sys.settrace(tripwire)
        result = case.run(impl, t)
        if result is not None:
            t("result", result)
    except NotImplementedError:
        out["todo"] = True
    except Exception as e:  # the learner's code failing is a result, not a crash of the check
        if _mentions_not_implemented(e):
            out["todo"] = True
        else:
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        if tripwire is not None:
            if sys.gettrace() is not tripwire:
                tripwire.hits.append("(the trace function was replaced)")
            sys.settrace(previous)
    out["steps"] = t.steps
    if t.note:
        out["note"] = t.note
    return out


def observe(check: Check, impl, hidden: int | None = None, detect: bool = True) -> dict:
    """Run every case of ``check`` on ``impl``: the record the grader verifies."""
    reuse = reuse_of_reference(check, impl) if detect else None
    tripwire = None
    if detect and check.trace and reuse is None:
        codes = set().union(*(_codes_of(r) for r in check.forbidden_objects()))
        tripwire = _Tripwire(codes) if codes else None
    outcomes = [run_case(case, impl, tripwire) for case in check.cases(hidden)]
    if tripwire is not None and tripwire.hits:
        reuse = f"{check.target} calls the package's own {sorted(set(tripwire.hits))[0]}"
    return {"check": check.name, "hidden": hidden, "outcomes": outcomes, "reuse": reuse}


# The student edition (tinypaged.course.student_edition) ships this file instead of the graded references, whose
# bodies it stubs: the visible cases' expected outcomes, computed by the full package when the edition was written.
STORED_EXPECTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "expected_visible.json")


def _stored_expected(name: str) -> str | None:
    try:
        with open(STORED_EXPECTED) as f:
            stored = json.load(f)
    except FileNotFoundError:
        return None
    return json.dumps(stored[name]) if name in stored else None


@functools.lru_cache(maxsize=None)
def _expected_json(name: str, hidden: int | None) -> str:
    if hidden is None and (stored := _stored_expected(name)) is not None:
        return stored
    c = get(name)
    if c.expected is not None:
        outcomes = c.expected(hidden)
    else:
        outcomes = [run_case(case, c.reference()) for case in c.cases(hidden)]
    for i, o in enumerate(outcomes):
        if "error" in o or "todo" in o:
            raise RuntimeError(f"check {name}: the reference failed its own case {i}: {o}")
    return json.dumps(outcomes)


_EXPECTED_LOCK = threading.Lock()


def expected_outcomes(name: str, hidden: int | None = None) -> list[dict]:
    """What the reference implementation observes in every case (cached per process; one at a time)."""
    with _EXPECTED_LOCK:
        return json.loads(_expected_json(name, hidden))


def compare_case(want: dict, got, tol: float = 0.0) -> tuple[bool, bool, str]:
    """One case: (passed, not implemented, message). ``got`` is untrusted: anything malformed fails."""
    return _compare_case(want, got, tol)[:3]


def _compare_case(want: dict, got, tol: float = 0.0) -> tuple[bool, bool, str, str | None]:
    """``compare_case`` plus the description of the step that failed (None: none did, or the case as a whole)."""
    g = got if isinstance(got, dict) else {}
    steps = g.get("steps") if isinstance(g.get("steps"), list) else []
    error = g.get("error") if isinstance(g.get("error"), str) else None
    for k, (desc, value) in enumerate(want["steps"]):
        step = steps[k] if k < len(steps) else None
        if not (isinstance(step, list) and len(step) == 2):
            if g.get("todo") is True:
                return False, True, TODO, None
            return False, False, f"{desc}: raised {error}" if error else f"{desc}: no result", desc
        why = differ(value, step[1], tol)
        if why is not None:
            return False, False, f"{desc}: {why}", desc
    if g.get("todo") is True:
        return False, True, TODO, None
    if error:
        return False, False, f"raised {error}", None
    return True, False, "", None


def _note(got) -> str:
    """A failing case's replay note (untrusted text from the implementation's process: a string, cut short)."""
    note = got.get("note") if isinstance(got, dict) else None
    return note[:MAX_NOTE] if isinstance(note, str) else ""


def judge(check: Check, record, hidden: int | None = None) -> dict:
    """Score a record against the expected outcomes: weight passed, weight in all, first failure, reuse."""
    cases = check.cases(hidden)
    got = record.get("outcomes") if isinstance(record, dict) else None
    got = got if isinstance(got, list) else []
    if len(got) == len(cases) and all(isinstance(g, dict) and g.get("todo") is True and not g.get("steps")
                                      for g in got):
        results = [(False, True, TODO, None)] * len(cases)  # nothing to compare: skip computing the expectations
    else:
        expected = expected_outcomes(check.name, hidden)
        results = [_compare_case(want, got[i] if i < len(got) else None, case.tol)
                   for i, (case, want) in enumerate(zip(cases, expected))]
    total = sum(c.weight for c in cases)
    passed = sum(c.weight for c, (ok, *_) in zip(cases, results) if ok)
    todo = bool(results) and all(t for _, t, *_ in results)
    message = ""
    for i, (case, (ok, t, msg, desc)) in enumerate(zip(cases, results)):
        if not ok:
            hint, note = case.hint_for(desc), _note(got[i] if i < len(got) else None)
            message = TODO if t else (f"case '{case.label}': {msg}" + (f" ({hint})" if hint else "")
                                      + (f"; {note}" if note else ""))
            break
    reuse = record.get("reuse") if isinstance(record, dict) and isinstance(record.get("reuse"), str) else None
    if reuse:
        passed, message = 0.0, "uses the package's reference implementation: " + reuse
    status = PASS if passed == total and total > 0 else (TODO if todo and not reuse else FAIL)
    return {"check": check.name, "hidden": hidden, "passed": passed, "total": total, "status": status,
            "message": message, "failed_cases": sum(1 for ok, *_ in results if not ok)}


# ---------------------------------------------------------------- in-notebook API

def evaluate(name: str, impl, hidden: int | None = None, detect: bool = True) -> tuple[str, str]:
    """Run one check in-process: (status, message). For self-paced learners and the unit tests
    (``detect=False`` to run a check on the reference itself)."""
    c = get(name)
    verdict = judge(c, observe(c, impl, hidden, detect), hidden)
    return verdict["status"], verdict["message"]


def grading() -> bool:
    return os.environ.get(GRADING_ENV) == "1"


def _emit(record: dict) -> None:
    try:
        from IPython.display import display
    except ImportError:
        return
    display({RECORD_MIME: record, "text/plain": f"<tinypaged record: {record['check']}>"}, raw=True)


def check(name: str, impl, hidden: int | None = None) -> None:
    """Run one check and print its one-line verdict (``evaluate`` returns it instead).

    In grading mode the kernel only observes: it displays the record for the grader, which computes the
    expected results and the verdict in its own process (so nothing is judged twice). Outside grading, a student
    edition refuses hidden cases with one line and no verdict: its expected values for them would be the
    learner's own (visible cases use the expectations stored in the edition).
    """
    c = get(name)
    what = f"check {name}" + (" (hidden cases)" if hidden is not None else "")
    if hidden is not None and not grading():
        import importlib.util

        try:  # the marker module that student_edition.write puts in every edition (the package has none)
            edition = importlib.util.find_spec("tinypaged._edition") is not None
        except (ImportError, ValueError):
            edition = False
        if edition:
            print(f"{what}: hidden cases are graded by the grader; the student edition holds no answers for them")
            return
    record = observe(c, impl, hidden)
    if grading():
        print(f"{what}: observed {len(record['outcomes'])} case(s) for the grader")
        _emit(record)
        return
    verdict = judge(c, record, hidden)
    msg = verdict["message"]
    print(f"{what}: {verdict['status']}" + (f" - {msg}" if msg and msg != TODO else ""))
