"""Run untrusted code (a learner's notebook, the checks on a learner's module) under bubblewrap.

What a sandboxed command can read is listed, not filtered: its root is empty and only these are bound in,
read-only:

* the system's programs and libraries (``/usr`` and its links, a few files of ``/etc``: never ``/etc/shadow``);
* the Python installation and the environment's ``site-packages``, with the editable install's path hook of
  tinypaged masked (its finder and ``.pth`` files read as empty), so the repository's package is not found;
* the grader's **student edition** of the stage being graded (:mod:`tinypaged.course.student_edition`, built once
  per stage and source tree and cached under the grader's cache, :func:`edition_for`): every graded part of that
  stage and of every later one is a stub that calls the learner's code, the references the checks name raise, and
  it holds no expected values (``expected_visible.json`` is left out);
* the converted model the serving checks load (a world-readable view of it when the cache keeps it private);
* the GPU's device nodes, when there are any.

Not the repository, ``solutions/``, the course folder, other submissions, ``/root``, or the host's ``/tmp``.
The interpreter is bound where it really lives and where ``sys.prefix`` spells it (a ``.venv`` that is a symbolic
link works, :func:`_python_aliases`), with what the environment's own links point at (:func:`_python_paths`);
:func:`interpreter_problem` says in one line when it still cannot start inside.

Writable: only size-limited tmpfs mounts, each of ``scratch_mb`` MiB: the working directory (``$HOME``,
``$TMPDIR``), ``/tmp`` and ``/dev/shm``. No host folder is ever writable inside: ``files`` binds single files
read-only (the feedback runner), and ``io`` (tests, tools) binds the grader's scratch folder **read-only** at
``/io``. What a sandbox hands back travels over pipes the grader reads with a byte cap (the checks' events, the
feedback run's cells); a file a grader must read from a learner goes through
:func:`tinypaged.course.grading.notebook.read_capped` (no link followed, regular files only, a size cap).

Limits: each submission's sandbox runs in its own cgroup (v1 ``memory`` and ``pids``, or v2) with
``memory_bytes`` and ``processes`` for the submission as a whole (and ``cpuacct``, which a
:class:`SubmissionBudget` polls: CPU seconds and a wall-clock ceiling for every sandbox of one submission
together, the groups killed when either is spent; :func:`cgroups_available`; where cgroups
are not writable the per-process ``prlimit`` limits below remain, with a one-line note on stderr); every
process also gets ``prlimit`` limits: address space, CPU seconds (a CPU-time limit, so a loaded machine never
turns a correct answer into a timeout), processes, and a file size (``RLIMIT_FSIZE``). No network
(``--unshare-net``), its own PID and IPC namespaces, killed with the grader (``--die-with-parent``), every
capability dropped (``--cap-drop ALL``); when the grader runs as root the command runs as ``nobody``
(``setpriv``, empty bounding set), so a root-only file is unreadable even where a mount shows it.

Without ``bwrap`` the grader refuses (:class:`SandboxUnavailable`) unless told ``unsafe=True``
(``--unsafe-no-sandbox``): the command then runs with the same limits but sees everything.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tinypaged import cpu_native

NOBODY = 65534
EDITION = Path("/opt/tinypaged")  # where the student edition is seen inside (on PYTHONPATH)
WORK = Path("/scratch")  # the private tmpfs inside: working directory, HOME, TMPDIR
IO = Path("/io")  # the grader's scratch folder, bound read-only when ``io`` is set (never writable)
CGROUP_ROOT = Path(os.environ.get("TINYPAGED_CGROUP_ROOT", "/sys/fs/cgroup"))
CGROUP_PARENT = "tinypaged"
ETC = ("passwd", "group", "nsswitch.conf", "hosts", "host.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
       "localtime", "mime.types", "ssl", "ca-certificates", "alternatives", "fonts")
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
UNSAFE_WARNING = ("WARNING: grading WITHOUT a sandbox (--unsafe-no-sandbox): a submission can read the answers, "
                  "write the package and the gradebook, and reach the network. Use it only on work you trust.")


class SandboxUnavailable(RuntimeError):
    pass


def bwrap() -> str | None:
    """The bubblewrap binary on PATH (None: no sandbox here)."""
    return shutil.which("bwrap")


# ---------------------------------------------------------------- what is bound in

def _link_targets(env: Path) -> list[Path]:
    """The installations the environment's own symbolic links lead to (``bin/python`` -> a base interpreter
    elsewhere, ``lib64`` ...), read one level deep in ``env`` and ``env/bin``: a target ``X/bin/tool`` brings
    ``X``, any other target itself."""
    out = []
    for folder in (env, env / "bin"):
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            if not entry.is_symlink():
                continue
            try:
                real = entry.resolve(strict=True)
            except (OSError, RuntimeError):
                continue
            out.append(real.parent.parent if real.parent.name == "bin" else real if real.is_dir() else real.parent)
    return out


def _python_paths() -> list[Path]:
    """The folders the interpreter needs inside, at their real paths, outermost first, none inside another: the
    base installation, the environment (the venv) and what their own links point at (:func:`_link_targets`)."""
    real = [p.resolve() for p in (Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable).parent.parent)
            if p.exists()]
    real += [q for p in list(real) for q in _link_targets(p)]
    found = sorted(set(real), key=lambda p: len(p.parts))
    return [p for i, p in enumerate(found) if not any(q == p or q in p.parents for q in found[:i])]


def _python_aliases() -> list[tuple[Path, Path]]:
    """``(real folder, spelling)`` for each spelling of the interpreter the grader uses (``sys.prefix``, the
    environment holding ``sys.executable``) that goes through a symbolic link (a ``.venv`` that is a link): the
    same folder is bound there too, so the command line's ``sys.executable`` starts inside as it does outside."""
    out = []
    for p in (Path(sys.prefix), Path(sys.executable).parent.parent):
        p = Path(os.path.abspath(p))
        if p.exists() and p != p.resolve() and (p.resolve(), p) not in out:
            out.append((p.resolve(), p))
    return out


def _package_hooks() -> list[Path]:
    """Files of the environment that would lead an import of tinypaged back to the repository: an editable
    install's finder and ``.pth`` files (and any ``.pth`` naming the repository). Masked inside."""
    import site
    import sysconfig

    repo = str(Path(__file__).resolve().parents[3])
    dirs = {sysconfig.get_paths().get(k) for k in ("purelib", "platlib")} | set(site.getsitepackages())
    out = []
    for d in filter(None, dirs):
        for f in sorted(Path(d).glob("*")):
            name = f.name
            if not f.is_file():
                continue
            if name.startswith("__editable__") and "tinypaged" in name:
                out.append(f)
            elif name.endswith((".pth", ".egg-link")):
                try:
                    text = f.read_text(errors="replace")
                except OSError:
                    continue
                if repo in text or "tinypaged" in text:
                    out.append(f)
    return sorted(set(out))


def _model_dirs() -> list[Path]:
    """The model folders the checks load (those that exist): SmolLM2 converted, "tiny"'s saved weights
    (without them each check process would build "tiny" through transformers' model stack) and the built CPU
    operators (``tinypaged.cpu_native``)."""
    from tinypaged.model import loader as model_loader

    root = model_loader.cache_dir()
    tiny = model_loader.tiny_folder(0)
    ops = cpu_native.built_folder()  # the C++ CPU operators, where built: loaded inside, never compiled there
    return sorted(p for p in [root / "smollm2-135m-instruct", tiny, ops] if p is not None and p.is_dir())


def _readable_view(folder: Path) -> Path:
    """``folder`` itself when every file in it is readable by others; else a cached copy whose files are (hard
    links where the mode already allows it): the unprivileged sandbox user needs no capability to load it."""
    names = [n for n in sorted(os.listdir(folder)) if (folder / n).is_file()]
    private = [n for n in names if not os.stat(folder / n).st_mode & 0o004]
    if not private:
        return folder
    key = hashlib.sha256(repr([(n, os.stat(folder / n).st_size, os.stat(folder / n).st_mtime_ns)
                               for n in names]).encode()).hexdigest()[:16]
    view = grader_cache() / "readable" / f"{folder.name}-{key}"
    if view.is_dir():
        return view
    view.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=view.parent))
    for n in names:
        if n in private:
            shutil.copyfile(folder / n, staging / n)
        else:
            try:
                os.link(folder / n, staging / n)
            except OSError:
                shutil.copyfile(folder / n, staging / n)
        os.chmod(staging / n, 0o644)
    os.chmod(staging, 0o755)
    try:
        staging.rename(view)
    except OSError:  # another grader made it first
        shutil.rmtree(staging, ignore_errors=True)
    return view


def grader_cache() -> Path:
    """The grader's own cache (editions, readable model views): beside the model cache, never in a repository."""
    from tinypaged.model import loader as model_loader

    path = model_loader.cache_dir() / "grading"
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o755)
    return path


_EDITION_LOCK = threading.Lock()


EDITION_RULE = "class-2"  # what an edition holds (student_edition.class_assignments, references withheld)


def _source_key(root: Path, assignment: str) -> str:
    """A digest of what an edition is built from: the rule, the package's code (its checks, which name the withheld
    references, included) and the solution notebooks of every assignment the edition stubs."""
    from tinypaged.course import student_edition

    h = hashlib.sha256(f"{EDITION_RULE}\0{assignment}".encode())
    for top in ("tinypaged", "kernels"):
        for f in sorted((root / top).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    for name in student_edition.class_assignments(assignment, root):
        h.update(name.encode())
        h.update((root / "solutions" / f"{name}.ipynb").read_bytes())
    return h.hexdigest()[:16]


def edition_for(assignment: str) -> Path:
    """The student edition that grading ``assignment`` (e.g. ``02_block_table``) imports in sandboxes: every graded
    part of the stages the class has not finished (``assignment``'s and every later one:
    ``student_edition.class_assignments``) hands over to the learner, and the reference functions those stages'
    checks name raise (``write(..., references=True)``), so nothing inside computes an answer being graded,
    but for the few later parts the engine cannot serve without (``student_edition.ENGINE_NEEDS``).
    Built once per source tree and cached under :func:`grader_cache`; it holds no expected values (no
    ``expected_visible.json``)."""
    from tinypaged.course import student_edition

    root = student_edition.ROOT
    target = grader_cache() / "editions" / f"{assignment}-{_source_key(root, assignment)}"
    with _EDITION_LOCK:
        if (target / "tinypaged" / "__init__.py").is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{assignment}-", dir=target.parent))
        try:
            student_edition.write(staging / "e", student_edition.class_assignments(assignment, root),
                                  expectations=False, references=True,
                                  keep=student_edition.engine_needs(assignment))
            for f in (staging / "e").rglob("expected_visible.json"):
                f.unlink()
            for d, _, files in os.walk(staging):
                os.chmod(d, 0o755)
                for n in files:
                    os.chmod(os.path.join(d, n), 0o644)
            try:
                (staging / "e").rename(target)
            except OSError:  # another grader (--jobs) built it first
                pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def edition_for_stage(stage: str) -> Path:
    """:func:`edition_for` of the assignment whose solution notebook starts with ``stage`` (``"02"``)."""
    from tinypaged.course import student_edition

    found = sorted(p.stem for p in (student_edition.ROOT / "solutions").glob(f"{stage}_*.ipynb"))
    if len(found) != 1:
        raise LookupError(f"stage {stage!r}: expected one solution notebook, found {found}")
    return edition_for(found[0])


# ---------------------------------------------------------------- cgroups: limits per submission

_CGROUP_NOTE: list[str] = []
_LIVE_GROUPS: set[str] = set()


def _controllers() -> list[Path]:
    """The cgroup v1 ``memory`` and ``pids`` hierarchies (the parent of every submission's group), and
    ``cpuacct`` where it is mounted (a :class:`SubmissionBudget` reads the submission's CPU time there)."""
    names = ["memory", "pids"] + (["cpuacct"] if (CGROUP_ROOT / "cpuacct" / "cpuacct.usage").exists() else [])
    return [CGROUP_ROOT / c / CGROUP_PARENT for c in names]


def cgroup_cpu_seconds(name: str) -> float | None:
    """CPU seconds used so far by every process that ever ran in group ``name`` (None: no cpuacct group)."""
    try:
        return int((CGROUP_ROOT / "cpuacct" / CGROUP_PARENT / name / "cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        return None


def cgroups_available() -> str | None:
    """None when a cgroup per submission can be made here; else why not (one line)."""
    if os.environ.get("TINYPAGED_NO_CGROUPS") == "1":
        return "TINYPAGED_NO_CGROUPS=1"
    for c in ("memory", "pids"):
        if not (CGROUP_ROOT / c / "cgroup.procs").exists():
            return f"no cgroup v1 {c} controller at {CGROUP_ROOT / c}"
    try:
        for parent in _controllers():
            parent.mkdir(exist_ok=True)
            probe = parent / f"probe-{os.getpid()}"
            probe.mkdir()
            probe.rmdir()
    except OSError as e:
        return f"cgroups not writable ({e.strerror}: {e.filename})"
    return None


def _note_once(text: str) -> None:
    if not _CGROUP_NOTE:
        _CGROUP_NOTE.append(text)
        print(f"note: {text}", file=sys.stderr)


def _cgroup_kill_and_remove(name: str) -> None:
    """Kill what is left in a submission's group (SIGKILL, bounded retries) and remove it."""
    for parent in _controllers():
        group = parent / name
        if not group.is_dir():
            continue
        for _ in range(50):
            try:
                pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
            except OSError:
                break
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        try:
            group.rmdir()
        except OSError:
            pass
    _LIVE_GROUPS.discard(name)


def _reap_stale_groups() -> None:
    """Remove the empty groups a grader that was killed left behind (named after its process id)."""
    for parent in _controllers():
        for group in parent.glob("*-*"):
            pid = group.name.split("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                try:
                    if not (group / "cgroup.procs").read_text().split():
                        group.rmdir()
                except OSError:
                    pass


@atexit.register
def _cleanup_groups() -> None:
    for name in list(_LIVE_GROUPS):
        _cgroup_kill_and_remove(name)


# ---------------------------------------------------------------- one submission's budget

class SubmissionBudget:
    """The ceiling on one submission as a whole, across every sandbox it runs in (the checks' processes, each
    restart, the feedback run): ``cpu_seconds`` of CPU in all (read from each sandbox's ``cpuacct`` group) and
    ``wall_seconds`` of wall-clock time per phase (:meth:`phase`: the checks, then the feedback run).

    Invariants: once either is spent, :attr:`exceeded` says which (one line), every live sandbox of the
    submission is killed (its cgroup; without cgroups, the ``timeout`` wrapper of :meth:`Sandbox.command` still
    ends each command at the phase's deadline), and a sandbox started afterwards runs nothing but a one-line
    refusal. A watchdog thread polls while a sandbox is live; it never outlives the submission."""

    POLL = 0.25

    def __init__(self, wall_seconds: float | None = 900.0, cpu_seconds: float | None = 3600.0):
        self.wall_seconds, self.cpu_seconds = wall_seconds, cpu_seconds
        self.exceeded: str | None = None
        self.spent_cpu = 0.0  # CPU seconds of sandboxes already closed
        self.live: set[str] = set()
        self._lock = threading.Lock()
        self._watch: threading.Thread | None = None
        self.phase(wall_seconds)

    def phase(self, wall_seconds: float | None, name: str = "") -> "SubmissionBudget":
        """Start a phase with its own wall-clock ceiling (the CPU budget carries over)."""
        self.wall_seconds, self.name = wall_seconds, name
        self.deadline = None if wall_seconds is None else time.monotonic() + wall_seconds
        return self

    def remaining(self) -> float | None:
        """Wall-clock seconds left in this phase (None: no ceiling)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def cpu_used(self) -> float:
        with self._lock:
            return self.spent_cpu + sum(cgroup_cpu_seconds(g) or 0.0 for g in self.live)

    def check(self) -> str | None:
        """Whether the submission is over its budget now (and why, one line); kills its live groups if so."""
        if self.exceeded is None:
            left = self.remaining()
            if left is not None and left <= 0:
                what = f" ({self.name})" if self.name else ""
                self.exceeded = f"the submission ran past its wall-clock ceiling of {self.wall_seconds:g} s{what}"
            elif self.cpu_seconds is not None and self.cpu_used() > self.cpu_seconds:
                self.exceeded = f"the submission used more than its {self.cpu_seconds:g} s of CPU time in all"
        if self.exceeded is not None:
            with self._lock:
                groups = list(self.live)
            for g in groups:
                _cgroup_kill_and_remove(g)
        return self.exceeded

    def join(self, group: str) -> None:
        """A sandbox of this submission got its cgroup: count it, and watch it."""
        with self._lock:
            self.live.add(group)
            if self._watch is None or not self._watch.is_alive():
                self._watch = threading.Thread(target=self._run, daemon=True, name="submission-budget")
                self._watch.start()

    def release(self, group: str) -> None:
        """A sandbox of this submission is closing: its CPU time so far is kept in :attr:`spent_cpu`."""
        with self._lock:
            if group in self.live:
                self.live.discard(group)
                self.spent_cpu += cgroup_cpu_seconds(group) or 0.0

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self.live:
                    self._watch = None
                    return
            if self.check() is not None:
                with self._lock:
                    self.live.clear()
                    self._watch = None
                return
            time.sleep(self.POLL)


_INTERPRETER_OK: dict = {}


def interpreter_problem(make_sandbox) -> str | None:
    """None when the grader's interpreter starts inside the sandbox ``make_sandbox`` builds; else why not, in one
    line (a ``.venv`` whose link target is not bound in, a missing library): grading then stops with that line
    instead of blaming the learner's code. Checked once per interpreter and sandbox layout in this process."""
    with tempfile.TemporaryDirectory(prefix="tinypaged-preflight-") as tmp:
        try:
            box = make_sandbox(Path(tmp))
        except SandboxUnavailable:  # no bwrap: the caller's own use of the sandbox says so
            return None
        if box.unsafe:
            return None
        key = (sys.executable, tuple(_python_paths()), tuple(_python_aliases()), box.edition)
        if key in _INTERPRETER_OK:
            return _INTERPRETER_OK[key]
        import subprocess

        box.budget = None
        with box:
            try:
                proc = subprocess.run(box.command([sys.executable, "-I", "-c", "import encodings, json"]),
                                      capture_output=True, text=True, timeout=120, cwd=tmp)
                why = None if proc.returncode == 0 else \
                    (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1][:300]
            except subprocess.TimeoutExpired:
                why = "it did not start within 120 s"
        if why is not None:
            why = f"the Python interpreter {sys.executable} cannot start inside the sandbox: {why}"
        _INTERPRETER_OK[key] = why
        return why


# ---------------------------------------------------------------- the sandbox

@dataclass
class Sandbox:
    """A recipe for one submission's sandbox: ``command(argv)`` wraps a command line in it; ``close()`` kills
    what is left in its cgroup and removes the group (``with Sandbox(...) as box:`` does it too)."""

    scratch: Path
    hide: list[Path] = field(default_factory=list)  # kept for callers; nothing outside the listed binds is seen
    cpu_seconds: int = 600  # CPU time of each process (RLIMIT_CPU): the limit load cannot trip
    memory_bytes: int = 8 << 30  # memory of the whole submission (cgroup) and address space of each process
    processes: int = 4096  # processes and threads of the whole submission (cgroup pids.max; else RLIMIT_NPROC)
    unsafe: bool = False  # run without bubblewrap (the caller warned)
    edition: Path | None = None  # the student edition to import tinypaged from (None: no tinypaged inside)
    scratch_mb: int = 512  # size of the private tmpfs (the working directory)
    file_bytes: int = 256 << 20  # RLIMIT_FSIZE: the largest file any process may write
    io: bool = False  # bind ``scratch`` (the grader's folder) READ-ONLY at /io (nothing of the host is writable)
    files: dict = field(default_factory=dict)  # inside path -> host file, each bound read-only
    budget: "SubmissionBudget | None" = None  # the whole submission's CPU and wall-clock ceiling (shared)
    cgroup: str | None = None  # the submission's group name, once ``command`` made it (None: no cgroup)

    def __post_init__(self):
        self.scratch = Path(self.scratch).resolve()
        if not self.unsafe and bwrap() is None:
            raise SandboxUnavailable(f"no sandbox: bwrap is not installed ({INSTALL_HINT}); "
                                     "--unsafe-no-sandbox grades anyway, without protection")
        if os.geteuid() == 0 and not self.unsafe:
            os.chown(self.scratch, NOBODY, NOBODY)  # the unprivileged user writes only here (and its tmpfs)
            os.chmod(self.scratch, 0o700)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self.cgroup is not None:
            if self.budget is not None:
                self.budget.release(self.cgroup)
            _cgroup_kill_and_remove(self.cgroup)

    def inside(self, path: Path) -> str:
        """Where a file of the grader's scratch folder is seen inside (``/io/...``, read-only) when ``io`` is set."""
        path = Path(path).resolve()
        if self.unsafe:
            return str(path)
        return str(IO / path.relative_to(self.scratch))

    def env(self) -> dict:
        """The environment inside: a private home and caches, the model where the grader keeps it, offline."""
        from tinypaged.model import loader as model_loader

        s = str(self.scratch) if self.unsafe else str(WORK)
        keep = {k: v for k, v in os.environ.items()
                if k in ("LANG", "LC_ALL", "PYTHONHASHSEED", "TINYPAGED_DEVICE",
                         "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        keep.update(HOME=s, TMPDIR=s, MPLCONFIGDIR=f"{s}/.mpl", TRITON_CACHE_DIR=f"{s}/.triton",
                    JUPYTER_RUNTIME_DIR=f"{s}/.jupyter-runtime", IPYTHONDIR=f"{s}/.ipython",
                    XDG_CACHE_HOME=f"{s}/.cache", TINYPAGED_CACHE=str(model_loader.cache_dir()),
                    HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                    TRANSFORMERS_NO_ADVISORY_WARNINGS="1", PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1",
                    TINYPAGED_CPU_OPS="0" if os.environ.get(cpu_native.ENV) == "0" else "load")
        keep["PATH"] = str(Path(sys.executable).parent) + os.pathsep + "/usr/local/bin:/usr/bin:/bin"
        if self.edition is not None:
            keep["PYTHONPATH"] = str(self.edition) if self.unsafe else str(EDITION)
        return keep

    def limits(self) -> list[str]:
        """prlimit's per-process limits; RLIMIT_NPROC (counted per user: one sandbox's forks would stop another's
        threads) only where no cgroup bounds the submission's processes."""
        nproc = [f"--nproc={self.processes}"] if self.cgroup is None else []
        return [shutil.which("prlimit") or shutil.which("prlimit", path="/usr/bin:/bin") or "prlimit",
                f"--as={self.memory_bytes}", f"--cpu={self.cpu_seconds}", *nproc,
                f"--fsize={self.file_bytes}", "--core=0", "--"]

    def _join_cgroup(self) -> list[str]:
        """A shell that moves itself into a new group per submission, then execs the sandbox ([] where cgroups
        are not writable: the per-process limits remain, with a note)."""
        why = cgroups_available()
        if why is not None:
            _note_once(f"no cgroup per submission ({why}): memory and processes are limited per process only")
            return []
        if self.cgroup is None:
            _reap_stale_groups()
            self.cgroup = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
            _LIVE_GROUPS.add(self.cgroup)
        procs = []
        for parent in _controllers():
            group = parent / self.cgroup
            group.mkdir(exist_ok=True)
            procs.append(str(group / "cgroup.procs"))
        mem = CGROUP_ROOT / "memory" / CGROUP_PARENT / self.cgroup
        (mem / "memory.limit_in_bytes").write_text(str(self.memory_bytes))
        if (mem / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
            try:
                (mem / "memory.memsw.limit_in_bytes").write_text(str(self.memory_bytes))
            except OSError:
                pass
        (CGROUP_ROOT / "pids" / CGROUP_PARENT / self.cgroup / "pids.max").write_text(str(self.processes))
        if self.budget is not None:
            self.budget.join(self.cgroup)
        script = 'for f in ' + " ".join(procs) + '; do echo $$ > "$f" || exit 125; done; exec "$@"'
        return ["/bin/sh", "-c", script, "tinypaged-sandbox"]

    def command(self, argv: list[str]) -> list[str]:
        refusal = self._over_budget()
        if refusal is not None:
            return refusal
        if self.unsafe:
            return self._deadline() + self.limits() + list(argv)
        ro = "--ro-bind"
        cmd = [bwrap(), "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
               "--new-session", "--proc", "/proc", "--dev", "/dev"]
        size = str(self.scratch_mb << 20)
        cmd += ["--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]  # over --dev's own, unbounded /dev/shm
        drop_to_nobody = os.geteuid() == 0 and shutil.which("setpriv") is not None
        if not drop_to_nobody:  # (as root, setpriv needs CAP_SETUID to become nobody, then drops every capability)
            cmd += ["--cap-drop", "ALL"]
        for name in ("bin", "lib", "lib32", "lib64", "libx32", "sbin"):  # merged /usr: links; else folders
            p = Path("/") / name
            if p.is_symlink():
                cmd += ["--symlink", os.readlink(p), str(p)]
            elif p.is_dir():
                cmd += [ro, str(p), str(p)]
        # first: an environment or a model cache under /tmp is bound in over it, not hidden under it
        cmd += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
        made: set[Path] = set()

        def bind(src, dest: Path, how: str = ro) -> list[str]:
            """Bind ``src`` at ``dest``, its missing parents made traversable (bwrap would make them 0700)."""
            out = []
            for parent in reversed(Path(dest).parents):
                if parent != Path("/") and parent not in made:
                    out += ["--perms", "0755", "--dir", str(parent)]
                    made.add(parent)
            return out + [how, str(src), str(dest)]

        cmd += bind("/usr", Path("/usr"))
        for name in ETC:
            cmd += bind(f"/etc/{name}", Path("/etc") / name, "--ro-bind-try")
        for p in _python_paths():
            if p != Path("/usr") and Path("/usr") not in p.parents:  # (/usr is bound above)
                cmd += bind(p, p)
        for real, seen in _python_aliases():  # a linked .venv's spelling too
            cmd += bind(real, seen)
        for hook in _package_hooks():  # the editable install's way back to the repository, emptied
            cmd += [ro, "/dev/null", str(hook)]
        for model in _model_dirs():
            cmd += bind(_readable_view(model), model)
        if self.edition is not None:
            cmd += bind(Path(self.edition).resolve(), EDITION)
        cmd += ["--perms", "0777", "--size", size, "--tmpfs", str(WORK)]
        for inside, host in sorted(self.files.items()):  # single files, read-only
            cmd += bind(Path(host).resolve(strict=True), Path(inside))
        if self.io:  # read-only: a sandbox hands nothing back through a host folder
            cmd += bind(self.scratch, IO)
        for dev in sorted(Path("/dev").glob("nvidia*")) + sorted(Path("/dev/dri").glob("*")):  # a GPU, if any
            cmd += ["--dev-bind", str(dev), str(dev)]
        cmd += ["--chdir", str(WORK), "--clearenv"]
        for k, v in self.env().items():
            cmd += ["--setenv", k, v]
        cmd.append("--")
        if drop_to_nobody:
            # nobody, with no capability at all: what it may read is what the mounts show and the modes allow
            cmd += [shutil.which("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    "--inh-caps=-all", "--bounding-set=-all", "--"]
        join = self._join_cgroup()  # first: it decides whether RLIMIT_NPROC is needed
        return join + self._deadline() + cmd + self.limits() + list(argv)

    def _over_budget(self) -> list[str] | None:
        """The command a sandbox runs once its submission's budget is spent: one line on stderr, exit 125."""
        if self.budget is None or self.budget.check() is None:
            return None
        return ["/bin/sh", "-c", 'echo "$1" >&2; exit 125', "tinypaged-budget", f"refused: {self.budget.exceeded}"]

    def _deadline(self) -> list[str]:
        """``timeout`` at the submission phase's deadline (SIGKILL): the wall-clock ceiling holds even where no
        cgroup lets the budget's watchdog kill the group."""
        left = self.budget.remaining() if self.budget is not None else None
        tool = shutil.which("timeout") or shutil.which("timeout", path="/usr/bin:/bin")
        if left is None or tool is None:
            return []
        return [tool, "--signal=KILL", f"{max(left, 1.0):.0f}"]

    def popen_env(self) -> dict | None:
        """The environment for ``subprocess`` (bwrap sets its own inside; unsafe runs get the same one)."""
        return dict(os.environ, **self.env()) if self.unsafe else None
