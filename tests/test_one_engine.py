"""One implementation per concept: what a solution notebook's graded cells define is the package's own code.

For every function and class that a graded cell of ``solutions/*.ipynb`` defines, the package (tinypaged/ but the
classroom, and kernels/) must define one of the same name with the same body, docstrings, comments and
annotations aside (``tinypaged.course.student_edition.normalized``). ``NOT_YET`` lists the parts that are still
written twice, each with what stands in the way; the test fails when one of them becomes the package's (take
it off the list) and when any other part drifts.
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

# assignment:name -> why it is still a second copy (shrink this list; never grow it)
NOT_YET: dict[str, str] = {
    "01_contiguous_kv_cache:reservation_tokens": "the package defines it with another body (tinypaged/kv/contiguous.py)",
    "01_contiguous_kv_cache:free_holes": "the package defines it with another body (tinypaged/kv/contiguous.py)",
    "01_contiguous_kv_cache:ContiguousAllocator": "the package defines it with another body (tinypaged/kv/contiguous.py)",
    "02_block_table:BlockAllocator": "the package defines it with another body (tinypaged/kv/block_pool.py)",
    "02_block_table:BlockTables": "the package defines it with another body (tinypaged/kv/block_manager.py)",
    "02_block_table:gather_kv": "the package defines it with another body (tinypaged/attention/backends.py)",
    "02_block_table:paged_attention": "the package has no definition of this name",
    "03_prefix_sharing:fork": "the package has no definition of this name",
    "03_prefix_sharing:append_slot": "the package defines it with another body (tinypaged/kv/block_manager.py)",
    "03_prefix_sharing:free_table": "the package defines it with another body (tinypaged/kv/block_manager.py)",
    "03_prefix_sharing:hash_chain": "the package defines it with another body (tinypaged/kv/block_pool.py)",
    "03_prefix_sharing:PrefixCache": "the package has no definition of this name",
    "03_prefix_sharing:longest_cached_prefix": "the package defines it with another body (tinypaged/kv/block_manager.py)",
    "04_continuous_batching:schedule_step": "the package defines it with another body (tinypaged/sched/policies.py)",
    "05_triton_paged_attention:paged_attention_kernel": "the package has no definition of this name",
    "05_triton_paged_attention:merge_splits_kernel": "the package has no definition of this name",
    "05_triton_paged_attention:reshape_and_cache_kernel": "the package has no definition of this name",
    "06_serving_and_knobs:kv_blocks": "the package has no definition of this name",
    "06_serving_and_knobs:max_concurrency": "the package has no definition of this name",
    "07_radix_attention:RadixTree": "the package has no definition of this name",
    "07_radix_attention:lpm_order": "the package has no definition of this name",
}


def test_every_assignment_has_graded_parts():
    assert {p.assignment[:2] for p in PARTS} >= {"01", "02", "03", "04", "05", "06", "07"}
    assert len(PARTS) >= 20


@pytest.mark.parametrize("part", PARTS, ids=lambda p: f"{p.assignment[:2]}-{p.name}")
def test_solution_cell_is_the_package_code(part):
    key = f"{part.assignment}:{part.name}"
    status, where = se.locate(part, DEFINITIONS)
    if key in NOT_YET:
        assert status != "same", f"{part.name} is now the package's own code ({where}): remove it from NOT_YET"
        pytest.skip(f"not yet one implementation: {NOT_YET[key]}")
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
        def f(x):
            # a comment first
            return x + 1
    ''')
    out = se.stub_file(src, [("A.size", "msg size"), ("f", "msg f")])
    ns: dict = {}
    exec(compile(out, "<student>", "exec"), ns)
    assert ns["A"]().other() == 2 and ns["A"].size.__doc__ == "How many."
    with pytest.raises(NotImplementedError, match="msg size"):
        ns["A"]().size
    with pytest.raises(NotImplementedError, match="msg f"):
        ns["f"](1)
    with pytest.raises(LookupError):
        se.stub_file(src, [("A.missing", "m")])


def test_student_edition_stubs_the_written_parts_and_nothing_else(tmp_path):
    """Every stubbed function names its assignment and part; every other definition of the package is unchanged;
    no solution notebook travels with it."""
    out = tmp_path / "edition"
    report = se.write(out, ["02_block_table"])
    assert report, "assignment 02 stubs nothing: its parts are not in the package"
    assert not (out / "solutions").exists() and (out / "pyproject.toml").exists()
    stubbed = {(f, fn) for f, fns in report.items() for fn in fns}
    for f, fns in report.items():
        source = se.ROOT / (f.removeprefix("tinypaged/") if f.startswith("tinypaged/kernels/") else f)
        before, after = ast.parse(source.read_text()), ast.parse((out / f).read_text())
        for fn in fns:
            node = se._find(after, fn)
            raises = [n for n in ast.walk(node) if isinstance(n, ast.Raise)]
            assert len(raises) == 1 and "02_block_table" in ast.unparse(raises[0]) and fn in ast.unparse(raises[0])
        # the rest of the file is unchanged: put the package's bodies back into the edition's stubs
        for fn in fns:
            se._find(after, fn).body = se._find(before, fn).body
        assert ast.dump(before) == ast.dump(after)
    untouched = [p for p in (se.ROOT / "tinypaged").rglob("*.py") if p.relative_to(se.ROOT).as_posix() not in report]
    for p in untouched[:200]:
        assert (out / p.relative_to(se.ROOT)).read_text() == p.read_text(), p
    assert all(fn for _, fn in stubbed)
    assert (out / "tinypaged" / "kernels" / "paged_attention.py").exists()
    assert '"tinypaged.kernels" = "kernels"' not in (out / "pyproject.toml").read_text()


def test_student_edition_refuses_an_existing_folder_and_an_unknown_assignment(tmp_path):
    with pytest.raises(FileExistsError):
        se.write(tmp_path, ["02_block_table"])
    with pytest.raises(ValueError, match="no solution notebook"):
        se.write(tmp_path / "x", ["99_nothing"])


def test_student_edition_imports_and_a_stub_raises(tmp_path):
    """The edition is a package that imports; calling a graded part raises NotImplementedError naming it."""
    out = tmp_path / "edition"
    se.write(out, ["02_block_table"])
    code = textwrap.dedent("""
        import tinypaged, sys
        assert tinypaged.__file__.startswith(sys.argv[1]), tinypaged.__file__
        from tinypaged.kv.block_pool import BlockAllocator
        try:
            BlockAllocator(4)
        except NotImplementedError as e:
            print("raised:", e)
    """)
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(out), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "raised: student edition: 02_block_table, part BlockAllocator.__init__" in run.stdout
