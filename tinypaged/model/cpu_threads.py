"""How many torch threads a CPU engine runs, and on which cores: vLLM's CPU backend's choice, made explicit.

torch's intra-op threads (OpenMP) meet at the end of every parallel region. A decode step of a small model is about
a thousand short regions, so when one of the threads loses its core to another process (a browser, JupyterLab, a
second engine) every region waits for it: on the project's 2-core machine, with one core kept busy, the engine ran
26.5 tok/s on one thread and 5.5 on two. vLLM's CPU backend therefore binds one OpenMP thread per core it is given
(``VLLM_CPU_OMP_THREADS_BIND``: ``auto``, a list such as ``0-3`` or ``0,2``, or ``nobind``) and keeps cores for the
front end (``VLLM_CPU_NUM_OF_RESERVED_CPU``). tinypaged reads the same two settings under its own prefix:

* ``TINYPAGED_CPU_OMP_THREADS_BIND``: ``auto`` (the default, unless ``OMP_NUM_THREADS`` is set: then ``nobind``),
  a core list (``0-1``, ``0,2``) or ``nobind`` (torch's
  own thread count, no affinity change: what tinypaged did before);
* ``TINYPAGED_CPU_NUM_OF_RESERVED_CPU``: cores ``auto`` leaves for the front end (default: 1 where the process may
  use more than 2 cores, else 0, so a 2-core laptop computes on both when they are free).

``auto`` takes the cores this process may use, drops the reserved ones, and then drops cores another process keeps
busy right now (sampled from ``/proc/stat`` over ``sample_s``, 0.1 s): on a quiet 2-core machine it binds 2 threads
to cores 0-1; with one core busy it binds 1 thread to the free one. The choice is made once, when it is applied
(``apply_cpu_threads``); a load that changes later is not followed (vLLM does not either). The offline ``LLM`` and
the engine-core process apply it once per process (``ensure_cpu_threads``), as vLLM's CPU worker binds itself at
start-up; a plan applied by hand (the benchmarks) is kept.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

BIND_ENV = "TINYPAGED_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "TINYPAGED_CPU_NUM_OF_RESERVED_CPU"


@dataclass(frozen=True)
class CPUThreads:
    threads: int  # torch.set_num_threads
    cores: tuple[int, ...] | None  # os.sched_setaffinity; None: leave the affinity as it is
    why: str  # one line for logs and benchmark reports

    def describe(self) -> str:
        where = "unbound" if self.cores is None else f"bound to core(s) {format_cores(self.cores)}"
        return f"{self.threads} torch thread(s), {where} ({self.why})"


def parse_cores(text: str, knob: str = BIND_ENV) -> tuple[int, ...]:
    """``"0-3"``, ``"0,2"``, ``"0-1,4"`` -> sorted core ids; a clear error naming ``knob`` otherwise."""
    cores = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            lo_i, hi_i = int(lo), int(hi or lo)
            if lo_i < 0 or hi_i < lo_i:
                raise ValueError
            cores.update(range(lo_i, hi_i + 1))
    except ValueError:
        raise ValueError(f"{knob}={text!r}: use 'auto', 'nobind' or a core list such as '0-1' or '0,2'") from None
    return tuple(sorted(cores))


def format_cores(cores) -> str:
    return ",".join(map(str, cores))


def allowed_cores() -> list[int]:
    """The cores this process may run on (its affinity on Linux; every core elsewhere)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def busy_cores(sample_s: float = 0.1, threshold: float = 0.5) -> set[int]:
    """Cores whose time over ``sample_s`` was more than ``threshold`` busy (Linux's /proc/stat; empty elsewhere).
    Call it while this process is idle: its own work counts too."""
    def read():
        out = {}
        try:
            with open("/proc/stat") as f:
                for line in f:
                    if line.startswith("cpu") and line[3].isdigit():
                        name, *vals = line.split()
                        vals = [int(v) for v in vals]
                        out[int(name[3:])] = (sum(vals), vals[3] + vals[4])  # total, idle + iowait
        except (OSError, ValueError, IndexError):
            return {}
        return out

    before = read()
    if not before:
        return set()
    time.sleep(sample_s)
    after = read()
    busy = set()
    for core, (total, idle) in after.items():
        if core in before:
            dt, di = total - before[core][0], idle - before[core][1]
            if dt > 0 and 1 - di / dt > threshold:
                busy.add(core)
    return busy


def plan_cpu_threads(bind: str | None = None, reserved: int | None = None, allowed=None, busy=None,
                     sample_s: float = 0.1) -> CPUThreads:
    """The thread count and cores for this process. ``bind``/``reserved`` default to the environment variables
    above; ``allowed`` (the cores this process may use) and ``busy`` (cores another process keeps busy) are
    measured unless given (tests give them)."""
    if bind is None and BIND_ENV not in os.environ and "OMP_NUM_THREADS" in os.environ:
        bind = "nobind"  # an explicit OMP_NUM_THREADS (the test suite's 1) is the user's choice: kept as it is
    bind = (bind if bind is not None else os.environ.get(BIND_ENV, "auto")).strip()
    allowed = sorted(allowed if allowed is not None else allowed_cores())
    if bind == "nobind":
        return CPUThreads(torch.get_num_threads(), None, f"{BIND_ENV}=nobind")
    if bind != "auto":
        cores = parse_cores(bind)
        outside = [c for c in cores if c not in allowed]
        if outside:
            raise ValueError(f"{BIND_ENV}={bind!r} names core(s) {format_cores(outside)}, but this process may "
                             f"only use {format_cores(allowed)}")
        return CPUThreads(len(cores), cores, f"{BIND_ENV}={bind}")
    if reserved is None:
        text = os.environ.get(RESERVED_ENV)
        if text is None:
            reserved = 1 if len(allowed) > 2 else 0
        else:
            try:
                reserved = int(text)
                if reserved < 0:
                    raise ValueError
            except ValueError:
                raise ValueError(f"{RESERVED_ENV}={text!r}: use an integer >= 0") from None
    if reserved >= len(allowed):
        raise ValueError(f"{RESERVED_ENV}={reserved} reserves every core this process may use "
                         f"({format_cores(allowed)}): lower it")
    cores = allowed[:len(allowed) - reserved] if reserved else allowed  # the front end keeps the last ones
    busy = busy if busy is not None else busy_cores(sample_s)
    free = [c for c in cores if c not in busy]
    why = f"auto: {len(allowed)} core(s) allowed, {reserved} reserved"
    if len(free) < len(cores):
        why += f", core(s) {format_cores(sorted(set(cores) - set(free)))} busy now"
    if not free:  # everything is busy: one thread, where the kernel puts it, still beats several that wait
        return CPUThreads(1, tuple(cores), why + ": 1 thread")
    return CPUThreads(len(free), tuple(free), why)


def apply_cpu_threads(plan: CPUThreads | None = None) -> CPUThreads:
    """Set torch's thread count and this process's affinity as ``plan`` (default: ``plan_cpu_threads()``) says."""
    global _APPLIED
    plan = plan or plan_cpu_threads()
    if plan.cores is not None and hasattr(os, "sched_setaffinity"):  # Linux; elsewhere the thread count only
        os.sched_setaffinity(0, set(plan.cores))
    torch.set_num_threads(plan.threads)
    _APPLIED = plan
    return plan


_APPLIED: CPUThreads | None = None  # the plan this process runs under, once one was applied


def ensure_cpu_threads() -> tuple[CPUThreads, bool]:
    """(the plan this process runs under, whether this call applied it): ``apply_cpu_threads()`` the first time,
    the same plan afterwards (a second engine in the process, or a plan applied by hand, is not re-planned)."""
    if _APPLIED is not None:
        return _APPLIED, False
    return apply_cpu_threads(), True


BURNER = "import os, time\nos.sched_setaffinity(0, {{{core}}})\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextmanager
def busy_neighbour(core: int, seconds: float):
    """A process that keeps ``core`` busy (a spinning loop pinned there, the "other program" of a learner's laptop)
    for at most ``seconds``, and is killed when the block ends: bounded either way, never an orphan. Yields it."""
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("busy_neighbour pins a process to a core, which needs Linux (os.sched_setaffinity)")
    if core not in allowed_cores():
        raise ValueError(f"busy_neighbour: core {core} is not one this process may use ({format_cores(allowed_cores())})")
    if not 0 < seconds <= 24 * 3600:
        raise ValueError(f"busy_neighbour: seconds={seconds!r} must be > 0 and at most a day (it bounds the burner)")
    proc = subprocess.Popen([sys.executable, "-c", BURNER.format(core=int(core), seconds=float(seconds))],
                            stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
