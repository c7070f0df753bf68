"""The checks' process: import a learner's code as a module and answer the judge's calls with data.

    python -m tinypaged.course.grading.probe < JOB.json > EVENTS

It runs inside the sandbox (:mod:`~tinypaged.course.grading.sandbox`) with the **student edition** of the
package (every graded part of every stage the class has not finished is a stub that calls the learner's
definitions; no reference implementation, no expected value is there), started fresh for every submission by
:mod:`~tinypaged.course.grading.evidence`. The job comes on stdin, which is then closed: the module's cells (the
instructor's given cells and the learner's code of the solution cells, in the source's order) and, per check
call of the test cells, the cases the *judge* drew (:mod:`~tinypaged.course.grading.wire`: the part's name and
each case's driver and inputs as data; no check name to look up, no seed, no expected value). The events go to
the probe's stdout, one JSON object per line, written before and after each step, so when the process dies
(``os._exit``, a crash in a Triton store out of bounds, SIGXCPU at the CPU-time limit, the memory limit) the
caller knows which step killed it and starts a new probe after that step. The learner's own ``print`` goes to
stderr.

This process only *records*: each case's steps (``checks.Trace``: plain data). The expected results and every
verdict are computed by the judge, in its own process, from the full package; it takes nothing else from here.
Whatever the learner's code does in this process (patching the checks, the decoder, the recorder) can only
change the observations of the cases it was sent, which is what writing an implementation does. Each learner
cell and each check call runs under its own CPU-time budget (``RLIMIT_CPU``, soft limit).
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


def run(job: dict, events: Events, calls_in=None) -> None:
    """The cells of ``job``, then each call read from ``calls_in`` (one JSON line each, sent by the judge once
    the previous call's record arrived) until it ends; ``job["calls"]`` instead when no channel is given."""
    from tinypaged.course import checks
    from tinypaged.course.grading import wire

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

    events(ready=True)  # the judge sends the first call now
    skip = set(job.get("skip_calls", []))
    for call in _calls(job, calls_in):
        key = call["key"]
        if key in skip:
            continue
        events(call=key, start=True)
        try:
            impl = _resolve(module, call["target"])
        except (KeyError, AttributeError):
            if stop_cells is not None:  # its cell never ran (an earlier probe died there): no observation
                events(call=key, skipped=True)
                continue
            events(call=key, record={"outcomes": [{"steps": [], "error": "NameError"}]})
            continue
        outcomes = []
        # a serving check loads and runs a model: it never gets less than SERVING_CPU seconds (or the job's own)
        serving = max(job.get("check_cpu", 300), job.get("serving_cpu", SERVING_CPU))
        _budget(serving if call.get("serving") else job.get("check_cpu", 300))
        for n, data in enumerate(call["cases"]):
            events(call=key, case=n)
            try:  # the judge's case, rebuilt from data around the checks' own code (grading.wire)
                case = checks.Case(data["label"], wire.case_function(data))
            except Exception as e:  # noqa: BLE001  (the learner's code may have broken the decoder)
                outcomes.append({"steps": [], "error": type(e).__name__})
                continue
            try:
                outcomes.append(checks.run_case(case, impl))
            except BaseException as e:  # noqa: BLE001  (SystemExit raised by the learner's code)
                outcomes.append({"steps": [], "error": f"{type(e).__name__}: {str(e)[:300]}"})
        try:
            events(call=key, record={"outcomes": outcomes})
        except ValueError:  # a step the learner's code made non-JSON (plain() keeps floats finite): no record
            events(call=key, record={"outcomes": [{"steps": [], "error": "the observed values are not plain data"}]})
    events(finished=True)


def _calls(job: dict, calls_in):
    if calls_in is None:
        yield from job.get("calls", [])
        return
    for line in iter(calls_in.readline, b""):
        yield json.loads(line)


def main(argv=None) -> int:
    os.environ["TINYPAGED_PROBE"] = "1"  # the serving checks print nothing here (see checks/serving.py)
    calls_in = os.fdopen(os.dup(0), "rb")  # the judge's channel: the job's header, then one call at a time
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the learner's code reads nothing from stdin
    job = json.loads(calls_in.readline())
    events = Events(os.dup(1))
    os.dup2(2, 1)  # the learner's prints go to stderr, not into the events
    sys.stdout = sys.stderr
    try:
        run(job, events, calls_in)
    except BaseException:  # noqa: BLE001
        events(probe_error=traceback.format_exc()[-2000:])
        raise
    events.f.close()
    sys.stderr.flush()
    os._exit(0)  # do not run the learner's atexit hooks or thread joins


if __name__ == "__main__":
    main()
