"""Run one notebook in its own kernel, in a sandboxed subprocess, with limits; keep whatever it produced.

    python -m tinypaged.course.grading.execute IN.ipynb OUT.ipynb --cell-timeout 600 --cell-cpu 300
    python -m tinypaged.course.grading.execute - - < request.json > frames.jsonl    # the grader's channel

This run is the learner's *feedback* (the notebook they get back, with their outputs): no grade is taken from it
(see :mod:`~tinypaged.course.grading.verify`). The subprocess runs inside the sandbox
(:mod:`~tinypaged.course.grading.sandbox`), starts a fresh Jupyter kernel (``python3``), runs the code cells in
order and reports each cell as it finishes (a frame on the grader's pipe; OUT, when run by hand). Before each cell
the kernel gets a CPU-time budget of ``--cell-cpu`` seconds (a soft ``RLIMIT_CPU`` set from outside the kernel, so
load never trips it); a cell that gains no CPU for ``--cell-timeout`` seconds (a hang that uses no CPU, a
SIGINT-proof wait) has its kernel stopped and gets a ``CellTimeoutError`` output; so does a cell that runs longer
than ``--cell-wall`` seconds (default: twice its CPU budget plus ``--cell-timeout``), so a slow drip of CPU cannot
hold the run. If the kernel dies or does not recover, the remaining cells are marked as not run, and the notebook's
metadata says which cell stopped it (``metadata.tinypaged.stopped``).

:func:`run_notebook` is the caller's side: the kernel imports the student edition of the graded stage (no
answers inside: :mod:`~tinypaged.course.grading.sandbox`). **No host folder is writable**: this file is bound
read-only into the sandbox, the notebook goes in on the runner's stdin (with a random ``nonce``), and the runner
sends back one JSON frame per cell (its outputs and execution count, tagged with the nonce) on a pipe that was its
stdout, before it pointed its own stdout (which the kernel inherits) at stderr and made itself non-dumpable (so
the learner's kernel cannot reach that pipe through ``/proc``). The grader reads the frames with a byte cap
(:data:`MAX_FRAMES_BYTES`, :data:`MAX_FRAME_BYTES`), keeps only well-formed ones about cells of the notebook it
sent, enforces a limit on the whole notebook by killing the sandbox (its cgroup) and returns the notebook as far
as it got: a FIFO, a link or a flood written inside can neither hang nor grow the grader.
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
MAX_FRAMES_BYTES = 64 << 20  # bytes of frames read back from one feedback run; past it the run is stopped
MAX_FRAME_BYTES = 16 << 20  # bytes of one frame (one cell's outputs)
MAX_STDERR_BYTES = 8 << 10  # the tail of the runner's stderr kept for the reason
RUNNER = Path("/opt/tinypaged-runner/execute.py")  # where this file is bound (read-only) inside the sandbox
OUTPUT_TYPES = ("stream", "display_data", "execute_result", "error")


def _error(ename: str, evalue: str) -> dict:
    return {"output_type": "error", "ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]}


def _write(nb, path: Path) -> None:
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(nb))
    tmp.replace(path)


def _seal_channel():
    """The runner's side of the channel: a private duplicate of stdout for the frames (not inherited by the
    kernel: ``os.dup`` makes it close-on-exec), then stdout pointed at stderr and stdin at /dev/null (the kernel
    inherits those), and this process made non-dumpable (its ``/proc/PID/fd`` is then out of reach of the
    kernel, which runs as the same user). Returns the frames' binary stream."""
    chan = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass
    return chan


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


def execute(nb: dict, emit, cell_timeout: int, cwd: Path, cell_cpu: int = 0,
            cell_wall: float | None = None) -> dict:
    """Run ``nb``'s code cells in order in a fresh kernel; after each cell ``emit({"cell": index, "outputs": [...],
    "execution_count": n})``, and at the end ``emit({"stopped": ...})`` when something stopped the run; returns
    the executed notebook. ``cell_timeout``: seconds a cell may go without using the CPU; ``cell_cpu``: CPU seconds
    per cell; ``cell_wall``: wall-clock seconds per cell (None: ``2 * cell_cpu + cell_timeout`` when ``cell_cpu``
    is set)."""
    if cell_wall is None:
        cell_wall = 2 * cell_cpu + cell_timeout if cell_cpu else 0
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    os.environ.pop("TINYPAGED_GRADING", None)
    nb = nbformat.reads(json.dumps(nb), as_version=4)  # multi-line sources joined, as nbformat.read does
    client = NotebookClient(nb, timeout=None, kernel_name="python3", allow_errors=True, record_timing=False,
                            resources={"metadata": {"path": str(cwd)}})
    client.reset_execution_trackers()
    stopped = None
    with client.setup_kernel():
        pid = getattr(getattr(client.km, "provisioner", None), "pid", None)
        watch = _IdleWatch(pid, cell_timeout, cell_wall) if pid else None
        if watch:
            watch.start()
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            if stopped:
                cell.outputs = [nbformat.from_dict(_error(NOT_RUN, stopped))]
                emit({"cell": index, "outputs": cell.outputs, "execution_count": cell.get("execution_count")})
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
            emit({"cell": index, "outputs": cell.outputs, "execution_count": cell.get("execution_count")})
        if watch:
            watch.done.set()
    if nb.metadata.get("tinypaged", {}).get("stopped"):
        emit({"stopped": nb.metadata["tinypaged"]["stopped"]})
    emit({"finished": True})
    return nb


class _Frames(threading.Thread):
    """Read the runner's frames (one JSON object per line) with a byte cap; past :data:`MAX_FRAMES_BYTES` in all
    (or a line past :data:`MAX_FRAME_BYTES`) it stops keeping them, says so in :attr:`flood`, and drains the pipe
    so the runner can be killed rather than blocked."""

    def __init__(self, pipe, nonce: str):
        super().__init__(daemon=True)
        self.pipe, self.nonce, self.frames, self.flood, self.total = pipe, nonce, [], None, 0

    def run(self):
        while True:
            line = self.pipe.readline(MAX_FRAME_BYTES + 1)
            if not line:
                return
            self.total += len(line)
            if self.flood is None and (len(line) > MAX_FRAME_BYTES or self.total > MAX_FRAMES_BYTES):
                self.flood = (f"the feedback run sent back more than "
                              f"{(MAX_FRAME_BYTES if len(line) > MAX_FRAME_BYTES else MAX_FRAMES_BYTES) >> 20} MiB"
                              " and was stopped")
            if self.flood is not None:
                continue
            try:
                frame = json.loads(line)
            except ValueError:
                continue
            if isinstance(frame, dict) and frame.pop("nonce", None) == self.nonce:
                self.frames.append(frame)


class _Tail(threading.Thread):
    def __init__(self, pipe):
        super().__init__(daemon=True)
        self.pipe, self.tail = pipe, b""

    def run(self):
        while chunk := self.pipe.read(1 << 16):
            self.tail = (self.tail + chunk)[-MAX_STDERR_BYTES:]


def _clean_outputs(outputs) -> list[dict] | None:
    """A frame's outputs as the notebook keeps them: a list of output dicts of the four nbformat types (anything
    else is dropped); None when the frame holds no list."""
    if not isinstance(outputs, list):
        return None
    return [o for o in outputs if isinstance(o, dict) and o.get("output_type") in OUTPUT_TYPES]


def joined(nb: dict) -> dict:
    """A copy of ``nb`` with multi-line text as single strings (sources, streams, mime data), as
    ``nbformat.read`` gives it: what the kernel and nbconvert expect."""
    import nbformat
    from nbformat.v4.rwbase import rejoin_lines

    return json.loads(json.dumps(rejoin_lines(nbformat.from_dict(json.loads(json.dumps(nb))))))


def apply_frames(nb: dict, frames: list[dict]) -> dict:
    """The notebook ``nb`` (the one sent) with each frame's cell outputs put in: a frame counts only for a code
    cell of ``nb`` (by index) and only with well-formed outputs; the first frame per cell wins."""
    import copy

    out = copy.deepcopy(nb)
    seen = set()
    for f in frames:
        i = f.get("cell")
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(out["cells"]) and i not in seen \
                and out["cells"][i].get("cell_type") == "code":
            outputs = _clean_outputs(f.get("outputs"))
            if outputs is None:
                continue
            seen.add(i)
            count = f.get("execution_count")
            out["cells"][i]["outputs"] = outputs
            out["cells"][i]["execution_count"] = count if isinstance(count, int) and not isinstance(count, bool) \
                else None
        elif isinstance(f.get("stopped"), dict) and isinstance(f["stopped"].get("why"), str):
            cell = f["stopped"].get("cell")
            out.setdefault("metadata", {}).setdefault("tinypaged", {})["stopped"] = {
                "cell": cell if isinstance(cell, int) and not isinstance(cell, bool) else None,
                "why": f["stopped"]["why"][:500]}
    return out


def run_notebook(nb: dict, make_sandbox, cell_timeout: int = 600, total_timeout: int = 1800,
                 cell_cpu: int = 300, stage: str | None = None) -> dict:
    """Execute ``nb`` in a fresh kernel in a sandboxed subprocess; returns the executed notebook.

    ``make_sandbox(scratch)`` gives the :class:`~tinypaged.course.grading.sandbox.Sandbox` (the kernel's
    working directory is its private tmpfs; ``scratch`` is the grader's own and is never bound writable); it
    imports the student edition of ``stage`` (the stage being graded; default: the stage in ``nb``'s metadata,
    which callers set from the instructor's source). Every ``### BEGIN HIDDEN TESTS`` region is cut out first: the
    feedback kernel is the learner's, and a hidden test's seed in it could be printed into the feedback (the judge
    grades hidden cases itself, :mod:`~tinypaged.course.grading.verify`). The notebook goes in on stdin and comes back as frames (see
    the module docstring); ``total_timeout`` (wall seconds) stops the whole run, as does the box's submission
    budget. Cells never reached get a ``NotRun`` error, and ``metadata.tinypaged.stopped`` says why.
    """
    import secrets

    from tinypaged.course.grading import notebook as nbk
    from tinypaged.course.grading.sandbox import edition_for_stage

    nonce = secrets.token_hex(16)
    nb = nbk.without_hidden_tests(joined(nb))  # the kernel never holds a hidden test (the judge runs those)
    with tempfile.TemporaryDirectory(prefix="tinypaged-run-") as tmp:
        box = make_sandbox(Path(tmp))
        stage = stage or nbk.stage_of(nb)
        if box.unsafe:
            runner = Path(__file__).resolve()
        else:
            runner = RUNNER
            box.files = dict(box.files, **{str(RUNNER): Path(__file__).resolve()})
            if box.edition is None and stage is not None:
                box.edition = edition_for_stage(stage)
        request = json.dumps({"nonce": nonce, "notebook": nb}).encode()
        reason = None
        with box:
            cmd = box.command([sys.executable, str(runner), "-", "-", "--cell-timeout", str(cell_timeout),
                               "--cell-cpu", str(cell_cpu)] + (["--cwd", str(tmp)] if box.unsafe else []))
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, cwd=tmp, env=box.popen_env())
            frames, tail = _Frames(proc.stdout, nonce), _Tail(proc.stderr)
            frames.start()
            tail.start()

            def feed():
                try:
                    proc.stdin.write(request)
                    proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass

            threading.Thread(target=feed, daemon=True).start()
            deadline = time.monotonic() + total_timeout
            while proc.poll() is None:
                if frames.flood is not None:
                    reason = frames.flood
                elif time.monotonic() > deadline:
                    reason = f"the notebook ran longer than {total_timeout} s and was stopped"
                if reason:
                    _kill(proc)
                    break
                time.sleep(0.2)
            proc.wait()
            frames.join(10)
            tail.join(2)
            reason = reason or frames.flood
        budget = getattr(box, "budget", None)
        if reason is None and getattr(budget, "exceeded", None):
            reason = budget.exceeded
        finished = any(f.get("finished") for f in frames.frames)
        if reason is None and (proc.returncode != 0 or not finished):
            said = tail.tail.decode(errors="replace").strip().splitlines()[-1:] or [""]
            reason = f"the notebook runner failed (exit {proc.returncode}): {said[0][:300]}"
        executed = apply_frames(nb, frames.frames)
        if reason:
            executed.setdefault("metadata", {}).setdefault("tinypaged", {})["stopped"] = {"cell": None, "why": reason}
            for cell in executed["cells"]:
                if cell["cell_type"] == "code" and not cell.get("outputs") and cell.get("execution_count") is None:
                    cell["outputs"] = [_error(NOT_RUN, reason)]
        return executed


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    # the kernel runs in its own session, inside the sandbox's PID namespace: the cgroup (``box.close()``) ends
    # it; without one, the namespace ends with the sandbox's first process (bubblewrap's --die-with-parent)
    time.sleep(0.1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", help="the notebook, or - for the grader's request on stdin")
    ap.add_argument("output", help="the executed notebook, or - for frames on stdout")
    ap.add_argument("--cell-timeout", type=int, default=120)
    ap.add_argument("--cwd", type=Path, default=Path.cwd())
    ap.add_argument("--cell-wall", type=float, default=None,
                    help="wall-clock seconds per cell (default: 2 x --cell-cpu + --cell-timeout)")
    ap.add_argument("--cell-cpu", type=int, default=0, help="CPU seconds per cell (0: no budget)")
    args = ap.parse_args(argv)
    if args.input == "-":
        request = json.loads(sys.stdin.buffer.read())
        nonce, nb = request["nonce"], request["notebook"]
    else:
        nonce, nb = None, json.loads(Path(args.input).read_text())
    chan = _seal_channel() if args.output == "-" else None

    def emit(frame: dict) -> None:
        if chan is not None:
            chan.write(json.dumps(dict(frame, nonce=nonce)).encode() + b"\n")
            chan.flush()

    executed = execute(nb, emit, args.cell_timeout, args.cwd, args.cell_cpu, args.cell_wall)
    if chan is None:
        _write(executed, Path(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
