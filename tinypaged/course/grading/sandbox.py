"""Run untrusted code (a learner's notebook, the checks on a learner's module) under bubblewrap.

What a sandboxed command can read is listed, not filtered: its root is empty and only these are bound in,
read-only:

* the system's programs and libraries (``/usr`` and its links, a few files of ``/etc``: never ``/etc/shadow``);
* the Python installation and the environment's ``site-packages``, with the editable install's path hook of
  tinypaged masked (its finder and ``.pth`` files read as empty), so the repository's package is not found;
* the **student edition** of the stage being graded (:mod:`tinypaged.course.student_edition`, built once per
  stage and source tree and cached under the grader's cache, :func:`edition_for`): graded bodies are stubs that
  call the learner's code, and it holds no expected values (``expected_visible.json`` is left out);
* the converted model the serving checks load (a world-readable view of it when the cache keeps it private);
* the GPU's device nodes, when there are any.

Not the repository, ``solutions/``, the course folder, other submissions, ``/root``, or the host's ``/tmp``.
Writable: a private tmpfs of ``scratch_mb`` MiB (the working directory, ``$HOME`` and ``$TMPDIR``) and, only
when ``io`` is set, the grader's scratch folder (``/io``: the notebook in and out of the feedback run).

Limits: each submission's sandbox runs in its own cgroup (v1 ``memory`` and ``pids``, or v2) with
``memory_bytes`` and ``processes`` for the submission as a whole (:func:`cgroups_available`; where cgroups
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
IO = Path("/io")  # the grader's scratch folder, bound only for the feedback run's notebook
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

def _python_paths() -> list[Path]:
    """The interpreter's installation and the environment (the venv), outermost first, none inside another."""
    paths = [Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable).resolve().parent.parent]
    found = sorted({p.resolve() for p in paths if p.exists()}, key=lambda p: len(p.parts))
    return [p for i, p in enumerate(found) if not any(q == p or q in p.parents for q in found[:i])]


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


def _source_key(root: Path, assignment: str) -> str:
    """A digest of what an edition is built from: the package's code and the assignment's solution notebook."""
    h = hashlib.sha256(assignment.encode())
    for top in ("tinypaged", "kernels"):
        for f in sorted((root / top).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    h.update((root / "solutions" / f"{assignment}.ipynb").read_bytes())
    return h.hexdigest()[:16]


def edition_for(assignment: str) -> Path:
    """The student edition of ``assignment`` (e.g. ``02_block_table``) for sandboxes: built once per source tree
    and cached under :func:`grader_cache`; its ``expected_visible.json`` is removed (the sandbox holds no
    expected values)."""
    from tinypaged.course import student_edition

    root = student_edition.ROOT
    target = grader_cache() / "editions" / f"{assignment}-{_source_key(root, assignment)}"
    with _EDITION_LOCK:
        if (target / "tinypaged" / "__init__.py").is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{assignment}-", dir=target.parent))
        try:
            student_edition.write(staging / "e", [assignment], expectations=False)
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
    """The cgroup v1 ``memory`` and ``pids`` hierarchies (the parent of every submission's group)."""
    return [CGROUP_ROOT / c / CGROUP_PARENT for c in ("memory", "pids")]


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
    io: bool = False  # bind ``scratch`` (the grader's folder) writable at /io
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
            _cgroup_kill_and_remove(self.cgroup)

    def inside(self, path: Path) -> str:
        """Where a file of the grader's scratch folder is seen inside (``/io/...``) when ``io`` is set."""
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
        script = 'for f in ' + " ".join(procs) + '; do echo $$ > "$f" || exit 125; done; exec "$@"'
        return ["/bin/sh", "-c", script, "tinypaged-sandbox"]

    def command(self, argv: list[str]) -> list[str]:
        if self.unsafe:
            return self.limits() + list(argv)
        ro = "--ro-bind"
        cmd = [bwrap(), "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
               "--new-session", "--proc", "/proc", "--dev", "/dev"]
        drop_to_nobody = os.geteuid() == 0 and shutil.which("setpriv") is not None
        if not drop_to_nobody:  # (as root, setpriv needs CAP_SETUID to become nobody, then drops every capability)
            cmd += ["--cap-drop", "ALL"]
        for name in ("bin", "lib", "lib32", "lib64", "libx32", "sbin"):  # merged /usr: links; else folders
            p = Path("/") / name
            if p.is_symlink():
                cmd += ["--symlink", os.readlink(p), str(p)]
            elif p.is_dir():
                cmd += [ro, str(p), str(p)]
        size = str(self.scratch_mb << 20)
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
            cmd += bind(p, p)
        for hook in _package_hooks():  # the editable install's way back to the repository, emptied
            cmd += [ro, "/dev/null", str(hook)]
        for model in _model_dirs():
            cmd += bind(_readable_view(model), model)
        if self.edition is not None:
            cmd += bind(Path(self.edition).resolve(), EDITION)
        cmd += ["--perms", "0777", "--size", size, "--tmpfs", str(WORK)]
        if self.io:
            cmd += ["--bind", str(self.scratch), str(IO)]
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
        return join + cmd + self.limits() + list(argv)

    def popen_env(self) -> dict | None:
        """The environment for ``subprocess`` (bwrap sets its own inside; unsafe runs get the same one)."""
        return dict(os.environ, **self.env()) if self.unsafe else None
