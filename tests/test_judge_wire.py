"""The judge owns the cases (#45): what crosses into the sandbox is data, and no hidden seed is in it.

* every case of every check (visible, and hidden from a seed) encodes as tagged JSON and, rebuilt from that data
  the way the sandbox rebuilds it, observes exactly what the judge's own case observes;
* the job a sandbox receives names no check to look up, no seed and no expected value: a notebook's hidden seed
  appears nowhere in it, and hidden cases are drawn from a keyed digest of that seed;
* a case that closes over something that is not data is refused by name, and a driver whose code differs from
  the judge's is refused by the sandbox;
* feedback quotes no text the sandbox made: an exception is named by its class when that is Python's own;
* a serving check (tokens the sandbox could produce without the learner's parts) earns its points only when the
  unit checks of the parts it runs pass in full.
"""

import copy
import json

import pytest

from tinypaged.course import checks
from tinypaged.course.grading import wire
from tinypaged.course.grading.evidence import sandbox_job
from tinypaged.course.grading.verify import build_job, effective_seed, judge_error_text, score

SEED = 987654321


def all_checks():
    checks._load_all()
    return sorted(checks.REGISTRY.items())


@pytest.mark.parametrize("name", [n for n, _ in all_checks()])
def test_every_case_crosses_as_data_and_observes_the_same(name):
    c = checks.get(name)
    for hidden in (None, effective_seed(SEED, b"k")):
        for case in c.cases(hidden):
            call = json.loads(json.dumps(wire.encode_case(c.target, case), allow_nan=False))
            assert set(call) == {"part", "label", "driver", "inputs"}
            rebuilt = wire.case_function(call)
            if c.expected is not None:  # a serving check: it loads a model; rebuilding it is what is tested here
                assert rebuilt.__code__ is not case.run.__code__ and rebuilt.__qualname__ == case.run.__qualname__
                continue
            ref = c.reference()
            want, got = checks.run_case(case, ref), checks.run_case(checks.Case(case.label, rebuilt), ref)
            assert json.dumps(got) == json.dumps(want), (name, case.label)


def nb(*cells):
    return {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def cell(src, gid, kind, points=None):
    md = {"grade": kind == "test", "solution": kind == "solution", "locked": kind != "solution", "grade_id": gid,
          "schema_version": 3}
    if points:
        md["points"] = points
    return {"cell_type": "code", "metadata": {"nbgrader": md}, "source": src, "outputs": [], "execution_count": None}


SOURCE = nb(
    cell("from tinypaged.course.checks import check", "setup", "given"),
    cell("def slot_mapping(t, p, b):\n    ### BEGIN SOLUTION\n    return []\n    ### END SOLUTION\n", "sm", "solution"),
    cell(f'check("slot_mapping", slot_mapping)\n### BEGIN HIDDEN TESTS\ncheck("slot_mapping", slot_mapping, '
         f'hidden={SEED})\n### END HIDDEN TESTS', "test_sm", "test", 2),
    cell("def schedule_step(r, w, b, m, kv):\n    ### BEGIN SOLUTION\n    return None\n    ### END SOLUTION\n",
         "ss", "solution"),
    cell(f'check("schedule_step", schedule_step, hidden={SEED})\ncheck("schedule_step", schedule_step)',
         "test_ss", "test", 5),
)


def test_the_sandbox_job_holds_no_seed_no_check_name_and_no_expected_value():
    job = build_job(SOURCE, SOURCE, "02", key=b"k")
    seeds = [c["hidden"] for c in job["calls"] if c["hidden"] is not None]
    assert seeds == [effective_seed(SEED, b"k")] * 2 and effective_seed(SEED, b"other") != seeds[0]
    text = json.dumps(sandbox_job(job))
    assert str(SEED) not in text and '"hidden"' not in text and '"check"' not in text
    assert "expected" not in json.dumps([c["inputs"] for call in sandbox_job(job)["calls"] for c in call["cases"]])
    # visible calls first, whatever the cells' order: no hidden input exists in the sandbox while a visible
    # result (shown in the feedback) is recorded
    assert [c["hidden"] is None for c in job["calls"]] == [True, True, False, False]


def test_what_is_not_data_is_refused_by_name():
    class Secret:
        pass

    with pytest.raises(wire.NotData, match="Secret"):
        wire.encode(Secret())
    s = Secret()
    case = checks.Case("x", lambda f, t: t("x", f(s)))
    with pytest.raises(wire.NotData, match="not the checks' own code"):  # code from outside the package
        wire.encode_case("part", case)
    case.run.__module__ = "tinypaged.course.checks.stage02"  # as if a check closed over an object
    with pytest.raises(wire.NotData, match="closes over 's'.*Secret"):
        wire.encode_case("part", case)


def test_a_driver_whose_code_differs_from_the_judges_is_refused():
    c = checks.get("slot_mapping")
    call = wire.encode_case(c.target, c.cases(None)[0])
    call = copy.deepcopy(call)
    call["driver"][3] = "0" * 16
    with pytest.raises(wire.NotData, match="out of date"):
        wire.case_function(call)


def test_feedback_names_python_exceptions_and_nothing_the_sandbox_wrote():
    assert judge_error_text("IndexError: list index out of range") == "IndexError"
    assert judge_error_text(f"ValueError: seed {SEED}") == "ValueError"
    leak = judge_error_text(f"Seed_{SEED}: x")
    assert str(SEED) not in leak and "your code" in leak
    assert judge_error_text("<b>" * 10) == "an exception"


def evidence_for(records):
    return {"records": records, "cells": {}, "kills": [], "refused": [], "threads": []}


def test_a_serving_check_earns_nothing_while_its_parts_fail():
    from tinypaged.course.checks.stage08 import _serve_expected

    src = nb(cell("from tinypaged.course.checks import check", "setup", "given"),
             cell("async def sse_stream(call, events, include_usage):\n    ### BEGIN SOLUTION\n    yield 1\n"
                  "    ### END SOLUTION\n", "sse", "solution"),
             cell('check("sse_stream", sse_stream)', "test_sse", "test", 4),
             cell('check("serve_sse", sse_stream)', "test_serve", "test", 2))
    job = build_job(src, src, "08", key=b"k")
    forged = {"outcomes": copy.deepcopy(_serve_expected(None))}  # the served tokens, made without the stream
    todo = {"outcomes": [{"steps": [], "todo": True} for _ in checks.get("sse_stream").cases(None)]}
    rep = score(src, job, [], evidence_for({"test_sse/0": todo, "test_serve/0": forged}))
    serve = next(t for t in rep["tests"] if t["grade_id"] == "test_serve")
    assert serve["score"] == 0 and "sse_stream" in serve["message"], serve
    honest = {"outcomes": copy.deepcopy(checks.expected_outcomes("sse_stream"))}
    rep = score(src, job, [], evidence_for({"test_sse/0": honest, "test_serve/0": forged}))
    assert rep["score"] == rep["max_score"] == 6


needs_bwrap = pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

SNOOP = '''
import gc, json

def _seen():
    found = set()
    for o in gc.get_objects():
        if isinstance(o, dict) and isinstance(o.get("key"), str) and "cases" in o:
            found.add(o["key"])
    return sorted(found)

def slot_mapping(block_table, positions, block_size):
    raise LookupError(json.dumps(_seen()))  # every call the judge has sent so far, in the error's text
'''


@needs_bwrap
def test_a_hidden_call_reaches_the_sandbox_only_after_every_visible_record():
    """The judge sends one call at a time: while the visible call runs, no hidden call is in the sandbox to be
    copied into the visible result (which the feedback shows); the hidden one arrives after."""
    from tinypaged.course import coursework
    from tinypaged.course.grading import evidence, notebook as nbk

    sol = nbk.read(coursework.ROOT / "solutions" / "02_block_table.ipynb")
    source = {**sol, "cells": [c for c in sol["cells"] if nbk.grade_id(c) in {"setup", "slot_mapping",
                                                                              "test_slot_mapping"}]}
    sub = json.loads(json.dumps(source))
    next(c for c in sub["cells"] if nbk.grade_id(c) == "slot_mapping")["source"] = SNOOP
    job = build_job(source, sub, "02", cell_cpu=30, check_cpu=30)
    ev = evidence.gather(job, coursework.sandbox_factory(coursework.hidden_paths()), idle_s=30)
    visible, hidden = (ev["records"][c["key"]] for c in job["calls"])
    seen = [json.loads(o["error"].split(": ", 1)[1]) for o in visible["outcomes"]]
    assert seen and all(v == ["test_slot_mapping/0"] for v in seen), seen
    later = [json.loads(o["error"].split(": ", 1)[1]) for o in hidden["outcomes"]]
    assert later and all("test_slot_mapping/1" in v for v in later), later
    rep = score(source, job, [], ev)  # and the feedback quotes none of that text
    assert rep["score"] == 0 and "test_slot_mapping/" not in json.dumps(rep["tests"]), rep["tests"]
    assert "raised LookupError" in rep["tests"][0]["message"]
