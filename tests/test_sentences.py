"""Sentences of the lessons, the assignments and the README checked against what they describe: the notebooks'
stored outputs (a re-run that changes an output a sentence quotes fails here, so the sentence is updated with it),
the assignments' own code, and the files the course names.

Read from the notebooks' JSON: nothing here runs a notebook or a model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def cells(path: str) -> list[dict]:
    return json.loads((ROOT / path).read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def printed(cell: dict) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def cell_with(path: str, needle: str, kind: str = "code") -> tuple[int, dict]:
    found = [(i, c) for i, c in enumerate(cells(path)) if c["cell_type"] == kind and needle in source(c)]
    assert len(found) == 1, f"{path}: {len(found)} {kind} cells hold {needle!r}"
    return found[0]


# ---------------------------------------------------------------- lesson 9


def test_lesson_09_names_the_replica_vllm_router_used_as_stored():
    """Cell 9 says where vllm-router put the twelve requests and how the course's router split them: the stored
    output of the cell that prints both per-replica counts must say the same."""
    path = "notebooks/09_many_engines.ipynb"
    i, cell = cell_with(path, "requests per replica: vllm-router")
    m = re.search(r"requests per replica: vllm-router \[([\d, ]+)\] \| the course's router \[([\d, ]+)\]", printed(cell))
    assert m, f"{path} cell {i}: no stored per-replica counts (was it run without vllm-router?)"
    vllm = [int(x) for x in m.group(1).split(",")]
    course = [int(x) for x in m.group(2).split(",")]
    _, prose = cell_with(path, "all twelve requests on replica", kind="markdown")
    text = squash(source(prose))
    claim = re.search(r"all twelve requests on replica (\d+) \(`\[([\d, ]+)\]`\)", text)
    assert claim, text[:400]
    replica = int(claim.group(1))
    assert sum(vllm) == 12 and vllm[replica] == 12, f"stored {vllm}: not all twelve on replica {replica}"
    assert [int(x) for x in claim.group(2).split(",")] == vllm, f"the prose quotes {claim.group(2)}, stored {vllm}"
    split = re.search(r"the course's router split them (\d+):(\d+)", text)
    assert split and sorted(course, reverse=True) == [int(split.group(1)), int(split.group(2))], (course, text[:400])


def test_lesson_09_calls_the_exercise_the_assignment():
    """The assignment a learner opens is exercises/09_many_engines.ipynb (solutions/ holds the answers)."""
    for i, cell in enumerate(cells("notebooks/09_many_engines.ipynb")):
        text = squash(source(cell))
        for m in re.finditer(r"[Tt]he assignment\W{0,4}\s*\(`([^`]+)`\)", text):
            assert m.group(1) == "exercises/09_many_engines.ipynb", f"cell {i} calls {m.group(1)} the assignment"
            assert (ROOT / m.group(1)).is_file()
    assert "solutions/09_many_engines.ipynb" not in (ROOT / "notebooks" / "09_many_engines.ipynb").read_text()


# ---------------------------------------------------------------- lesson 8


def test_lesson_08_states_the_cpus_of_its_stored_run():
    """Cell 18 describes the stored run's machine: its CPU count as printed, and no load it did not have."""
    path = "notebooks/08_serve_over_http.ipynb"
    i, cell = cell_with(path, "load average while this ran")
    m = re.search(r"load average while this ran: ([\d.]+) on (\d+) CPUs", printed(cell))
    assert m, f"{path} cell {i}: no stored load line"
    load, cpus = float(m.group(1)), int(m.group(2))
    _, prose = cell_with(path, "Read the figures with the machine's load beside them", kind="markdown")
    text = squash(source(prose))
    claim = re.search(r"stored run above was made on a machine with (\d+) CPUs", text)
    assert claim and int(claim.group(1)) == cpus, f"stored: {cpus} CPUs; prose: {claim and claim.group(0)}"
    if "far above" in text:
        assert load > 2 * cpus, f"the prose says the load was far above the CPUs; stored {load} on {cpus}"


def test_lesson_08_plot_marks_the_gaps_the_prose_describes():
    path = "notebooks/08_serve_over_http.ipynb"
    i, cell = cell_with(path, "load average while this ran")
    code = source(cell)
    assert "gaps" in code and 'color="red"' in code, "the step plot draws no gaps"
    assert any("image/png" in o.get("data", {}) for o in cell["outputs"]), "no stored figure"
    counts = re.findall(r"\| (\d+) gaps, longest", printed(cell))
    assert len(counts) == 2, printed(cell)
    _, prose = cell_with(path, "Read the figures with the machine's load beside them", kind="markdown")
    assert "red marks" in source(prose)


# ---------------------------------------------------------------- exercise 8


RULES = "exercises/08_serve_over_http.ipynb"


def _rules() -> str:
    return squash(source(cell_with(RULES, "One HTTP call (`call`) holds", kind="markdown")[1]))


def test_exercise_08_wraps_every_chunk_it_says_to_yield_in_sse_line():
    """Every ``chunk(...)`` the rules name is yielded as ``sse_line(chunk(...))``: a bare chunk is a dict, not a
    server-sent event (the solution does the same)."""
    text = _rules()
    chunks = [m.start() for m in re.finditer(r"chunk\(call", text)]
    assert len(chunks) >= 3
    for at in chunks:
        assert text[max(0, at - len("sse_line(")):at] == "sse_line(", f"a bare chunk: ...{text[at - 40:at + 40]}..."
    solution = source(cell_with("solutions/08_serve_over_http.ipynb", "async def sse_stream")[1])
    assert all(line.strip().startswith(("yield sse_line(", "yield DONE")) for line in solution.splitlines()
               if line.strip().startswith("yield"))


def test_exercise_08_rule_2_copies_call_done_before_take_and_rule_3_aborts_the_rest():
    text = _rules()
    rule2 = text[text.index("2. then"):text.index("3. an event")]
    assert "was_done = set(call.done)" in rule2 and "before" in rule2
    assert rule2.index("set(call.done)") < rule2.index("call._take(prompt_idx, event)")
    rule3 = text[text.index("3. an event"):text.index("4. if")]
    assert "abort" in rule3
    solution = source(cell_with("solutions/08_serve_over_http.ipynb", "async def sse_stream")[1])
    assert solution.index("was_done = set(call.done)") < solution.index("call._take(")


def test_exercise_08_serves_smollm2_through_the_learners_stream():
    """The ungraded payoff: a locked given cell, skipped by the grader (``__main__``), one line where the stream
    is not written yet, and SmolLM2's streamed text in the solution's stored output."""
    for path in (RULES, "solutions/08_serve_over_http.ipynb"):
        i, cell = cell_with(path, "stream=sse_stream)")
        meta = cell["metadata"]["nbgrader"]
        assert meta["locked"] is True and meta["grade"] is False and meta["solution"] is False, (path, i, meta)
        code = source(cell)
        assert code.startswith('if __name__ == "__main__":') and '"smollm2-135m"' in code
        assert "not written yet" in code and "except Exception" in code
    _, solved = cell_with("solutions/08_serve_over_http.ipynb", "stream=sse_stream)")
    out = printed(solved)
    assert re.search(r"-- SmolLM2 through your sse_stream: \d+ server-sent events, finish_reason 'length'", out), out


# ---------------------------------------------------------------- every exercise; the README


EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_every_exercise_says_how_to_replay_a_hidden_case(path):
    text = squash(source(json.loads(path.read_text())["cells"][0]))
    assert "ask your instructor for the effective seed from the grading report" in text
    assert "`check(name, impl, THAT_SEED)` (the seed is `check`'s third argument, `hidden`) with the full package " \
           "installed" in text
    import inspect

    from tinypaged.course.checks import check
    assert list(inspect.signature(check).parameters)[:3] == ["name", "impl", "hidden"]


def test_readme_says_which_assignments_end_against_transformers():
    """Stages 1-5 and 7 end with SmolLM2 compared with transformers; 6, 8 and 9 end otherwise (as the README says)."""
    text = squash((ROOT / "README.md").read_text())
    assert "ends with your code plugged into tinypaged's engine serving SmolLM2" not in text
    m = re.search(r"Stages ([\d-]+) and (\d) end with your code plugged into tinypaged's engine serving SmolLM2, "
                  r"compared token for token with transformers", text)
    assert m, "the README's sentence on how the assignments end"
    lo, hi = map(int, m.group(1).split("-"))
    claimed = set(range(lo, hi + 1)) | {int(m.group(2))}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        stage = int(path.name[:2])
        says = "transformers" in path.read_text()
        assert says == (stage in claimed), f"stage {stage}: the README says {stage in claimed}, the notebook {says}"
