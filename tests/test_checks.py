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
    from tinypaged.attention import backends as attention

    def wrapper(table, positions, block_size):
        return attention.slot_mapping(table, positions, block_size)

    def sneaky(table, positions, block_size):  # reached through another module
        import importlib

        return getattr(importlib.import_module("tinypaged.attention.backends"), "slot_mapping")(table, positions, block_size)

    for impl in (attention.slot_mapping, wrapper, sneaky):
        status, msg = checks.evaluate("slot_mapping", impl)
        assert status == checks.FAIL and "reference implementation" in msg


def _stage07_given_and_solution_cells() -> dict:
    """The stage 7 solution's classes, executed without its check cells (which would load SmolLM2), and the
    plug-ins built around them as the notebook's part (c) builds them."""
    import json

    from tinypaged.course import coursework
    from tinypaged.course.grading.notebook import source_of
    from tinypaged.kv.radix_cache import RadixKVManager
    from tinypaged.sched.radix_policy import CacheAwareOrder

    nb = json.loads((coursework.ROOT / "solutions" / "07_radix_attention.ipynb").read_text())
    ns: dict = {"__name__": "__submission__"}
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") in ("setup", "RadixTree", "lpm_order"):
            exec(compile(source_of(cell), "<solutions/07 cell>", "exec"), ns)
    tree = ns["RadixTree"]
    ns["plugins"] = {"kv_cache_manager": RadixKVManager.factory(page_size=1, tree_factory=tree),
                     "scheduling_policy": CacheAwareOrder(order=ns["lpm_order"])}
    return ns


def test_stage07_serving_takes_the_learners_pieces_inside_the_packages_seams():
    """Regression: the serving check refused the solution's plug-ins outright (they are the package's
    RadixKVManager and CacheAwareOrder around the learner's tree and order), so the solution got 8/10.
    The seams pass when the pieces inside are the notebook's, and only then (refused before the model loads)."""
    from tinypaged.course.checks.serving import check_plugins
    from tinypaged.course.checks.stage07 import _preflight
    from tinypaged.kv.radix_cache import RadixKVManager
    from tinypaged.sched.radix_policy import CacheAwareOrder, lpm_order

    plugins = _stage07_given_and_solution_cells()["plugins"]
    check_plugins(plugins, ("kv_cache_manager", "scheduling_policy"))
    _preflight(plugins)
    with pytest.raises(ValueError, match="package's own"):
        check_plugins(plugins)  # without naming the seams, the package's classes are refused as before
    serve = checks.get("serve_radix")
    bad = {"the package's tree": dict(plugins, kv_cache_manager=RadixKVManager.factory(page_size=1)),
           "a named order": dict(plugins, scheduling_policy=CacheAwareOrder("lpm")),
           "the package's order": dict(plugins, scheduling_policy=CacheAwareOrder(lpm_order)),
           "no policy": {"kv_cache_manager": plugins["kv_cache_manager"]}}
    want = {"the package's tree": "your RadixTree", "a named order": "your lpm_order",
            "the package's order": "your lpm_order", "no policy": "scheduling_policy"}
    for what, impl in bad.items():
        (outcome,) = checks.observe(serve, impl)["outcomes"]
        assert want[what] in outcome.get("error", ""), (what, outcome)


def test_nested_differences_are_named_by_one_path():
    """Regression (issue 32): a difference deep in nested lists read 'item 0: item 0: expected ...'."""
    assert checks.differ([[1, [2, 3, 4]], 5], [[1, [2, 9, 4]], 5], 0) == "at [0][1]: expected [2, 3, 4], got [2, 9, 4]"
    assert checks.differ({"freed": [1, 2], "evictable_size": 3}, {"freed": [1], "evictable_size": 3}, 0) == \
        "at ['freed']: expected [1, 2], got [1]"
    assert checks.differ([1, 2], [1, 3], 0) == "expected [1, 2], got [1, 3]"


def _stage07_tree(**changes):
    """The solution's RadixTree with some methods replaced (a learner's mistakes)."""
    base = _stage07_given_and_solution_cells()["RadixTree"]
    return type("RadixTree", (base,), {"__module__": "__submission__", **changes})


def _stamp_top_half_only(self, key):
    """match_prefix that stamps a split node's new upper half only (issue 32's learner): the remainder keeps its
    old stamp."""
    key, node, pages, now = tuple(key), self.root, [], self.tick()
    while key and key[0] in node.children:
        child = node.children[key[0]]
        n = 0
        while n < min(len(child.key), len(key)) and child.key[n] == key[n]:
            n += 1
        if n < len(child.key):
            child = self.split_node(child, n)
        child.last_access = now
        pages += child.value
        node, key = child, key[n:]
    return pages, node


def test_stage07_split_stamps_are_a_visible_case_and_hidden_failures_can_be_replayed():
    """Regression (issue 32): the split-stamp ambiguity passed every visible case and failed only a hidden
    workout, whose message named step 37 and nothing that led to it. Now a visible case catches it, and a failing
    workout prints the shortest run of operations that still fails, as code to paste (never another case's
    expected values)."""
    learner = _stage07_tree(match_prefix=_stamp_top_half_only)
    status, msg = checks.evaluate("radix_tree", learner)
    assert status == checks.FAIL and msg.startswith("case 'a split stamps both halves'"), msg
    assert "both halves" in msg, msg
    status, msg = checks.evaluate("radix_tree", learner, hidden=HIDDEN_SEED)
    assert status == checks.FAIL and "random workout" in msg and "replay it" in msg, msg
    replay = msg[msg.index("t = RadixTree()"):]
    # the replay is real code: pasted after the learner's class, its last line disagrees with the reference
    from tinypaged.kv.radix_cache import RadixTree

    code = replay.split("; ")
    *setup, last = code
    ns_mine, ns_ref = {"RadixTree": learner}, {"RadixTree": RadixTree}
    for ns in (ns_mine, ns_ref):
        exec("\n".join(setup), ns)
    assert last.startswith("sorted(t.evict(") and eval(last, ns_mine) != eval(last, ns_ref)
    assert len(code) < 30, "the run is shortened"


def test_stage07_a_wrong_insert_return_gets_the_insert_hint():
    """Regression (issue 32): a wrong insert return value was explained by the splitting hint."""
    def insert(self, key, pages):
        super(type(self), self).insert(key, pages)
        return 0

    status, msg = checks.evaluate("radix_tree", _stage07_tree(insert=insert))
    hint = msg.split("(", 1)[1]
    assert status == checks.FAIL and "insert returns how many tokens" in hint and "split" not in hint, msg
