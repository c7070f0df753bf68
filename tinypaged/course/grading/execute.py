"""Run one notebook in its own kernel, in a sandboxed subprocess, with limits; keep whatever it produced.

    python -m tinypaged.course.grading.execute IN.ipynb OUT.ipynb --cell-timeout 600 --cell-cpu 300

This run is the learner's *feedback* (the notebook they get back, with their outputs): no grade is taken
from it (see :mod:`~tinypaged.course.grading.verify`). The subprocess runs inside the sandbox
(:mod:`~tinypaged.course.grading.sandbox`), starts a fresh Jupyter kernel (``python3``), runs the code
cells in order and rewrites OUT after every cell. Before each cell the kernel gets a CPU-time budget of
``--cell-cpu`` seconds (a soft ``RLIMIT_CPU`` set from outside the kernel, so load never trips it); a cell
that gains no CPU for ``--cell-timeout`` seconds (a hang that uses no CPU, a SIGINT-proof wait) has its
kernel stopped and gets a ``CellTimeoutError`` output. No wall-clock limit applies to a busy cell. If the kernel dies or does not recover, the remaining cells are marked as
not run, and the notebook's metadata says which cell stopped it (``metadata.tinypaged.stopped``).

:func:`run_notebook` is the caller's side: it also enforces a limit on the whole notebook by killing
the sandbox, and returns the notebook as far as it got.
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

    def __init__(self, pid: int, idle: float):
        super().__init__(daemon=True)
        self.pid, self.idle, self.fired, self.active = pid, idle, False, threading.Event()
        self.done = threading.Event()

    def run(self):
        last_cpu, last_t = 0.0, time.monotonic()
        while not self.done.wait(1.0):
            if not self.active.is_set():
                last_cpu, last_t = _kernel_cpu(self.pid), time.monotonic()
                continue
            cpu = _kernel_cpu(self.pid)
            if cpu - last_cpu >= 0.5:
                last_cpu, last_t = cpu, time.monotonic()
            elif time.monotonic() - last_t > self.idle:
                self.fired = True
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return


def execute(in_path: Path, out_path: Path, cell_timeout: int, cwd: Path, cell_cpu: int = 0) -> int:
    """``cell_timeout``: seconds a cell may go without using the CPU; ``cell_cpu``: CPU seconds per cell."""
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
        watch = _IdleWatch(pid, cell_timeout) if pid else None
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
                if watch and watch.fired:
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
                 cell_cpu: int = 300) -> dict:
    """Execute ``nb`` in a fresh kernel in a sandboxed subprocess; returns the executed notebook.

    ``make_sandbox(scratch)`` gives the :class:`~tinypaged.course.grading.sandbox.Sandbox` (the kernel's
    working directory is its scratch). Cells never reached (the whole-notebook limit) get a ``NotRun`` error.
    """
    with tempfile.TemporaryDirectory(prefix="tinypaged-run-") as tmp:
        src, out = Path(tmp) / "in.ipynb", Path(tmp) / "out.ipynb"
        src.write_text(json.dumps(nb))
        box = make_sandbox(Path(tmp))
        # Run this file as a script: the runner itself needs nbclient, not tinypaged (and its torch import).
        cmd = box.command([sys.executable, str(Path(__file__).resolve()), str(src), str(out), "--cell-timeout",
                           str(cell_timeout), "--cwd", str(tmp), "--cell-cpu", str(cell_cpu)])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=tmp, env=box.popen_env())
        reason = None
        try:
            log, _ = proc.communicate(timeout=total_timeout)
            if proc.returncode != 0:
                reason = f"the notebook runner failed (exit {proc.returncode}): {log.decode(errors='replace')[-500:]}"
        except subprocess.TimeoutExpired:
            reason = f"the notebook ran longer than {total_timeout} s and was stopped"
            _kill(proc, out.with_suffix(".kernel-pid"))
            proc.communicate()
        executed = json.loads(out.read_text()) if out.exists() else json.loads(src.read_text())
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
    if pid_file.exists():  # the kernel runs in its own session
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    time.sleep(0.1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", type=Path)
    ap.add_argument("output", type=Path)
    ap.add_argument("--cell-timeout", type=int, default=120)
    ap.add_argument("--cwd", type=Path, default=Path.cwd())
    ap.add_argument("--cell-cpu", type=int, default=0, help="CPU seconds per cell (0: no budget)")
    args = ap.parse_args(argv)
    return execute(args.input, args.output, args.cell_timeout, args.cwd, args.cell_cpu)


if __name__ == "__main__":
    sys.exit(main())
