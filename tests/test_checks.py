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
