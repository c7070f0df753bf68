"""The grader's side of the checks' process: run :mod:`~tinypaged.course.grading.probe` in the sandbox,
start it again after whatever killed it, and return what it observed.

A probe that dies (``os._exit``, a crash, SIGXCPU at its CPU budget, the memory limit, or an idle hang
the grader stops) costs only the step it died in: a learner cell that kills it leaves that cell and the
later ones out (as a kernel that dies there would); a check that kills it scores 0 for that check, with
the reason and the case's hint, and the next probe carries on with the following checks.

Limits are CPU time (a loaded machine slows a correct answer, it does not make it use more CPU). The
only wall-clock rule catches a hang that uses no CPU at all (``time.sleep``, waiting on a lock): a probe
that gains less than ``IDLE_CPU`` seconds of CPU in ``idle_s`` seconds is stopped.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tinypaged.course.grading.sandbox import Sandbox

IDLE_CPU = 0.5


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


def _why(rc: int, stderr: str, stopped: str | None, cpu_budget: int) -> str:
    if stopped:
        return stopped
    sig = _signal_name(rc)
    tail = [line for line in stderr.strip().splitlines() if line.strip()][-1:] if stderr.strip() else []
    said = f" ({tail[0][:160]})" if tail else ""
    if sig == "SIGXCPU":
        return f"ran past its CPU-time budget ({cpu_budget} s of CPU)"
    if sig == "SIGKILL":
        return "was killed (its CPU-time budget or the sandbox's memory limit)" + said
    if sig in ("SIGABRT", "SIGSEGV", "SIGBUS"):
        return f"crashed the process ({sig}){said}: a store or load out of bounds?"
    if sig:
        return f"was ended by {sig}{said}"
    return f"ended the process (exit status {rc}, e.g. os._exit or sys.exit from a thread){said}"


def _events(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(e, dict):
                out.append(e)
    return out


def run_probe(job: dict, make_sandbox, idle_s: float = 120.0) -> tuple[list[dict], str | None]:
    """One probe run: its events, and why it stopped early (None if it finished)."""
    with tempfile.TemporaryDirectory(prefix="tinypaged-probe-") as tmp:
        scratch = Path(tmp)
        (scratch / "job.json").write_text(json.dumps(job))
        box: Sandbox = make_sandbox(scratch)
        cmd = box.command([sys.executable, "-m", "tinypaged.course.grading.probe", str(scratch / "job.json"),
                           str(scratch / "events.jsonl")])
        err = open(scratch / "stderr.txt", "w+")
        proc = subprocess.Popen(cmd, cwd=scratch, stdout=subprocess.DEVNULL, stderr=err, env=box.popen_env(),
                                start_new_session=True)
        stopped, last_cpu, last_t = None, 0.0, time.monotonic()
        while proc.poll() is None:
            time.sleep(1.0)
            cpu = _tree_cpu(proc.pid)
            if cpu - last_cpu >= IDLE_CPU:
                last_cpu, last_t = cpu, time.monotonic()
            elif time.monotonic() - last_t > idle_s:
                stopped = f"hung without using the CPU for {idle_s:g} s and was stopped"
                _kill(proc)
        err.seek(0)
        stderr = err.read()[-4000:]
        err.close()
        events = _events(scratch / "events.jsonl")
        if any(e.get("finished") for e in events):
            return events, None
        if any("probe_error" in e for e in events):
            return events, "the grader's probe failed: " + next(e["probe_error"] for e in events if "probe_error" in e)
        return events, _why(proc.returncode, stderr, stopped, job.get("check_cpu", 300))


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
    records, cells, kills, refused, threads = {}, {}, [], [], []
    for attempt in range(len(job["calls"]) + 3):
        events, stopped = run_probe(job, make_sandbox, idle_s)
        if attempt == 0 and not events:  # it never reached the learner's code: grading failed, not the learner
            raise RuntimeError(f"the checks' process did not start: it {stopped}")
        started_cell = started_call = case = None
        for e in events:
            if "cell" in e and e.get("start"):
                started_cell = e["cell"]
            if "cell" in e and e.get("done"):
                started_cell = None
                cells.setdefault(e["cell"], {"error": e.get("error"), "refused": e.get("refused", [])})
                refused += [f"cell {e['cell']}: {r}" for r in e.get("refused", [])]
            if "call" in e and e.get("start"):
                started_call, case = e["call"], None
            if "call" in e and "case" in e:
                case = e["case"]
            if "call" in e and "record" in e:
                started_call = None
                records[e["call"]] = e["record"]
                refused += [f"{e['call']}: {r}" for r in e.get("refused", [])]
                threads += [f"{e['call']}: {t}" for t in e.get("threads", [])]
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
    return {"records": records, "cells": cells, "kills": kills, "refused": sorted(set(refused)),
            "threads": sorted(set(threads))}
