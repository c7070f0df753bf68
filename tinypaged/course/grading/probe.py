"""The checks' process: import a learner's code as a module and observe what it does on every check's cases.

    python -m tinypaged.course.grading.probe JOB.json EVENTS.jsonl

It runs inside the sandbox (:mod:`~tinypaged.course.grading.sandbox`), started fresh for every
submission by :mod:`~tinypaged.course.grading.evidence`, which also judges what it reports. ``JOB.json``
holds the module's cells (the instructor's given cells and the learner's code of the solution cells,
in the source's order: see :func:`tinypaged.course.grading.notebook.module_cells`) and the check calls
of the instructor's test cells, hidden seeds included. ``EVENTS.jsonl`` receives one JSON object per line,
written before and after each step, so when the process dies (``os._exit``, a crash in a Triton store
out of bounds, SIGXCPU at the CPU-time limit, the memory limit) the caller knows which step killed it
and starts a new probe after that step.

The process only *observes*: the expected results and every verdict are computed by the caller, in
the grader's process, from the package's references. While the learner's code runs:

* an audit hook (it cannot be removed) refuses, when the learner's own code asks for it, what a
  solution never needs: frames, trace hooks, ``gc`` walks, ``exec``/``compile``, files, processes,
  ``ctypes``, imports outside :data:`~tinypaged.course.grading.scan.ALLOWED_IMPORTS`; each refusal
  is reported as tampering;
* a trace function in every thread (``sys.settrace`` and ``threading.settrace``) notes a call into the
  check's forbidden references with a learner frame on the stack (reuse, however it was reached);
* a Python thread of the learner's still running during a check (one the trace hook may not see) counts
  as reuse for that check;
* each learner cell and each check call runs under its own CPU-time budget (``RLIMIT_CPU``, soft limit).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
import traceback
import types
from pathlib import Path

SERVING_CPU = 300  # CPU seconds a serving check may use, whatever the per-check budget
MODULE = "submission"  # the learner's module (the serving check refuses plug-ins from anywhere else)


class Events:
    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)

    def __call__(self, **event) -> None:
        self.f.write(json.dumps(event) + "\n")
        self.f.flush()


class Guard:
    """The audit hook and the all-threads tripwire; ``learner_files`` are the solution cells' file names."""

    def __init__(self, learner_files: set[str], allowed_imports: frozenset[str]):
        self.learner_files = learner_files
        self.allowed = allowed_imports
        self.refused: list[str] = []
        self.local = threading.local()
        self.codes: set = set()  # forbidden code objects of the check being run
        self.hits: list[str] = []
        self.armed = False
        self.tracer = self.trace  # one bound method, so ``sys.gettrace() is guard.tracer`` means untouched

    def _learner_caller(self, depth: int = 2):
        """The learner's frame that directly asked for the event (importlib's frames skipped), or None."""
        f = sys._getframe(depth)
        while f is not None and ("importlib" in f.f_code.co_filename or f.f_code.co_filename.startswith("<frozen")):
            f = f.f_back
        return f if f is not None and f.f_code.co_filename in self.learner_files else None

    def audit(self, event: str, args) -> None:
        if not self.armed or getattr(self.local, "busy", False):
            return
        if not (event in ("open", "exec", "compile", "sys._getframe", "sys.settrace", "sys.setprofile",
                          "sys._current_frames", "sys.addaudithook", "gc.get_objects", "gc.get_referrers",
                          "gc.get_referents", "object.__getattr__", "object.__setattr__", "object.__delattr__",
                          "import", "function.__new__", "code.__new__", "os.system", "os.fork", "os.forkpty",
                          "os.posix_spawn", "os.exec", "os.spawn", "os.kill", "os.killpg", "subprocess.Popen",
                          "socket.connect", "socket.bind", "signal.pthread_kill", "resource.setrlimit")
                or event.startswith(("ctypes.", "os.", "shutil.", "socket."))):
            return
        self.local.busy = True
        try:
            frame = self._learner_caller(2)
        finally:
            self.local.busy = False
        if frame is None:
            return
        if event == "import":
            top = str(args[0]).split(".")[0]
            if top in self.allowed:
                return
        if event == "object.__getattr__" and isinstance(args[1], str) and args[1] in ("__class__",):
            return
        what = f"{event}({args[0] if args else ''!s:.60})"
        where = f"{Path(frame.f_code.co_filename).stem}, line {frame.f_lineno}"
        self.refused.append(f"{where}: {what}")
        raise PermissionError(f"grading refuses {what} in a solution cell")

    def trace(self, frame, event, arg):
        if event == "call" and frame.f_code in self.codes:
            f = frame.f_back
            while f is not None:
                if f.f_code.co_filename in self.learner_files:
                    self.hits.append(frame.f_code.co_qualname)
                    break
                f = f.f_back
        return None


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _budget(seconds: float) -> None:
    """A soft CPU limit ``seconds`` from now (the hard one, from prlimit, caps the whole probe)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    want = int(_cpu() + seconds) + 1
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (want, hard))


def _resolve(module, expr: str):
    obj = module
    for i, part in enumerate(expr.split(".")):
        obj = vars(obj)[part] if i == 0 else getattr(obj, part)
    return obj


def run(job: dict, events: Events) -> None:
    from tinypaged.course import checks
    from tinypaged.course.grading.scan import ALLOWED_IMPORTS

    checks._load_all()
    for c in checks.REGISTRY.values():  # resolve the references before any learner code runs
        if c.stage == job["stage"]:
            c.forbidden_objects()
    cells_dir = Path.cwd() / "cells"
    cells_dir.mkdir(exist_ok=True)
    files = {}
    for cell in job["cells"]:
        path = cells_dir / f"cell_{cell['index']:03d}_{'learner' if cell['learner'] else 'given'}.py"
        path.write_text(cell["source"])
        files[cell["index"]] = str(path)
    learner_files = {files[c["index"]] for c in job["cells"] if c["learner"]}
    guard = Guard(learner_files, ALLOWED_IMPORTS)
    sys.addaudithook(guard.audit)

    module = types.ModuleType(MODULE)
    module.__file__ = str(cells_dir / "__init__.py")
    sys.modules[MODULE] = module
    baseline = set(sys._current_frames())  # Python threads before any learner code ran
    stop_cells = job.get("skip_cells_from")
    for cell in job["cells"]:
        i = cell["index"]
        if stop_cells is not None and i >= stop_cells:
            events(cell=i, skipped=True)
            continue
        events(cell=i, start=True)
        _budget(job.get("cell_cpu", 120))
        guard.armed = True
        try:
            exec(compile(cell["source"], files[i], "exec"), module.__dict__)
            error = None
        except BaseException as e:  # noqa: BLE001  (SystemExit and KeyboardInterrupt are the learner's too)
            error = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            guard.armed = False
        events(cell=i, done=True, error=error, refused=guard.refused[:])
        guard.refused.clear()

    skip = set(job.get("skip_calls", []))
    for call in job["calls"]:
        key = call["key"]
        if key in skip:
            continue
        events(call=key, start=True)
        c = checks.get(call["check"])
        try:
            impl = _resolve(module, call["target"])
        except (KeyError, AttributeError):
            if stop_cells is not None:  # its cell never ran (an earlier probe died there): no observation
                events(call=key, skipped=True)
                continue
            events(call=key, record={"check": c.name, "hidden": call["hidden"], "reuse": None,
                                     "outcomes": [{"steps": [], "error": f"NameError: {call['target']} is not defined "
                                                  "(did its cell fail?)"}]}, refused=[], threads=[])
            continue
        reuse = checks.reuse_of_reference(c, impl)
        guard.codes = set().union(*(checks._codes_of(r) for r in c.forbidden_objects())) \
            if (c.trace and reuse is None) else set()
        guard.hits = []
        outcomes = []
        # a serving check loads and runs a model: it never gets less than SERVING_CPU seconds
        _budget(max(job.get("check_cpu", 300), SERVING_CPU) if c.expected is not None else job.get("check_cpu", 300))
        for n, case in enumerate(c.cases(call["hidden"])):
            events(call=key, case=n)
            if guard.codes:
                sys.settrace(guard.tracer)
                threading.settrace(guard.tracer)
            guard.armed = True
            try:
                outcomes.append(checks.run_case(case, impl))
            except BaseException as e:  # noqa: BLE001  (SystemExit raised by the learner's code)
                outcomes.append({"steps": [], "error": f"{type(e).__name__}: {str(e)[:300]}"})
            finally:
                guard.armed = False
                if sys.gettrace() is not guard.tracer and guard.codes:
                    guard.hits.append("(the trace function was replaced)")
                sys.settrace(None)
                threading.settrace(None)
        extra = sorted(set(sys._current_frames()) - baseline)
        if guard.hits and reuse is None:
            reuse = f"{c.target} calls the package's own {sorted(set(guard.hits))[0]}"
        if extra and reuse is None:  # a thread the trace hook may not see could have called anything
            reuse = f"{len(extra)} thread(s) your code started ran during the check, where grading cannot watch them"
        record = {"check": c.name, "hidden": call["hidden"], "outcomes": outcomes, "reuse": reuse}
        events(call=key, record=record, refused=guard.refused[:],
               threads=[f"{len(extra)} thread(s) of the learner's code still running"] if extra else [])
        guard.refused.clear()
    events(finished=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ["TINYPAGED_PROBE"] = "1"  # the serving checks print nothing here (see checks/serving.py)
    job = json.loads(Path(argv[0]).read_text())
    events = Events(Path(argv[1]))
    try:
        run(job, events)
    except BaseException:  # noqa: BLE001
        events(probe_error=traceback.format_exc()[-2000:])
        raise
    events.f.close()
    sys.stdout.flush()
    os._exit(0)  # do not run the learner's atexit hooks or thread joins


if __name__ == "__main__":
    main()
