"""The grader's side of the checks' process: run :mod:`~tinypaged.course.grading.probe` in the sandbox,
start it again after whatever killed it, and return what it observed, validated as data.

The job goes to the probe on stdin; its events come back on its stdout, one JSON object per line, read here
with limits (``MAX_LINE``, ``MAX_EVENTS``) and validated strictly (:func:`_event`): a known cell or check call of
this job, steps of plain values (no NaN or infinity, no objects), a bounded size. Nothing else the sandbox says
is taken: no verdict, no "reuse", no claim that the checks finished (the process's exit and the events of each
step are what count), no findings. What the learner's code could write into the same stream can only claim
observations, which are judged like any other: forging one means computing the answer.

A probe that dies (``os._exit``, a crash, SIGXCPU at its CPU budget, the memory limit, a wall-clock limit, or
an idle hang the grader stops) costs only the step it died in: a learner cell that kills it leaves that cell and
the later ones out (as a kernel that dies there would); a check that kills it scores 0 for that check, with the
reason and the case's hint, and the next probe carries on with the following checks.

Limits: CPU time per step (a loaded machine slows a correct answer, it does not make it use more CPU); a hang
that uses no CPU (a probe that gains less than ``IDLE_CPU`` seconds of CPU in ``idle_s`` seconds) is stopped;
and wall-clock limits that a slow drip of CPU cannot extend: ``step_wall`` seconds per cell or check call and
``total_wall`` seconds for the whole submission (job keys; defaults from the CPU budgets, :func:`wall_limits`).
"""

from __future__ import annotations

import json
import math
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tinypaged.course.grading.sandbox import Sandbox, edition_for_stage

IDLE_CPU = 0.5
MAX_LINE = 16 << 20  # bytes of one event line
MAX_EVENTS = 64 << 20  # bytes of events read from one probe (the rest is drained and dropped)
MAX_DEPTH = 12  # nesting of an observed value
MAX_TEXT = 400  # characters of an error message kept


def _tree_cpu(pid: int) -> float:
    import psutil

    try:
        root = psutil.Process(pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return 0.0


def _signal_name(rc: int) -> str | None:
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else None
    try:
        return signal.Signals(sig).name if sig else None
    except ValueError:
        return None


def _cpu_budget_text(job: dict) -> str:
    """The CPU budget a killed check ran under, as the job set it: a check that serves a model gets the larger
    serving budget (``--serving-cpu-timeout``), so both are named when they differ."""
    from tinypaged.course.grading.probe import SERVING_CPU

    check = job.get("check_cpu", 300)
    serving = max(check, job.get("serving_cpu", SERVING_CPU))
    return f"{check} s of CPU" if serving == check else f"{check} s of CPU a check, {serving} s for a serving check"


def _why(rc: int, stderr: str, stopped: str | None, cpu_budget: str, own: bool = False) -> str:
    """Why a probe stopped, in the judge's words. ``own``: no learner code ran yet, so the last line of its
    stderr is the grader's own and is quoted (otherwise it is the learner's text and never shown)."""
    if stopped:
        return stopped
    sig = _signal_name(rc)
    tail = [line for line in stderr.strip().splitlines() if line.strip()][-1:] if stderr.strip() and own else []
    said = f" ({tail[0][:160]})" if tail else ""
    if sig == "SIGXCPU":
        return f"ran past its CPU-time budget ({cpu_budget})"
    if sig == "SIGKILL":
        return "was killed (its CPU-time budget or the sandbox's memory limit)" + said
    if sig in ("SIGABRT", "SIGSEGV", "SIGBUS"):
        return f"crashed the process ({sig}){said}: a store or load out of bounds?"
    if sig:
        return f"was ended by {sig}{said}"
    return f"ended the process (exit status {rc}, e.g. os._exit or sys.exit from a thread){said}"


# ---------------------------------------------------------------- the channel: data, validated

class _Invalid(ValueError):
    pass


def _reject_constant(name: str):
    raise _Invalid(f"{name} is not a value the grader accepts")


def _value(v, depth: int = 0):
    """An observed value as plain JSON data (NaN and infinity never get here: the parser refuses them)."""
    if depth > MAX_DEPTH:
        raise _Invalid("an observed value is nested too deeply")
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _Invalid("a non-finite number")
        return v
    if isinstance(v, list):
        return [_value(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {str(k): _value(x, depth + 1) for k, x in v.items()}
    raise _Invalid(f"an observed value of type {type(v).__name__}")


def _outcome(o) -> dict:
    """One case's observation: steps of [description, value], and ``todo``, ``error``, ``note`` if present."""
    if not isinstance(o, dict):
        raise _Invalid("an outcome is not an object")
    steps = o.get("steps", [])
    if not isinstance(steps, list):
        raise _Invalid("steps is not a list")
    out: dict = {"steps": []}
    for s in steps:
        if not (isinstance(s, list) and len(s) == 2 and isinstance(s[0], str)):
            raise _Invalid("a step is not [description, value]")
        out["steps"].append([s[0][:2000], _value(s[1])])
    if o.get("todo") is True:
        out["todo"] = True
    if isinstance(o.get("error"), str):
        out["error"] = o["error"][:MAX_TEXT]
    if isinstance(o.get("note"), str):
        from tinypaged.course.checks import MAX_NOTE

        out["note"] = o["note"][:MAX_NOTE]
    return out


def _event(line: bytes, job: dict) -> dict | None:
    """One event line, validated against the job (None: not an event of this job; dropped)."""
    try:
        e = json.loads(line, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(e, dict):
        return None
    calls = {c["key"]: c for c in job["calls"]}
    cells = {c["index"] for c in job["cells"]}
    try:
        if "cell" in e:
            if not (isinstance(e["cell"], int) and e["cell"] in cells):
                return None
            if e.get("done") is True:
                err = e.get("error")
                return {"cell": e["cell"], "done": True, "error": err[:MAX_TEXT] if isinstance(err, str) else None}
            for k in ("start", "skipped"):
                if e.get(k) is True:
                    return {"cell": e["cell"], k: True}
            return None
        if "call" in e:
            key = e["call"]
            if not (isinstance(key, str) and key in calls):
                return None
            if "record" in e:
                rec = e["record"]
                outcomes = rec.get("outcomes") if isinstance(rec, dict) else None
                if not isinstance(outcomes, list):
                    return None
                call = calls[key]  # what was checked comes from the job, never from the sandbox
                return {"call": key, "record": {"check": call["check"], "hidden": call["hidden"],
                                                "outcomes": [_outcome(o) for o in outcomes]}}
            if isinstance(e.get("case"), int) and not isinstance(e["case"], bool) \
                    and 0 <= e["case"] < max(1, len(calls[key].get("cases", []))):  # a number the judge can name
                return {"call": key, "case": e["case"]}
            for k in ("start", "skipped"):
                if e.get(k) is True:
                    return {"call": key, k: True}
            return None
        if e.get("finished") is True:
            return {"finished": True}
        if isinstance(e.get("probe_error"), str):  # its text may be the learner's: it goes to the grader's log
            print(f"tinypaged grading: the probe failed: {e['probe_error'][-2000:]}", file=sys.stderr)
            return {"probe_error": "see the grader's log"}
    except _Invalid as why:
        if "call" in e and isinstance(e.get("call"), str) and e["call"] in calls:
            call = calls[e["call"]]
            return {"call": e["call"], "record": {"check": call["check"], "hidden": call["hidden"], "outcomes": [
                {"steps": [], "error": f"the observed values are not plain data ({why})"}]}}
    return None


class _Reader(threading.Thread):
    """Reads a pipe to its end: lines up to the limits (``keep="lines"``), or only the tail (``keep="tail"``)."""

    def __init__(self, pipe, keep: str, on_line=None):
        super().__init__(daemon=True)
        self.pipe, self.keep, self.on_line = pipe, keep, on_line
        self.lines: list[bytes] = []
        self.tail = b""
        self.dropped = False

    def run(self):
        total = 0
        for line in iter(lambda: self.pipe.readline(MAX_LINE + 1), b""):
            if self.keep == "tail":
                self.tail = (self.tail + line)[-4000:]
                continue
            total += len(line)
            if len(line) > MAX_LINE or total > MAX_EVENTS or not line.endswith(b"\n"):
                self.dropped = True
                continue
            self.lines.append(line)
            if self.on_line is not None:
                self.on_line(line)


SUBMISSION_WALL = 900.0  # seconds: the ceiling on one submission's checks, whatever its budgets add up to


def wall_limits(job: dict) -> tuple[float, float]:
    """(per step, per submission) wall-clock seconds: ``step_wall`` / ``total_wall`` from the job, else from its
    CPU budgets; the submission's never above ``total_wall`` or :data:`SUBMISSION_WALL` (a slow drip of CPU in
    every step cannot hold a grader for hours), and no step longer than the submission."""
    from tinypaged.course.grading.probe import SERVING_CPU

    cpu = max(job.get("check_cpu", 300), job.get("cell_cpu", 120))
    serving = job.get("serving_cpu", SERVING_CPU)
    step = job.get("step_wall") or 2 * max(cpu, serving) + 60
    learner = sum(1 for c in job["cells"] if c.get("learner"))
    total = job.get("total_wall") or min(SUBMISSION_WALL, 2 * (job.get("cell_cpu", 120) * learner
                                                               + job.get("check_cpu", 300) * len(job["calls"]))
                                         + 2 * serving + 120)
    return float(min(step, total)), float(total)


def sandbox_job(job: dict) -> dict:
    """What the sandbox is told of a job: the module's cells, the limits and, per call, the part's name and the
    judge's cases as data (:mod:`~tinypaged.course.grading.wire`). No check name to look up, no seed (hidden or
    not), no expected value: the judge keeps those."""
    keep = ("cells", "cell_cpu", "check_cpu", "serving_cpu", "skip_calls", "skip_cells_from")
    out = {k: job[k] for k in keep if k in job}
    out["calls"] = [{"key": c["key"], "target": c["target"], "serving": bool(c.get("serving")),
                     "cases": c.get("cases", [])} for c in job["calls"]]
    return out


class _Feeder(threading.Thread):
    """The judge's side of the calls channel: the job's header first, then one call at a time, the next only once
    the probe reported the previous one's record (or that it skipped it), then the end of the stream. So a hidden
    case's inputs reach the sandbox only after every call before it, visible ones first, has its record here
    (the first record of a call is the one judged): nothing shown in feedback can carry them."""

    def __init__(self, calls: list[dict]):
        super().__init__(daemon=True)
        self.calls, self.sent = list(calls), None
        self.lines: "queue.Queue[bytes | None]" = queue.Queue()

    def start(self, pipe, header: dict) -> None:
        self.pipe = pipe
        self.lines.put(json.dumps(header).encode() + b"\n")
        super().start()

    def saw(self, line: bytes) -> None:
        """An event line from the probe (its reader thread): maybe the signal for the next call."""
        if b'"ready"' not in line and b'"record"' not in line and b'"skipped"' not in line:
            return
        try:
            e = json.loads(line)
        except ValueError:
            return
        if not isinstance(e, dict):
            return
        if (e.get("ready") is True and self.sent is None) or \
                (self.sent is not None and e.get("call") == self.sent and ("record" in e or e.get("skipped") is True)):
            self._next()

    def _next(self) -> None:
        if self.calls:
            call = self.calls.pop(0)
            self.sent = call["key"]
            self.lines.put(json.dumps(call).encode() + b"\n")
        else:
            self.sent = ""
            self.lines.put(None)  # no more calls: the probe finishes

    def run(self):
        try:
            while (line := self.lines.get()) is not None:
                self.pipe.write(line)
                self.pipe.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass
        finally:
            try:
                self.pipe.close()
            except (BrokenPipeError, OSError):
                pass

    def stop(self) -> None:
        self.lines.put(None)
        self.join(5)


def run_probe(job: dict, make_sandbox, idle_s: float = 120.0,
              deadline: float | None = None) -> tuple[list[dict], str | None]:
    """One probe run: its events, and why it stopped early (None if it finished)."""
    step_wall, _ = wall_limits(job)
    with tempfile.TemporaryDirectory(prefix="tinypaged-probe-") as tmp:
        box: Sandbox = make_sandbox(Path(tmp))
        if box.edition is None and not box.unsafe:  # the student edition of the job's stage: no answers inside
            box.edition = edition_for_stage(job["stage"])
        state = {"step_t": time.monotonic(), "finished": False}
        plan = sandbox_job(job)
        feeder = _Feeder([c for c in plan.pop("calls") if c["key"] not in set(job.get("skip_calls", []))])

        def on_line(line: bytes) -> None:  # any event is a step boundary for the wall clock
            state["step_t"] = time.monotonic()
            feeder.saw(line)

        with box:
            cmd = box.command([sys.executable, "-m", "tinypaged.course.grading.probe"])
            proc = subprocess.Popen(cmd, cwd=tmp, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=box.popen_env(), start_new_session=True)
            out, err = _Reader(proc.stdout, "lines", on_line), _Reader(proc.stderr, "tail")
            feeder.start(proc.stdin, plan)
            out.start()
            err.start()
            stopped, last_cpu, last_t = None, 0.0, time.monotonic()
            while proc.poll() is None:
                time.sleep(0.5)
                now = time.monotonic()
                cpu = _tree_cpu(proc.pid)
                if cpu - last_cpu >= IDLE_CPU:
                    last_cpu, last_t = cpu, now
                elif now - last_t > idle_s:
                    stopped = f"hung without using the CPU for {idle_s:g} s and was stopped"
                elif now - state["step_t"] > step_wall:
                    stopped = f"ran past its wall-clock limit of {step_wall:g} s (CPU used or not)"
                elif deadline is not None and now > deadline:
                    stopped = "ran past the submission's wall-clock limit and was stopped"
                if stopped:
                    _kill(proc)
            out.join(10)
            err.join(10)
            feeder.stop()
        events = [e for e in (_event(line, job) for line in out.lines) if e is not None]
        stderr = err.tail.decode(errors="replace")
        if proc.returncode == 0 and stopped is None and events and events[-1].get("finished") \
                and _complete(job, events):
            return events, None
        if any("probe_error" in e for e in events):
            return events, "the grader's probe failed: " + next(e["probe_error"] for e in events if "probe_error" in e)
        own = not any("cell" in e or "call" in e for e in events)  # no learner code had run
        return events, _why(proc.returncode, stderr, stopped, _cpu_budget_text(job), own)


def _complete(job: dict, events: list[dict]) -> bool:
    """Whether every cell and check call of the job has its closing event (a "finished" line alone proves
    nothing: the learner's code can write one and end the process)."""
    stop = job.get("skip_cells_from")
    cells = {e["cell"] for e in events if "cell" in e and (e.get("done") or e.get("skipped"))}
    calls = {e["call"] for e in events if "call" in e and ("record" in e or e.get("skipped"))}
    return all(c["index"] in cells for c in job["cells"] if stop is None or c["index"] < stop) and \
        all(c["key"] in calls for c in job["calls"] if c["key"] not in set(job.get("skip_calls", [])))


def _kill(proc: subprocess.Popen) -> None:
    import os

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def gather(job: dict, make_sandbox, idle_s: float = 120.0) -> dict:
    """Run the probe until every step ran or was given up: records per call key, cell results, kills."""
    job = dict(job, skip_calls=[], skip_cells_from=None)
    _, total_wall = wall_limits(job)
    deadline = time.monotonic() + total_wall
    records, cells, kills = {}, {}, []
    for attempt in range(len(job["calls"]) + 3):
        if time.monotonic() > deadline:
            kills.append({"why": f"used up the submission's wall-clock limit of {total_wall:g} s"})
            break
        events, stopped = run_probe(job, make_sandbox, idle_s, deadline)
        if attempt == 0 and not events:  # it never reached the learner's code: grading failed, not the learner
            raise RuntimeError(f"the checks' process did not start: it {stopped}")
        started_cell = started_call = case = None
        for e in events:
            if "cell" in e and e.get("start"):
                started_cell = e["cell"]
            if "cell" in e and e.get("done"):
                started_cell = None
                cells.setdefault(e["cell"], {"error": e.get("error"), "refused": []})
            if "call" in e and e.get("start"):
                started_call, case = e["call"], None
            if "call" in e and "case" in e:
                case = e["case"]
            if "call" in e and "record" in e:
                started_call = None
                records.setdefault(e["call"], e["record"])  # the first record of a call counts
        if stopped is None:
            break
        job["skip_calls"] = sorted(set(job["skip_calls"]) | set(records))
        if started_call is not None:
            kills.append({"call": started_call, "case": case, "why": stopped})
            job["skip_calls"] = job["skip_calls"] + [started_call]
        elif started_cell is not None:
            kills.append({"cell": started_cell, "why": stopped})
            job["skip_cells_from"] = started_cell
        else:
            kills.append({"why": stopped})
            break
    return {"records": records, "cells": cells, "kills": kills, "refused": [], "threads": []}
