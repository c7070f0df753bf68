"""Run one notebook in its own kernel, in a sandboxed subprocess, with limits; keep whatever it produced.

    python -m tinypaged.course.grading.execute IN.ipynb OUT.ipynb --cell-timeout 600 --cell-cpu 300

This run is the learner's *feedback* (the notebook they get back, with their outputs): no grade is taken
from it (see :mod:`~tinypaged.course.grading.verify`). The subprocess runs inside the sandbox
(:mod:`~tinypaged.course.grading.sandbox`), starts a fresh Jupyter kernel (``python3``), runs the code
cells in order and rewrites OUT after every cell. Before each cell the kernel gets a CPU-time budget of
``--cell-cpu`` seconds (a soft ``RLIMIT_CPU`` set from outside the kernel, so load never trips it); a cell
that gains no CPU for ``--cell-timeout`` seconds (a hang that uses no CPU, a SIGINT-proof wait) has its
kernel stopped and gets a ``CellTimeoutError`` output; so does a cell that runs longer than ``--cell-wall``
seconds (default: twice its CPU budget plus ``--cell-timeout``), so a slow drip of CPU cannot hold the run. If
the kernel dies or does not recover, the remaining cells are marked as not run, and the notebook's metadata says
which cell stopped it (``metadata.tinypaged.stopped``).

:func:`run_notebook` is the caller's side: the kernel imports the student edition of the notebook's stage (no
answers inside: :mod:`~tinypaged.course.grading.sandbox`), this file and the notebook travel through the
sandbox's ``/io`` folder, and it enforces a limit on the whole notebook by killing the sandbox (its cgroup);
it returns the notebook as far as it got.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

NOT_RUN = "NotRun"
TIMEOUT = "CellTimeoutError"


def _error(ename: str, evalue: str) -> dict:
    return {"output_type": "error", "ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]}


def _write(nb, path: Path) -> None:
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(nb))
    tmp.replace(path)


def _cpu_budget(pid: int | None, seconds: int) -> None:
    """Give the kernel ``seconds`` more CPU time from now (its soft RLIMIT_CPU; SIGXCPU past it)."""
    if not pid or seconds <= 0:
        return
    try:
        import psutil
        import resource

        t = psutil.Process(pid).cpu_times()
        soft, hard = resource.prlimit(pid, resource.RLIMIT_CPU)
        want = int(t.user + t.system + seconds) + 1
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        resource.prlimit(pid, resource.RLIMIT_CPU, (want, hard))
    except (OSError, ImportError, ValueError):
        pass
    except Exception:  # psutil.Error: the kernel is gone; the next cell reports it
        pass


def _kernel_cpu(pid: int) -> float:
    import psutil

    try:
        proc = psutil.Process(pid)
        return sum(t.user + t.system for t in (p.cpu_times() for p in [proc, *proc.children(recursive=True)]))
    except psutil.Error:
        return 0.0


class _IdleWatch(threading.Thread):
    """Kill the kernel when a cell gains less than 0.5 s of CPU in ``idle`` seconds (a hang that uses no CPU:
    ``time.sleep``, a lock, SIGINT ignored while waiting). A busy cell is never stopped by the clock: its CPU
    budget stops it, so load cannot fail a correct cell."""

    def __init__(self, pid: int, idle: float, wall: float = 0.0):
        super().__init__(daemon=True)
        self.pid, self.idle, self.fired, self.active = pid, idle, False, threading.Event()
        self.wall, self.walled = wall, False  # wall-clock seconds per cell (0: none); whether that stopped it
        self.done = threading.Event()

    def run(self):
        last_cpu, last_t = 0.0, time.monotonic()
        started = None
        while not self.done.wait(1.0):
            if not self.active.is_set():
                last_cpu, last_t = _kernel_cpu(self.pid), time.monotonic()
                started = None
                continue
            started = started or time.monotonic()
            cpu = _kernel_cpu(self.pid)
            over = self.wall > 0 and time.monotonic() - started > self.wall
            if cpu - last_cpu >= 0.5 and not over:
                last_cpu, last_t = cpu, time.monotonic()
            elif over or time.monotonic() - last_t > self.idle:
                self.fired, self.walled = True, over
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return


def execute(in_path: Path, out_path: Path, cell_timeout: int, cwd: Path, cell_cpu: int = 0,
            cell_wall: float | None = None) -> int:
    """``cell_timeout``: seconds a cell may go without using the CPU; ``cell_cpu``: CPU seconds per cell;
    ``cell_wall``: wall-clock seconds per cell (None: ``2 * cell_cpu + cell_timeout`` when ``cell_cpu`` is set)."""
    if cell_wall is None:
        cell_wall = 2 * cell_cpu + cell_timeout if cell_cpu else 0
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    os.environ.pop("TINYPAGED_GRADING", None)
    nb = nbformat.read(str(in_path), as_version=4)
    client = NotebookClient(nb, timeout=None, kernel_name="python3", allow_errors=True, record_timing=False,
                            resources={"metadata": {"path": str(cwd)}})
    client.reset_execution_trackers()
    stopped = None
    with client.setup_kernel():
        pid = getattr(getattr(client.km, "provisioner", None), "pid", None)
        if pid:
            out_path.with_suffix(".kernel-pid").write_text(str(pid))
        watch = _IdleWatch(pid, cell_timeout, cell_wall) if pid else None
        if watch:
            watch.start()
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            if stopped:
                cell.outputs = [nbformat.from_dict(_error(NOT_RUN, stopped))]
                continue
            _cpu_budget(pid, cell_cpu)
            if watch:
                watch.active.set()
            try:
                client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
            except DeadKernelError:
                if watch and watch.fired and watch.walled:
                    why = f"cell {index} ran past its wall-clock limit of {cell_wall:g} s and the kernel was stopped"
                    cell.outputs.append(nbformat.from_dict(_error(TIMEOUT, why)))
                elif watch and watch.fired:
                    why = f"cell {index} hung without using the CPU for {cell_timeout} s and the kernel was stopped"
                    cell.outputs.append(nbformat.from_dict(_error(TIMEOUT, why)))
                else:
                    why = (f"the kernel died in cell {index} (os._exit, a crash, the memory limit or its CPU-time "
                           f"budget of {cell_cpu} s)")
                    cell.outputs.append(nbformat.from_dict(_error("DeadKernelError", why)))
                stopped = why
            except Exception as e:  # nbclient gave up on the kernel some other way
                cell.outputs.append(nbformat.from_dict(_error(type(e).__name__, str(e)[:300])))
                stopped = f"the kernel stopped answering in cell {index}"
            finally:
                if watch:
                    watch.active.clear()
            if stopped:
                nb.metadata.setdefault("tinypaged", {})["stopped"] = {"cell": index, "why": stopped}
            _write(nb, out_path)
        if watch:
            watch.done.set()
    _write(nb, out_path)
    return 0


def run_notebook(nb: dict, make_sandbox, cell_timeout: int = 600, total_timeout: int = 1800,
                 cell_cpu: int = 300, stage: str | None = None) -> dict:
    """Execute ``nb`` in a fresh kernel in a sandboxed subprocess; returns the executed notebook.

    ``make_sandbox(scratch)`` gives the :class:`~tinypaged.course.grading.sandbox.Sandbox` (the kernel's
    working directory is its private tmpfs; ``scratch`` is seen as ``/io``); it imports the student edition of
    ``stage`` (default: the notebook's). Cells never reached (the whole-notebook limit) get a ``NotRun`` error.
    """
    from tinypaged.course.grading import notebook as nbk
    from tinypaged.course.grading.sandbox import edition_for_stage

    with tempfile.TemporaryDirectory(prefix="tinypaged-run-") as tmp:
        src, out = Path(tmp) / "in.ipynb", Path(tmp) / "out.ipynb"
        src.write_text(json.dumps(nb))
        runner = Path(tmp) / "execute.py"  # the runner itself needs nbclient, not tinypaged (and its torch import)
        runner.write_text(Path(__file__).read_text())
        box = make_sandbox(Path(tmp))
        stage = stage or nbk.stage_of(nb)
        if not box.unsafe:
            box.io = True
            if box.edition is None and stage is not None:
                box.edition = edition_for_stage(stage)
        with box:
            cmd = box.command([sys.executable, box.inside(runner), box.inside(src), box.inside(out),
                               "--cell-timeout", str(cell_timeout), "--cell-cpu", str(cell_cpu)]
                              + (["--cwd", str(tmp)] if box.unsafe else []))
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=tmp, env=box.popen_env())
            reason = None
            try:
                log, _ = proc.communicate(timeout=total_timeout)
                if proc.returncode != 0:
                    tail = log.decode(errors="replace")[-500:]
                    reason = f"the notebook runner failed (exit {proc.returncode}): {tail}"
            except subprocess.TimeoutExpired:
                reason = f"the notebook ran longer than {total_timeout} s and was stopped"
                _kill(proc, out.with_suffix(".kernel-pid"))
                proc.communicate()
        try:
            executed = json.loads(out.read_text()) if out.exists() else json.loads(src.read_text())
        except (OSError, ValueError):  # the sandbox wrote something else there
            executed = json.loads(src.read_text())
        if reason:
            executed.setdefault("metadata", {}).setdefault("tinypaged", {})["stopped"] = {"cell": None, "why": reason}
            for cell in executed["cells"]:
                if cell["cell_type"] == "code" and not cell.get("outputs") and cell.get("execution_count") is None:
                    cell["outputs"] = [_error(NOT_RUN, reason)]
        return executed


def _kill(proc: subprocess.Popen, pid_file: Path) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    # the kernel runs in its own session, inside the sandbox's PID namespace: the cgroup (``box.close()``) ends
    # it; without one, the namespace ends with the sandbox's first process (bubblewrap's --die-with-parent)
    time.sleep(0.1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", type=Path)
    ap.add_argument("output", type=Path)
    ap.add_argument("--cell-timeout", type=int, default=120)
    ap.add_argument("--cwd", type=Path, default=Path.cwd())
    ap.add_argument("--cell-wall", type=float, default=None,
                    help="wall-clock seconds per cell (default: 2 x --cell-cpu + --cell-timeout)")
    ap.add_argument("--cell-cpu", type=int, default=0, help="CPU seconds per cell (0: no budget)")
    args = ap.parse_args(argv)
    return execute(args.input, args.output, args.cell_timeout, args.cwd, args.cell_cpu, args.cell_wall)


if __name__ == "__main__":
    sys.exit(main())
