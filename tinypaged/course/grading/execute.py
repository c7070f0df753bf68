"""Run one notebook in its own kernel, in a subprocess, with time limits; keep whatever it produced.

    python -m tinypaged.course.grading.execute IN.ipynb OUT.ipynb --cell-timeout 120

The subprocess starts a fresh Jupyter kernel (``python3``) with ``TINYPAGED_GRADING=1`` so the checks
emit records, runs the code cells in order and rewrites OUT after every cell. A cell that runs past
``--cell-timeout`` is interrupted and gets a ``CellTimeoutError`` output; the next cells still run.
If the kernel does not recover from the interrupt (or dies), the remaining cells are marked as not run.

:func:`run_notebook` is the caller's side: it also enforces a limit on the whole notebook by killing
the subprocess (and its kernel), and returns the notebook as far as it got.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
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


def execute(in_path: Path, out_path: Path, cell_timeout: int, cwd: Path) -> int:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    os.environ["TINYPAGED_GRADING"] = "1"
    nb = nbformat.read(str(in_path), as_version=4)
    client = NotebookClient(
        nb, timeout=cell_timeout, kernel_name="python3", allow_errors=True, interrupt_on_timeout=True,
        error_on_timeout={"ename": TIMEOUT, "evalue": f"the cell ran longer than {cell_timeout} s",
                          "traceback": [f"{TIMEOUT}: the cell ran longer than {cell_timeout} s"]},
        raise_on_iopub_timeout=True, iopub_timeout=15, record_timing=False,
        resources={"metadata": {"path": str(cwd)}},
    )
    def on_cell_executed(cell, execute_reply, **_):
        # A timed-out cell's reply is nbclient's stand-in (the kernel was interrupted): record it as an output.
        content = (execute_reply or {}).get("content", {})
        if content.get("ename") == TIMEOUT:
            cell.outputs.append(nbformat.from_dict(_error(TIMEOUT, content.get("evalue", ""))))

    client.on_cell_executed = on_cell_executed
    client.reset_execution_trackers()
    stopped = None
    with client.setup_kernel():
        pid = getattr(getattr(client.km, "provisioner", None), "pid", None)
        if pid:
            out_path.with_suffix(".kernel-pid").write_text(str(pid))
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            if stopped:
                cell.outputs = [nbformat.from_dict(_error(NOT_RUN, stopped))]
                continue
            try:
                client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
            except CellTimeoutError:
                cell.outputs.append(nbformat.from_dict(_error(TIMEOUT, f"the cell ran longer than {cell_timeout} s")))
                stopped = f"the kernel did not recover after cell {index} timed out"
            except DeadKernelError:
                cell.outputs.append(nbformat.from_dict(_error("DeadKernelError", "the kernel died")))
                stopped = f"the kernel died in cell {index}"
            _write(nb, out_path)
    _write(nb, out_path)
    return 0


def run_notebook(nb: dict, cell_timeout: int = 120, total_timeout: int = 900, cwd: Path | None = None) -> dict:
    """Execute ``nb`` in a fresh kernel in a subprocess; returns the executed notebook.

    Cells the subprocess never reached (the whole-notebook limit killed it) get a ``NotRun`` error.
    """
    cwd = Path(cwd or Path.cwd())
    with tempfile.TemporaryDirectory(prefix="tinypaged-grade-") as tmp:
        src, out = Path(tmp) / "in.ipynb", Path(tmp) / "out.ipynb"
        src.write_text(json.dumps(nb))
        # Run this file as a script: the runner itself needs nbclient, not tinypaged (and its torch import).
        cmd = [sys.executable, str(Path(__file__).resolve()), str(src), str(out), "--cell-timeout",
               str(cell_timeout), "--cwd", str(cwd)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
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
    args = ap.parse_args(argv)
    return execute(args.input, args.output, args.cell_timeout, args.cwd)


if __name__ == "__main__":
    sys.exit(main())
