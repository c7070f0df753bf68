"""Exercises are generated from solutions, never drift, and the grader scores what learners wrote."""

import json

import pytest

from tinypaged import checks, coursework


def notebook(*sources):
    cells = [{"cell_type": "code", "metadata": {}, "source": src, "outputs": [{"output_type": "stream",
              "name": "stdout", "text": "x"}], "execution_count": i + 1} for i, src in enumerate(sources)]
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


SOLVED = """def add(a, b):
    ### BEGIN SOLUTION
    return a + b
    ### END SOLUTION
"""


def test_solution_regions_become_not_implemented_at_their_indentation():
    out = coursework.strip_solutions(SOLVED)
    assert out == 'def add(a, b):\n    raise NotImplementedError("not implemented yet")\n'
    assert "return a + b" not in out


@pytest.mark.parametrize("broken", ["### BEGIN SOLUTION\nx = 1\n", "x = 1\n### END SOLUTION\n",
                                    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n"])
def test_unbalanced_markers_are_refused(broken):
    with pytest.raises(ValueError):
        coursework.strip_solutions(broken)


def test_exercise_has_no_outputs_and_no_solution(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "09_demo.ipynb").write_text(json.dumps(notebook(SOLVED, "print(add(1, 2))")))
    assert coursework.drifted(tmp_path) == ["09_demo.ipynb"]
    assert [p.name for p in coursework.generate(tmp_path)] == ["09_demo.ipynb"]
    assert coursework.drifted(tmp_path) == []
    ex = json.loads((tmp_path / "exercises" / "09_demo.ipynb").read_text())
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in ex["cells"])
    assert "a + b" not in json.dumps(ex)
    (tmp_path / "exercises" / "09_demo.ipynb").write_text(json.dumps(notebook(SOLVED)))  # hand edit
    assert coursework.drifted(tmp_path) == ["09_demo.ipynb"]


def test_repository_exercises_match_their_solutions():
    assert coursework.drifted() == []


def test_every_solution_has_an_exercise_and_a_lesson():
    sols = sorted(p.name for p, _ in coursework.pairs())
    lessons = {p.name[:2] for p in (coursework.ROOT / "notebooks").glob("*.ipynb")}
    assert sols, "no solution notebooks"
    assert {s[:2] for s in sols} <= lessons


def test_grader_gives_full_marks_to_solutions_and_none_to_exercises():
    for sol, ex in coursework.pairs():
        earned, possible, rows = coursework.grade(sol)
        assert possible > 0 and earned == possible, (sol.name, rows)
        earned, possible, rows = coursework.grade(ex)
        assert earned == 0, (ex.name, rows)
        assert all(status == checks.TODO for _, status, _ in rows), (ex.name, rows)


def test_check_reports_pass_fail_and_not_implemented(capsys):
    checks._load_all()
    name = sorted(checks.REGISTRY)[0]

    def not_done(*args, **kwargs):
        raise NotImplementedError("not implemented yet")

    assert checks.check(name, not_done) == checks.TODO
    assert checks.check(name, lambda *a, **k: object()) == checks.FAIL
    assert "check " + name in capsys.readouterr().out
