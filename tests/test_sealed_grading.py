"""Sealed grading: the sandbox holds no answers and the judge runs where learner code never runs, so the attacks
of issue #28 earn what the same real work earns, or nothing, without any detector (these tests skip the static
scan on purpose: ``verify.score(..., findings=[], ...)``).

One stage (02, the fastest), a subset of its cells, small limits; each gather starts one or two probes.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tinypaged.course import checks, coursework
from tinypaged.course.grading import evidence, notebook as nbk, verify
from tinypaged.course.grading.sandbox import Sandbox, cgroups_available, edition_for_stage

ROOT = coursework.ROOT
SOLUTION = ROOT / "solutions" / "02_block_table.ipynb"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def grade_cells(keep: set, replace: dict, **job_keys):
    """Grade a submission made of the stage 2 solution's cells ``keep`` (``replace``: grade_id -> new source) with
    the probe alone: (report, evidence, job)."""
    sol = nbk.read(SOLUTION)
    source = {**sol, "cells": [c for c in sol["cells"] if nbk.grade_id(c) in keep | {"setup"}]}
    sub = json.loads(json.dumps(source))
    for c in sub["cells"]:
        if nbk.grade_id(c) in replace:
            c["source"] = replace[nbk.grade_id(c)]
    job = dict(verify.build_job(source, sub, "02", cell_cpu=30, check_cpu=30), **job_keys)
    ev = evidence.gather(job, coursework.sandbox_factory(coursework.hidden_paths()), idle_s=30)
    return verify.score(source, job, [], ev), ev, job


def rows(report) -> dict:
    return {t["grade_id"]: t for t in report["tests"]}


# A module written into the working directory (first on sys.path) and imported by code the standard library
# compiles (a string annotation: file name "<string>"): a callable object whose __call__ is the package's
# slot_mapping, and a BlockTables whose methods hand everything to the package's BlockTables.
HELPER = '''
from tinypaged.attention.backends import slot_mapping as _ref_slots
from tinypaged.kv.block_manager import BlockTables as _RefTables

class _Call:
    __call__ = staticmethod(_ref_slots)

slot_mapping = _Call()

class BlockTables:
    def __init__(self, allocator, block_size):
        self._t = _RefTables(allocator, block_size)

    def __getattr__(self, name):
        return getattr(self._t, name)
'''

REFERENCE_THROUGH_STRING_CODE = f'''
import numpy, typing
numpy.savetxt("helper_h2.py", [], header={HELPER!r}, comments="")
def _hint(x: "__import__('helper_h2')"):
    pass
slot_mapping = typing.get_type_hints(_hint)["x"].slot_mapping
'''

TABLES_THROUGH_STRING_CODE = '''
import typing
def _hint(x: "__import__('helper_h2')"):
    pass
BlockTables = typing.get_type_hints(_hint)["x"].BlockTables
'''

# Reads what a submission must not: the answers, the repository, another submission, a root-only file, the
# grader's job; through numpy (a library frame) as well as open(). The cell then fails with what it found.
READS = '''
import numpy
found = {{}}
for label, path in {paths!r}:
    try:
        found[label] = "READ " + str(len(open(path, "rb").read()))  # noqa
    except Exception as e:
        try:
            found[label] = "READ " + str(numpy.atleast_1d(numpy.loadtxt(path, dtype=str, delimiter="\\x01",
                                                                        comments=None)).size)
        except Exception as e2:
            found[label] = "no"
raise RuntimeError("READS " + repr(sorted(found.items())))
'''

FORGE = '''
import numpy, typing
from tinypaged.course import checks as _c
def _mods(os: "__import__('os')", json: "__import__('json')"):
    pass
_m = typing.get_type_hints(_mods)  # modules a solution cell may not import, imported by "<string>" code
os, json = _m["os"], _m["json"]
try:  # today's grader kept the job, hidden seeds included, in the working directory
    job = json.loads("".join(numpy.atleast_1d(numpy.loadtxt("job.json", dtype=str, delimiter="\\x01",
                                                              comments=None)).tolist()))
except Exception:
    job = None
calls = job["calls"] if job else [{"key": "test_block_allocator/0", "check": "block_allocator", "hidden": None},
                                 {"key": "test_block_allocator/1", "check": "block_allocator", "hidden": 5201}]
forged = []
for call in calls:
    try:
        outcomes = _c.expected_outcomes(call["check"], call["hidden"])  # needs the reference
    except Exception:
        outcomes = [{"steps": [["x", float("nan")]]}]
    forged.append({"call": call["key"], "record": {"check": call["check"], "hidden": call["hidden"], "reuse": None,
                                                  "outcomes": outcomes}})
forged.append({"finished": True})
text = "".join(json.dumps(e) + "\\n" for e in forged)
for fd in range(1, 64):  # the events' stream, wherever it is
    try:
        os.write(fd, text.encode())
    except OSError:
        pass
numpy.savetxt("events.jsonl", numpy.array(text.splitlines()), fmt="%s")  # today's evidence file
os._exit(0)  # so nothing the grader's process writes later overwrites it
'''


@needs_bwrap
def test_forged_evidence_earns_nothing():
    """Before: full marks for an untouched exercise (the job with its hidden seeds sat beside the checks' process,
    which could compute the expected outcomes with the package, rewrite the evidence with "finished" and end the
    process). Now: no job file, no reference to compute with, a forged line claims only observations, judged like
    any other, and "finished" is not taken from the sandbox: the cell that ended the process is named."""
    report, ev, job = grade_cells({"BlockAllocator", "test_block_allocator", "slot_mapping", "test_slot_mapping"},
                                  {"BlockAllocator": FORGE})
    assert report["score"] == 0, rows(report)  # the cell ended the process: it and the cells after it did not run
    cell = next(c["index"] for c in job["cells"] if c["grade_id"] == "BlockAllocator")
    assert [k.get("cell") for k in ev["kills"]] == [cell], ev["kills"]  # a forged "finished" proves nothing


@needs_bwrap
def test_the_reference_is_not_there_to_reuse_and_nothing_outside_is_readable(tmp_path):
    """Before: the package's slot_mapping behind a callable object and BlockTables behind a wrapper, both reached
    through code compiled as "<string>", scored full marks; the sandbox could read another checkout's solutions,
    a root-only file. Now the sandbox's package is the student edition: its slot_mapping and BlockTables call the
    learner's own (here: themselves) and earn nothing."""
    other = tmp_path / "other" / "02_block_table.ipynb"
    other.parent.mkdir()
    shutil.copy(SOLUTION, other)
    secret = tmp_path / "secret.txt"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    paths = [("solutions", str(SOLUTION)), ("package", str(ROOT / "tinypaged" / "kv" / "block_pool.py")),
             ("other submission", str(other)), ("root-only file", str(secret)), ("shadow", "/etc/shadow"),
             ("job", "job.json"), ("edition's expectations", "/opt/tinypaged/tinypaged/course/checks/"
                                                          "expected_visible.json")]
    report, ev, job = grade_cells(
        {"slot_mapping", "test_slot_mapping", "BlockTables", "test_block_tables", "gather_kv", "test_gather_kv"},
        {"slot_mapping": REFERENCE_THROUGH_STRING_CODE, "BlockTables": TABLES_THROUGH_STRING_CODE,
         "gather_kv": READS.format(paths=paths)})
    r = rows(report)
    assert r["test_slot_mapping"]["score"] == 0 and r["test_block_tables"]["score"] == 0, r
    gather_cell = next(c["index"] for c in job["cells"] if c["grade_id"] == "gather_kv")
    found = ev["cells"][gather_cell]["error"]
    assert found.startswith("RuntimeError: READS"), found
    assert "READ" not in found.removeprefix("RuntimeError: READS"), found  # not one of them was readable
    assert r["test_gather_kv"]["score"] == 0


@needs_bwrap
def test_a_slow_drip_of_cpu_is_stopped_by_the_wall_clock():
    """Before: 0.6 s of CPU every few seconds was never idle and held the check to its CPU budget. Now each step
    has a wall-clock limit (here 8 s) the drip cannot extend; the next probe carries on."""
    drip = ("import time\ndef slot_mapping(table, positions, block_size):\n"
            "    for _ in range(1000):\n        t = time.process_time()\n"
            "        while time.process_time() - t < 0.6:\n            pass\n        time.sleep(1.5)\n")
    report, ev, _ = grade_cells({"slot_mapping", "test_slot_mapping", "BlockAllocator", "test_block_allocator"},
                                {"slot_mapping": drip}, step_wall=8)
    r = rows(report)
    assert r["test_slot_mapping"]["score"] == 0 and "wall-clock" in r["test_slot_mapping"]["message"], r
    assert r["test_block_allocator"]["score"] == r["test_block_allocator"]["points"], r  # the next probe went on


# ---------------------------------------------------------------- the sandbox itself (a shell, cheap)

def shell(box: Sandbox, script: str, timeout: int = 60) -> list[str]:
    with box:
        return subprocess.run(box.command(["bash", "-c", script]), capture_output=True, text=True,
                              timeout=timeout).stdout.split()


@needs_bwrap
def test_the_sandbox_lists_what_it_binds_imports_the_edition_and_has_no_capability(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    secret = scratch / "root-only"  # inside the one folder bound in: the modes still apply
    secret.write_text("x")
    secret.chmod(0o600)
    box = coursework.sandbox_factory([])(scratch)
    box.edition, box.io = edition_for_stage("02"), True
    script = "; ".join([
        f"ls -A {ROOT} | tr '\\n' ,; echo",  # the repository: only the environment is bound under it
        f"cat {ROOT}/solutions/02_block_table.ipynb >/dev/null 2>&1 || echo no-solutions",
        "cat /io/root-only >/dev/null 2>&1 || echo no-root-only",
        "grep CapEff /proc/self/status | tr -d '\\t '",
        "python -c 'import tinypaged; print(tinypaged.__file__)'",
        "python -c 'import tinypaged.attention.backends as b, inspect; "
        "print(\"learner(\" in inspect.getsource(b.slot_mapping))'",
        f"test -e {tmp_path} && echo host-tmp-visible || echo host-tmp-hidden",  # the sandbox's /tmp is its own
    ])
    out = shell(box, script)
    assert out == [".venv,", "no-solutions", "no-root-only", "CapEff:0000000000000000",
                   "/opt/tinypaged/tinypaged/__init__.py", "True", "host-tmp-hidden"], out


@needs_bwrap
def test_disk_is_a_bounded_private_tmpfs_and_files_have_a_size_limit(tmp_path):
    box = Sandbox(tmp_path, scratch_mb=8, file_bytes=4 << 20)
    out = shell(box, "head -c 6000000 /dev/zero > a 2>/dev/null || echo fsize-stopped; "
                     "for i in 1 2 3; do head -c 3000000 /dev/zero > b$i 2>/dev/null || echo disk-full; done; "
                     "du -sm . | cut -f1")
    assert out[0] == "fsize-stopped" and "disk-full" in out and int(out[-1]) <= 8, out


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0 or cgroups_available() is not None,
                    reason=f"no cgroup per submission here: {cgroups_available()}")
def test_memory_and_processes_are_limited_per_submission_not_per_process(tmp_path):
    """Three processes of 150 MiB each stay within any per-process limit of 256 MiB; the submission's cgroup
    (256 MiB in all) stops them; 40 processes against pids.max 16 fail. A second sandbox is unaffected, and
    both groups are gone afterwards."""
    box = Sandbox(tmp_path, memory_bytes=256 << 20, processes=16)
    hog = ("import os, time\npids = []\nfor _ in range(3):\n    pid = os.fork()\n    if pid == 0:\n"
           "        b = bytearray(150 << 20)\n        for i in range(0, len(b), 4096): b[i] = 1\n"
           "        time.sleep(2); os._exit(0)\n    pids.append(pid)\n"
           "print(sum(os.waitpid(p, 0)[1] == 0 for p in pids))\n")
    forks = ("import os, time\nkids = []\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
             "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(2); os._exit(0)\n"
             "    kids.append(pid)\nprint(len(kids))\nfor k in kids: os.waitpid(k, 0)\n")
    (tmp_path / "hog.py").write_text(hog)
    (tmp_path / "forks.py").write_text(forks)
    box.io = True
    out = shell(box, "python3 /io/hog.py 2>/dev/null || echo 0; python3 /io/forks.py")
    assert int(out[0]) < 3, out  # not all three fit in the submission's memory
    assert 0 < int(out[1]) < 16, out  # nor all the processes
    group = box.cgroup
    assert group and not any((Path("/sys/fs/cgroup") / c / "tinypaged" / group).exists() for c in ("memory", "pids"))
    (tmp_path / "next").mkdir()
    assert shell(Sandbox(tmp_path / "next", memory_bytes=1 << 30, processes=64), "echo fine") == ["fine"]


# ---------------------------------------------------------------- the judge's side

def test_nan_and_infinity_are_differences_unless_expected():
    """Before: ``abs(a - b) > tol`` is False for NaN, so NaN passed any comparison with a tolerance."""
    assert checks.differ(1.0, float("nan"), 0.5) is not None
    assert checks.differ(1.0, float("inf"), 0.5) is not None
    assert checks.differ(float("inf"), float("inf"), 0.0) is None
    want = {"tensor": [2], "data": [1.0, 2.0]}
    assert checks.differ(want, {"tensor": [2], "data": [1.0, float("nan")]}, 1e-3) is not None
    assert checks.differ(want, {"tensor": [2], "data": [1.0, 2.0]}, 1e-3) is None


def test_a_tensor_subclass_is_recorded_as_its_plain_data():
    import torch

    class Liar(torch.Tensor):
        def tolist(self):
            return [0.0] * self.numel()

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return torch.zeros(3)

    t = torch.tensor([1.0, float("nan")]).as_subclass(Liar)
    assert checks.plain(t) == {"tensor": [2], "data": [1.0, "nan"]}


def test_the_channel_takes_only_plain_observations_of_the_jobs_own_calls():
    job = {"calls": [{"key": "t/0", "check": "slot_mapping", "hidden": None}], "cells": [{"index": 1}]}
    nan_line = b'{"call": "t/0", "record": {"outcomes": [{"steps": [["x", NaN]]}]}}\n'
    assert evidence._event(nan_line, job) is None  # NaN is not JSON the grader reads: the line is dropped
    deep = b'{"call": "t/0", "record": {"outcomes": [{"steps": [["x", ' + b"[" * 40 + b"]" * 40 + b"]]}]}}\n"
    bad = evidence._event(deep, job)["record"]["outcomes"][0]
    assert bad["steps"] == [] and "not plain data" in bad["error"]
    claim = b'{"call": "t/0", "record": {"check": "other", "hidden": 7, "reuse": "x", "verdict": "PASS", ' \
            b'"outcomes": [{"steps": [["a", 1]], "passed": true}]}}\n'
    assert evidence._event(claim, job) == {"call": "t/0", "record": {"check": "slot_mapping", "hidden": None,
                                                                     "outcomes": [{"steps": [["a", 1]]}]}}
    assert evidence._event(b'{"call": "t/9", "record": {"outcomes": []}}\n', job) is None  # not this job's
    assert evidence._event(b'{"cell": 5, "done": true}\n', job) is None
    assert evidence._event(b"not json\n", job) is None


def test_a_symlinked_submission_is_refused(tmp_path):
    """Before: ``02_block_table.ipynb -> solutions/02_block_table.ipynb`` was graded as the solution (12/12)."""
    link = tmp_path / "alice" / "02_block_table.ipynb"
    link.parent.mkdir()
    link.symlink_to(SOLUTION)
    report = coursework.grade_notebook(link, execute=False, unsafe=True)
    assert report["score"] == 0 and "symbolic link" in report.get("error", ""), report
    folder = tmp_path / "bob"
    folder.symlink_to(SOLUTION.parent)  # a linked folder: the same file through a link
    report = coursework.grade_notebook(folder / SOLUTION.name, execute=False, unsafe=True)
    assert report["score"] == 0 and "symbolic link" in report.get("error", ""), report


def test_the_serving_checks_cpu_budget_is_a_knob_the_wall_clock_follows(capsys):
    """``grade --serving-cpu-timeout`` (tests/test_hostile_submissions.py: a hang in the serving check cost 300
    CPU seconds): the job carries it, the wall-clock limits follow it, and without it nothing changes."""
    from tinypaged.course.grading.probe import SERVING_CPU

    sol = nbk.read(SOLUTION)
    default = verify.build_job(sol, sol, "02", cell_cpu=20, check_cpu=20)
    assert "serving_cpu" not in default and evidence.wall_limits(default)[0] == 2 * SERVING_CPU + 60
    job = verify.build_job(sol, sol, "02", cell_cpu=20, check_cpu=20, serving_cpu=60)
    assert job["serving_cpu"] == 60 and evidence.wall_limits(job)[0] == 2 * 60 + 60
    assert evidence.wall_limits(job)[1] < evidence.wall_limits(default)[1]
    with pytest.raises(SystemExit) as e:  # refused before any work, naming the knob
        coursework.main(["grade", "--serving-cpu-timeout", "0", str(SOLUTION)])
    assert e.value.code == 2 and "--serving-cpu-timeout: 0 must be at least 1" in capsys.readouterr().err
    # a check killed for CPU names the budgets it ran under (a serving check's is not --cpu-timeout's)
    assert evidence._cpu_budget_text(job) == "20 s of CPU a check, 60 s for a serving check"
    assert evidence._cpu_budget_text(dict(job, serving_cpu=10)) == "20 s of CPU"
    assert evidence._why(-24, "", None, evidence._cpu_budget_text(default)) == \
        f"ran past its CPU-time budget (20 s of CPU a check, {SERVING_CPU} s for a serving check)"
