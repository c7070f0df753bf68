"""Run untrusted code (a learner's notebook, the checks on a learner's module) under bubblewrap.

What a sandboxed command sees and may do:

* the whole file system read-only (``--ro-bind / /``): the package, its checks and the Python
  environment cannot be changed;
* ``/tmp`` and the grader's home replaced by empty tmpfs mounts, then only what the run needs bound
  back read-only (the Python installation, the converted model cache); every folder in ``hide``
  (``solutions/``, the nbgrader course folder with ``source/``, ``gradebook.db`` and the other
  submissions, the folder of the notebooks being graded) is an empty tmpfs;
* one private, writable scratch directory (its working directory and ``$HOME``); the GPU's device
  nodes (``/dev/nvidia*``) when there are any;
* no network (``--unshare-net``: only a loopback, which the Jupyter kernel needs), its own process
  namespace (``--unshare-pid``), killed with the grader (``--die-with-parent``);
* limits from ``prlimit``: address space, CPU seconds (a CPU-time limit, so a loaded machine never
  turns a correct answer into a timeout), number of processes;
* when the grader runs as root: the unprivileged ``nobody`` user (``setpriv``), so no file the
  grader owns is writable even where a mount would allow it.

Without ``bwrap`` the grader refuses (:class:`SandboxUnavailable`) unless told ``unsafe=True``
(``--unsafe-no-sandbox``): the command then runs with the same limits but sees everything.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

NOBODY = 65534
TMP = Path("/tmp")  # an empty tmpfs inside; what the run needs from under it is bound back
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
UNSAFE_WARNING = ("WARNING: grading WITHOUT a sandbox (--unsafe-no-sandbox): a submission can read the answers, "
                  "write the package and the gradebook, and reach the network. Use it only on work you trust.")


class SandboxUnavailable(RuntimeError):
    pass


def bwrap() -> str | None:
    """The bubblewrap binary on PATH (None: no sandbox here)."""
    return shutil.which("bwrap")


def _readable_paths() -> list[Path]:
    """What the sandbox needs to read under a hidden home: the interpreter, its environment, the model cache,
    the repository and the package (an editable install may live anywhere)."""
    from tinypaged.model import loader as model_loader

    import tinypaged

    paths = [Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable).resolve().parent.parent,
             model_loader.cache_dir(), Path(tinypaged.__file__).resolve().parents[1]]
    kernels = sys.modules.get("tinypaged.kernels")
    if kernels is not None and getattr(kernels, "__file__", None):
        paths.append(Path(kernels.__file__).resolve().parents[1])
    for entry in sys.path:
        if entry and Path(entry).is_dir():
            paths.append(Path(entry).resolve())
    found = sorted({p.resolve() for p in paths if p.exists()}, key=lambda p: len(p.parts))
    return [p for i, p in enumerate(found) if not any(q == p or q in p.parents for q in found[:i])]


def _private_files() -> bool:
    """Whether a file the sandbox must read (the converted model) is unreadable to other users."""
    from tinypaged.model import loader as model_loader

    root = model_loader.cache_dir()
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                if not os.stat(os.path.join(dirpath, n)).st_mode & 0o004:
                    return True
            except OSError:
                pass
    return False


@dataclass
class Sandbox:
    """A recipe for one submission's sandbox: ``command(argv)`` wraps a command line in it."""

    scratch: Path
    hide: list[Path] = field(default_factory=list)  # folders the submission must not read
    cpu_seconds: int = 600  # CPU time of each process (RLIMIT_CPU): the limit load cannot trip
    memory_bytes: int = 8 << 30  # address space of each process (RLIMIT_AS)
    processes: int = 4096  # RLIMIT_NPROC (per user: threads count; root ignores it)
    unsafe: bool = False  # run without bubblewrap (the caller warned)

    def __post_init__(self):
        self.scratch = Path(self.scratch).resolve()
        if not self.unsafe and bwrap() is None:
            raise SandboxUnavailable(f"no sandbox: bwrap is not installed ({INSTALL_HINT}); "
                                     "--unsafe-no-sandbox grades anyway, without protection")
        if os.geteuid() == 0 and not self.unsafe:
            os.chown(self.scratch, NOBODY, NOBODY)  # the unprivileged user writes only here
            os.chmod(self.scratch, 0o700)

    def env(self) -> dict:
        """The environment inside: a private home and caches, the model where the grader keeps it, offline."""
        from tinypaged.model import loader as model_loader

        s = str(self.scratch)
        keep = {k: v for k, v in os.environ.items()
                if k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "PYTHONHASHSEED", "TINYPAGED_DEVICE",
                         "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        keep.update(HOME=s, TMPDIR=s, MPLCONFIGDIR=f"{s}/.mpl", TRITON_CACHE_DIR=f"{s}/.triton",
                    JUPYTER_RUNTIME_DIR=f"{s}/.jupyter-runtime", IPYTHONDIR=f"{s}/.ipython",
                    XDG_CACHE_HOME=f"{s}/.cache", TINYPAGED_CACHE=str(model_loader.cache_dir()),
                    HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                    TRANSFORMERS_NO_ADVISORY_WARNINGS="1", PYTHONDONTWRITEBYTECODE="1")
        keep["PATH"] = str(Path(sys.executable).parent) + os.pathsep + keep.get("PATH", "/usr/bin:/bin")
        return keep

    def limits(self) -> list[str]:
        return [shutil.which("prlimit") or shutil.which("prlimit", path="/usr/bin:/bin") or "prlimit", f"--as={self.memory_bytes}", f"--cpu={self.cpu_seconds}",
                f"--nproc={self.processes}", "--core=0", "--"]

    def command(self, argv: list[str]) -> list[str]:
        if self.unsafe:
            return self.limits() + list(argv)
        s = str(self.scratch)
        cmd = [bwrap(), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", str(TMP),
               "--unshare-net", "--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session"]
        home = Path.home().resolve()
        hidden = [Path(h).resolve() for h in self.hide]
        if home != Path("/"):
            hidden.append(home)
        made: set[Path] = set()
        readable = _readable_paths()
        for p in readable:  # answers kept beside a copy of the package: solutions/, instructor/, its git history
            for repo in (p, *p.parents[:2]):
                for name in ("solutions", "instructor", "course", ".git"):
                    if (repo / name).exists() and repo != Path("/"):
                        hidden.append(repo / name)
        hidden = list(dict.fromkeys(hidden))

        def hide(h: Path) -> list[str]:
            if not h.exists() or str(self.scratch).startswith(str(h) + os.sep) or h == self.scratch:
                return []
            return ["--perms", "0755", "--tmpfs", str(h)] if h.is_dir() else ["--ro-bind", "/dev/null", str(h)]

        for h in hidden:
            cmd += hide(h)
        rebound = []
        covered = hidden + [TMP]  # a checkout or environment under /tmp is under the empty tmpfs too
        for p in readable:
            inside = [h for h in covered if p != h and h in p.parents]
            if not inside:
                continue
            for parent in reversed(p.parents):  # bwrap makes missing mount points 0700: make them readable
                if any(h in parent.parents for h in inside) and parent not in made:
                    cmd += ["--perms", "0755", "--dir", str(parent)]
                    made.add(parent)
            cmd += ["--ro-bind", str(p), str(p)]
            rebound.append(p)
        for h in hidden:  # hidden again where a bound-back folder holds them
            if any(p in h.parents for p in rebound):
                cmd += hide(h)
        for dev in sorted(Path("/dev").glob("nvidia*")) + sorted(Path("/dev/dri").glob("*")):  # a GPU, if any
            cmd += ["--dev-bind", str(dev), str(dev)]
        cmd += ["--bind", s, s, "--chdir", s, "--clearenv"]
        for k, v in self.env().items():
            cmd += ["--setenv", k, v]
        cmd.append("--")
        if os.geteuid() == 0 and shutil.which("setpriv"):
            # nobody, with no capability but (where the model files are private to root) reading past file modes:
            # what it may read is still only what the mounts show; it can write only its scratch.
            caps = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
                    "--bounding-set=-all,+dac_read_search"] if _private_files() else ["--bounding-set=-all"]
            cmd += [shutil.which("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *caps, "--"]
        return cmd + self.limits() + list(argv)

    def popen_env(self) -> dict | None:
        """The environment for ``subprocess`` (bwrap sets its own inside; unsafe runs get the same one)."""
        return dict(os.environ, **self.env()) if self.unsafe else None
