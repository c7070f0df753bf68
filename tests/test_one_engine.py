"""One implementation per concept: what a solution notebook's graded cells define is the package's own code.

For every function and class that a graded cell of ``solutions/*.ipynb`` defines, the package (tinypaged/ but the
classroom, and kernels/) must define one of the same name with the same body, docstrings, comments and
annotations aside (``tinypaged.course.student_edition.normalized``), so the test fails as soon as a notebook and the
package disagree. The student edition (the package with those bodies handed over to the learner's) is tested here
too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest

from tinypaged.course import student_edition as se

PARTS = se.graded_parts()
DEFINITIONS = se.package_definitions()



def test_every_assignment_has_graded_parts():
    assert {p.assignment[:2] for p in PARTS} >= {"01", "02", "03", "04", "05", "06", "07", "08", "09"}
    assert len(PARTS) >= 20


@pytest.mark.parametrize("part", PARTS, ids=lambda p: f"{p.assignment[:2]}-{p.name}")
def test_solution_cell_is_the_package_code(part):
    status, where = se.locate(part, DEFINITIONS)
    assert status == "same", (f"{part.assignment}'s {part.name} ({part.grade_id}) is {status} in the package"
                              + (f" ({where})" if where else "") + ": the lesson's code must be the engine's")


def test_normalized_ignores_docstrings_and_annotations_not_code():
    def one(src):
        return se.normalized(ast.parse(textwrap.dedent(src)).body[0])

    a = one('''
        def f(x: int, *, y: list[int] = ()) -> int:
            """doc"""
            z: int = x + 1  # a comment
            return z
    ''')
    assert a == one("def f(x, *, y=()):\n    z = x + 1\n    return z\n")
    assert a != one("def f(x, *, y=()):\n    z = x + 2\n    return z\n")
    assert a != one("def g(x, *, y=()):\n    z = x + 1\n    return z\n")


def test_stub_file_keeps_signature_docstring_and_decorators():
    src = textwrap.dedent('''
        import functools

        class A:
            """A class."""

            @property
            def size(self) -> int:
                """How many."""
                n = 1
                return n

            def other(self):
                return 2


        @functools.cache
        def f(x, *rest, k=1, **kw):
            # a comment first
            return x + 1
    ''')
    out = se.stub_file(src, [("A.size", "99_test", "A.size"), ("f", "99_test", "f")])
    ns: dict = {}
    exec(compile(out, "<student>", "exec"), ns)
    assert ns["A"]().other() == 2 and ns["A"].size.__doc__ == "How many."
    with pytest.raises(NotImplementedError, match="99_test, part A.size"):
        ns["A"]().size  # pytest's __main__ defines no A: not written yet
    with pytest.raises(NotImplementedError, match="99_test, part f"):
        ns["f"](1)
    assert "learner('99_test', 'f')(x, *rest, k=k, **kw)" in out
    with pytest.raises(LookupError):
        se.stub_file(src, [("A.missing", "99_test", "A.missing")])


def test_student_edition_stubs_the_written_parts_and_nothing_else(tmp_path):
    """Every stubbed body hands over to the learner's definition of its part; every other definition of the package is
    unchanged; no solution notebook travels with it."""
    out = tmp_path / "edition"
    report = se.write(out, ["02_block_table"])
    assert report, "assignment 02 stubs nothing: its parts are not in the package"
    assert not (out / "solutions").exists() and (out / "pyproject.toml").exists()
    for f, fns in report.items():
        source = se.ROOT / (f.removeprefix("tinypaged/") if f.startswith("tinypaged/kernels/") else f)
        before, after = ast.parse(source.read_text()), ast.parse((out / f).read_text())
        for fn in fns:
            body = ast.unparse(se._find(after, fn))
            assert f"learner('02_block_table', '{fn}')" in body and "return" in body, body
        # the rest of the file is unchanged: put the package's bodies back into the edition's stubs
        for fn in fns:
            se._find(after, fn).body = se._find(before, fn).body
        assert ast.dump(before) == ast.dump(after)
    untouched = [p for p in (se.ROOT / "tinypaged").rglob("*.py") if p.relative_to(se.ROOT).as_posix() not in report]
    for p in untouched:
        assert (out / p.relative_to(se.ROOT)).read_text() == p.read_text(), p
    assert (out / "tinypaged" / "kernels" / "paged_attention.py").exists()
    assert '"tinypaged.kernels" = "kernels"' not in (out / "pyproject.toml").read_text()
    assert (out / "tinypaged" / "course" / "checks" / "expected_visible.json").exists()


def test_student_edition_refuses_an_existing_folder_and_an_unknown_assignment(tmp_path):
    with pytest.raises(FileExistsError):
        se.write(tmp_path, ["02_block_table"])
    with pytest.raises(ValueError, match="no solution notebook"):
        se.write(tmp_path / "x", ["99_nothing"])


def test_student_edition_runs_the_learners_definition(tmp_path):
    """In the edition the engine's graded part calls what the learner's notebook (``__main__``) defines; until then,
    and when the learner merely imports the edition's own, it says which part is missing."""
    out = tmp_path / "edition"
    se.write(out, ["02_block_table"])
    code = textwrap.dedent("""
        import sys
        import tinypaged
        assert tinypaged.__file__.startswith(sys.argv[1]), tinypaged.__file__
        from tinypaged.attention import backends
        try:
            backends.slot_mapping([3], [0, 1], 4)
        except NotImplementedError as e:
            print("before:", e)
        def slot_mapping(block_table, positions, block_size):  # the learner's
            return [block_table[p // block_size] * block_size + p % block_size + 1000 for p in positions]
        print("after:", backends.slot_mapping([3], [0, 1], 4))
        from tinypaged.kv.block_pool import BlockAllocator
        try:
            BlockAllocator(4)
        except NotImplementedError as e:
            print("imported, not written:", e)
    """)
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(out), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "before: student edition: 02_block_table, part slot_mapping" in run.stdout
    assert "after: [1012, 1013]" in run.stdout
    assert "imported, not written: student edition: 02_block_table, part BlockAllocator.__init__" in run.stdout


def _solved_exercise(assignment: str) -> dict:
    """The released exercise with every solution cell filled in from the instructor's notebook (by grade_id): what a
    learner who solved everything hands in, without the hidden tests."""
    import json

    from tinypaged.course.grading import notebook as nbk

    exercise = json.loads((se.ROOT / "exercises" / f"{assignment}.ipynb").read_text())
    solved = {nbk.grade_id(c): nbk.source_of(c) for c in json.loads(
        (se.ROOT / "solutions" / f"{assignment}.ipynb").read_text())["cells"] if nbk.is_solution(c)}
    for cell in exercise["cells"]:
        if nbk.is_solution(cell) and nbk.grade_id(cell) in solved:
            cell["source"] = solved[nbk.grade_id(cell)]
    return exercise


@pytest.mark.parametrize("assignment", ["02_block_table"])
def test_solved_exercise_runs_on_the_student_edition(tmp_path, assignment):
    """The student edition plus a learner's finished work: every check passes and the engine serves SmolLM2 with
    the learner's parts in it, although the package's own copies of those parts are stubs."""
    import json
    import os

    import nbformat
    from nbclient import NotebookClient

    edition = tmp_path / "edition"
    report = se.write(edition, [assignment])
    assert report
    nb = nbformat.reads(json.dumps(_solved_exercise(assignment)), as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import tinypaged\nprint('tinypaged from', tinypaged.__file__)"))
    env_before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(edition)  # the kernel inherits it: `import tinypaged` finds the edition first
    try:
        NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_before
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"tinypaged from {edition}" in printed
    verdicts = [line for line in printed.splitlines() if line.startswith("check ")]
    assert verdicts and all(line.endswith(": PASS") for line in verdicts), verdicts


def test_student_edition_launches_the_learners_triton_kernel(tmp_path):
    """A graded Triton kernel cannot call Python, so the edition replaces it by a stand-in whose launch
    (``kernel[grid](...)``) launches the learner's kernel of that name: the package's launcher then runs their code."""
    out = tmp_path / "edition"
    report = se.write(out, ["05_triton_paged_attention"])
    assert "reshape_and_cache_kernel" in report["tinypaged/kernels/reshape_and_cache.py"]
    edition_src = (out / "tinypaged" / "kernels" / "reshape_and_cache.py").read_text()
    assert "@triton.jit" not in edition_src.split("reshape_and_cache_kernel = KernelHandIn")[0].rsplit("\n\n\n", 1)[-1]
    package_src = (se.ROOT / "kernels" / "reshape_and_cache.py").read_text()
    kernel = ast.get_source_segment(package_src, se._find(ast.parse(package_src), "reshape_and_cache_kernel"))
    start = package_src.index(kernel)
    decorators = package_src[:start].rsplit("\n\n\n", 1)[-1]  # the decorator lines above the def
    script = tmp_path / "learner.py"
    script.write_text(textwrap.dedent("""
        import sys, torch
        import tinypaged, tinypaged.kernels as K
        import triton, triton.language as tl
        assert tinypaged.__file__.startswith(sys.argv[1])
        key, value = torch.randn(3, 2, 8, dtype=torch.float64), torch.randn(3, 2, 8, dtype=torch.float64)
        def fresh():
            return torch.zeros(4, 4, 2, 8, dtype=torch.float64), torch.zeros(4, 4, 2, 8, dtype=torch.float64)
        slots = torch.tensor([5, -1, 13])
        try:
            K.reshape_and_cache(key, value, *fresh(), slots)
        except NotImplementedError as e:
            print("before:", e)
    """) + decorators + kernel + textwrap.dedent("""

        kc, vc = fresh()
        K.reshape_and_cache(key, value, kc, vc, slots)
        rk, rv = fresh()
        K.reshape_and_cache_reference(key, value, rk, rv, slots)
        print("after:", torch.equal(kc, rk) and torch.equal(vc, rv))
    """))
    run = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=600,
                         env={"PYTHONPATH": str(out), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                              "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "before: student edition: 05_triton_paged_attention, part reshape_and_cache_kernel" in run.stdout
    assert "after: True" in run.stdout
