"""Every check passes on the implementation under test (see adapters.py), and every check can fail."""

import pytest

from adapters import implementation, under_test
from tinypaged.course import checks

checks._load_all()
# Serving checks run SmolLM2 and compare with transformers: tests/test_grading.py grades them.
NAMES = sorted(n for n, c in checks.REGISTRY.items() if c.expected is None)
HIDDEN_SEED = 24680  # not one of the notebooks' seeds


@pytest.mark.parametrize("name", NAMES)
def test_check_passes(name):
    impl = implementation(name)
    for hidden in (None, HIDDEN_SEED):
        status, msg = checks.evaluate(name, impl, hidden, detect=under_test(name))
        assert status == checks.PASS, f"{name} (hidden={hidden}): {status} {msg}"


@pytest.mark.parametrize("name", NAMES)
def test_check_can_fail(name):
    """A stub is 'not implemented yet'; something that answers wrongly fails with a message."""

    def stub(*args, **kwargs):
        raise NotImplementedError("not implemented yet")

    assert checks.evaluate(name, stub, detect=False)[0] == checks.TODO
    status, msg = checks.evaluate(name, lambda *a, **k: None, detect=False)
    assert status == checks.FAIL and msg.startswith("case '"), (status, msg)


@pytest.mark.parametrize("name", NAMES)
def test_reference_implementation_is_refused(name):
    """Handing in the package's own implementation (or a wrapper of it) scores nothing, with the reason."""
    ref = checks.get(name).reference()
    status, msg = checks.evaluate(name, ref)
    assert status == checks.FAIL and "reference implementation" in msg, (name, status, msg)


@pytest.mark.parametrize("name", NAMES)
def test_hidden_cases_are_other_inputs(name):
    c = checks.get(name)
    visible = checks.expected_outcomes(name, None)
    hidden = checks.expected_outcomes(name, HIDDEN_SEED)
    assert hidden and visible != hidden
    assert checks.expected_outcomes(name, HIDDEN_SEED + 1) != hidden, "hidden cases must depend on the seed"
    assert len(c.cases(HIDDEN_SEED)) == len(hidden)


def test_messages_name_the_case_the_step_and_both_values(capsys):
    def first_fit_best(holes, size):  # best-fit instead of first-fit
        fits = [(gap, start) for start, gap in holes if gap >= size]
        return min(fits)[1] if fits else None

    checks.check("first_fit", first_fit_best)
    out = capsys.readouterr().out
    assert out.startswith("check first_fit: FAIL - case '")
    assert "expected 5, got 20" in out or "expected" in out and "got" in out


def test_wrapped_and_aliased_references_are_caught():
    from tinypaged import attention

    def wrapper(table, positions, block_size):
        return attention.slot_mapping(table, positions, block_size)

    def sneaky(table, positions, block_size):  # reached through another module
        import importlib

        return getattr(importlib.import_module("tinypaged.attention"), "slot_mapping")(table, positions, block_size)

    for impl in (attention.slot_mapping, wrapper, sneaky):
        status, msg = checks.evaluate("slot_mapping", impl)
        assert status == checks.FAIL and "reference implementation" in msg


def _stage07_given_and_solution_cells() -> dict:
    """The stage 7 solution's classes and the given plug-in cell, executed without its check cells (which
    would load SmolLM2)."""
    import json

    from tinypaged.course import coursework
    from tinypaged.course.grading.notebook import source_of

    nb = json.loads((coursework.ROOT / "solutions" / "07_radix_attention.ipynb").read_text())
    ns: dict = {"__name__": "__submission__"}
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") in ("setup", "RadixTree", "lpm_order", "plugin"):
            exec(compile(source_of(cell), "<solutions/07 cell>", "exec"), ns)
    return ns


def test_stage07_serving_takes_the_learners_pieces_inside_the_packages_seams():
    """Regression: the serving check refused the solution's plug-ins outright (they are the package's
    RadixKVManager and CacheAwareOrder around the learner's tree and order), so the solution got 8/10.
    The seams pass when the pieces inside are the notebook's, and only then (refused before the model loads)."""
    from tinypaged.course.checks.serving import check_plugins
    from tinypaged.course.checks.stage07 import _preflight
    from tinypaged.radix_cache import RadixKVManager
    from tinypaged.radix_policy import CacheAwareOrder, longest_prefix_first

    plugins = _stage07_given_and_solution_cells()["plugins"]
    check_plugins(plugins, ("kv_cache_manager", "scheduling_policy"))
    _preflight(plugins)
    with pytest.raises(ValueError, match="package's own"):
        check_plugins(plugins)  # without naming the seams, the package's classes are refused as before
    serve = checks.get("serve_radix")
    bad = {"the package's tree": dict(plugins, kv_cache_manager=RadixKVManager.factory(page_size=1)),
           "a named order": dict(plugins, scheduling_policy=CacheAwareOrder("lpm")),
           "the package's order": dict(plugins, scheduling_policy=CacheAwareOrder(longest_prefix_first)),
           "no policy": {"kv_cache_manager": plugins["kv_cache_manager"]}}
    want = {"the package's tree": "your RadixTree", "a named order": "your lpm_order",
            "the package's order": "your lpm_order", "no policy": "scheduling_policy"}
    for what, impl in bad.items():
        (outcome,) = checks.observe(serve, impl)["outcomes"]
        assert want[what] in outcome.get("error", ""), (what, outcome)
