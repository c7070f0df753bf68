"""The checks' process: import a learner's code as a module and record what it does on every check's cases.

    python -m tinypaged.course.grading.probe < JOB.json > EVENTS

It runs inside the sandbox (:mod:`~tinypaged.course.grading.sandbox`) with the **student edition** of the
package (graded bodies are stubs that call the learner's definitions: no reference implementation, no expected
value, no check's answer is there to reuse), started fresh for every submission by
:mod:`~tinypaged.course.grading.evidence`. The job (the module's cells: the instructor's given cells and the
learner's code of the solution cells, in the source's order; the check calls of the test cells, hidden seeds
included: inputs, not answers) comes on stdin, which is then closed. The events go to the probe's stdout, one
JSON object per line, written before and after each step, so when the process dies (``os._exit``, a crash in a
Triton store out of bounds, SIGXCPU at the CPU-time limit, the memory limit) the caller knows which step killed
it and starts a new probe after that step. The learner's own ``print`` goes to stderr.

This process only *records*: each case's steps (``checks.Trace``: plain data). The expected results and
every verdict are computed by the grader, in its own process, from the full package; it takes nothing else
from here (a line the learner's code writes to the same stream can only claim an observation, which is
compared like any other). Each learner cell and each check call runs under its own CPU-time budget
(``RLIMIT_CPU``, soft limit).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
import types
from pathlib import Path

SERVING_CPU = 300  # CPU seconds a serving check may use, whatever the per-check budget
MODULE = "submission"  # the learner's module (the serving check refuses plug-ins from anywhere else)


class Events:
    """JSON lines on a private copy of stdout (fd 1 itself then points at stderr, for the learner's prints)."""

    def __init__(self, fd: int):
        self.f = os.fdopen(fd, "w", buffering=1)

    def __call__(self, **event) -> None:
        self.f.write(json.dumps(event, allow_nan=False) + "\n")
        self.f.flush()


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

    checks._load_all()
    cells_dir = Path.cwd() / "cells"
    cells_dir.mkdir(exist_ok=True)
    files = {}
    for cell in job["cells"]:
        path = cells_dir / f"cell_{cell['index']:03d}_{'learner' if cell['learner'] else 'given'}.py"
        path.write_text(cell["source"])
        files[cell["index"]] = str(path)

    module = types.ModuleType(MODULE)
    module.__file__ = str(cells_dir / "__init__.py")
    sys.modules[MODULE] = module
    # the student edition's stubs call the learner's definitions in ``__main__`` (tinypaged.course.handin)
    sys.modules["__main__"] = module
    stop_cells = job.get("skip_cells_from")
    for cell in job["cells"]:
        i = cell["index"]
        if stop_cells is not None and i >= stop_cells:
            events(cell=i, skipped=True)
            continue
        events(cell=i, start=True)
        _budget(job.get("cell_cpu", 120))
        try:
            exec(compile(cell["source"], files[i], "exec"), module.__dict__)
            error = None
        except BaseException as e:  # noqa: BLE001  (SystemExit and KeyboardInterrupt are the learner's too)
            error = f"{type(e).__name__}: {str(e)[:300]}"
        events(cell=i, done=True, error=error)

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
            events(call=key, record={"outcomes": [{"steps": [], "error": f"NameError: {call['target']} is not "
                                                   "defined (did its cell fail?)"}]})
            continue
        outcomes = []
        # a serving check loads and runs a model: it never gets less than SERVING_CPU seconds (or the job's own)
        serving = max(job.get("check_cpu", 300), job.get("serving_cpu", SERVING_CPU))
        _budget(serving if c.expected is not None else job.get("check_cpu", 300))
        try:  # a check's cases may use another part of the stage to set up (in the edition: the learner's)
            cases = c.cases(call["hidden"])
        except BaseException as e:  # noqa: BLE001
            todo = checks._mentions_not_implemented(e)
            events(call=key, record={"outcomes": [{"steps": [], "todo": True} if todo else
                                                  {"steps": [], "error": f"{type(e).__name__}: {str(e)[:300]}"}]})
            continue
        for n, case in enumerate(cases):
            events(call=key, case=n)
            try:
                outcomes.append(checks.run_case(case, impl))
            except BaseException as e:  # noqa: BLE001  (SystemExit raised by the learner's code)
                outcomes.append({"steps": [], "error": f"{type(e).__name__}: {str(e)[:300]}"})
        try:
            events(call=key, record={"outcomes": outcomes})
        except ValueError:  # a step the learner's code made non-JSON (plain() keeps floats finite): no record
            events(call=key, record={"outcomes": [{"steps": [], "error": "the observed values are not plain data"}]})
    events(finished=True)


def main(argv=None) -> int:
    os.environ["TINYPAGED_PROBE"] = "1"  # the serving checks print nothing here (see checks/serving.py)
    job = json.loads(sys.stdin.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the job is read: nothing more comes in
    events = Events(os.dup(1))
    os.dup2(2, 1)  # the learner's prints go to stderr, not into the events
    sys.stdout = sys.stderr
    try:
        run(job, events)
    except BaseException:  # noqa: BLE001
        events(probe_error=traceback.format_exc()[-2000:])
        raise
    events.f.close()
    sys.stderr.flush()
    os._exit(0)  # do not run the learner's atexit hooks or thread joins


if __name__ == "__main__":
    main()
