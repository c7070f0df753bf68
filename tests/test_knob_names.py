"""The scheduling knobs as vLLM names them (issue 47, item 5): ``scheduling_policy`` orders the requests ("fcfs",
"priority", and stage 7's "lpm"), ``scheduler_cls`` is the scheduler ("static" or a plug-in). The course's earlier
spellings (``scheduling_policy="static"``, ``"continuous"``, a plug-in given as ``scheduling_policy``) are errors
at construction, before any model loads, naming the spelling to use now; ``serve``'s flags say the same."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from tinypaged import LLM, EngineConfig
from tinypaged.config import MOVED_POLICIES, SCHEDULERS, SCHEDULING_POLICIES
from tinypaged.entrypoints.cli_args import add_arguments
from tinypaged.sched.policies import FcfsOrder, PlanPolicy, schedule_step
from tinypaged.sched.registry import make_scheduler
from tinypaged.sched.static import StaticScheduler

ROOT = Path(__file__).resolve().parents[1]
WHY = (r"\(as in vLLM, scheduling_policy orders the requests: 'fcfs', 'priority', 'lpm'; scheduler_cls is the "
       r"scheduler: 'static' or your own\)")


def config(**kw) -> EngineConfig:
    return EngineConfig(model="tiny", device="cpu", **kw)


def my_step(running, waiting, budget, max_num_seqs, kv):
    return schedule_step(running, waiting, budget, max_num_seqs, kv)


def test_the_registries_hold_vllms_names():
    assert tuple(SCHEDULING_POLICIES) == ("fcfs", "priority", "lpm")
    assert tuple(SCHEDULERS) == ("static",)
    assert not MOVED_POLICIES.keys() & SCHEDULING_POLICIES.keys()
    for knob, new in MOVED_POLICIES.values():  # each old spelling points at a name its knob takes
        assert new in {"scheduling_policy": SCHEDULING_POLICIES, "scheduler_cls": SCHEDULERS}[knob]
        config(**{knob: new})


def test_the_new_spellings_run_what_the_old_ones_did():
    assert config().scheduling_policy == "fcfs" and isinstance(make_scheduler(config(), None).order, FcfsOrder)
    static = config(scheduler_cls="static")
    assert isinstance(make_scheduler(static, None), StaticScheduler) and static.enable_chunked_prefill is False
    assert make_scheduler(config(scheduler_cls=my_step), None).step.step_fn is my_step


@pytest.mark.parametrize("old, message", [
    ("static", r"scheduling_policy='static' is now scheduler_cls='static' " + WHY),
    ("continuous", r"scheduling_policy='continuous' is now scheduling_policy='fcfs', the default, " + WHY),
    (my_step, r"scheduling_policy=my_step is now scheduler_cls=my_step " + WHY),
    (PlanPolicy(my_step), r"scheduling_policy=PlanPolicy\(\.\.\.\) is now scheduler_cls=PlanPolicy\(\.\.\.\) " + WHY),
    (type("MyPlan", (), {"plan": lambda *a: None}), r"scheduling_policy=MyPlan is now scheduler_cls=MyPlan " + WHY),
])
def test_an_old_spelling_is_a_value_error_naming_the_new_one(old, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        config(scheduling_policy=old)


@pytest.mark.parametrize("old", ["static", "continuous", my_step])
def test_the_old_spelling_is_refused_before_any_model_loads(old):
    """The check is the config's, at construction: a model that does not exist is never looked for."""
    with pytest.raises(ValueError, match=r"^scheduling_policy=.* is now "):
        LLM("no-such-model", scheduling_policy=old)


def test_other_wrong_values_still_name_the_knob():
    with pytest.raises(ValueError, match=r"^scheduling_policy='fifo': use 'fcfs', 'priority', 'lpm'; a scheduler "
                                         r"of your own is scheduler_cls=\.\.\.$"):
        config(scheduling_policy="fifo")
    with pytest.raises(TypeError, match=r"^scheduling_policy must be 'fcfs', 'priority', 'lpm' \(or None: 'fcfs'\), "
                                        r"or an order object with waiting_order\(scheduler\) and "
                                        r"rank_running\(requests\), got 5"):
        config(scheduling_policy=5)
    with pytest.raises(ValueError, match=r"^scheduler_cls='continuous': use 'static', a schedule_step-like function"):
        config(scheduler_cls="continuous")


@pytest.mark.parametrize("flag, message", [
    ("static", "argument --scheduling-policy: static is now --scheduler-cls static (as in vLLM, "
               "--scheduling-policy orders the requests: fcfs, priority, lpm)"),
    ("continuous", "argument --scheduling-policy: continuous is now --scheduling-policy fcfs (as in vLLM, "
                   "--scheduling-policy orders the requests: fcfs, priority, lpm)"),
    ("my_steps.py:my_step", "argument --scheduling-policy: a scheduler to plug in is --scheduler-cls "
                            "my_steps.py:my_step (as in vLLM, --scheduling-policy orders the requests: fcfs, "
                            "priority, lpm)"),
    ("fifo", "argument --scheduling-policy: 'fifo': give fcfs, priority, lpm (a scheduler to plug in is "
             "--scheduler-cls)"),
])
def test_serve_flags_say_the_same(flag, message, capsys):
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    with pytest.raises(SystemExit):
        ap.parse_args(["--scheduling-policy", flag])
    assert message in capsys.readouterr().err
    assert ap.parse_args(["--scheduler-cls", "static"]).scheduler_cls == "static"


# the old spellings, as code or prose would write them: "static" or "continuous" as the policy, a step as the
# policy, or an order (CacheAwareOrder) as the scheduler
OLD = re.compile(r"""scheduling_policy\s*=\s*(?:["'](?:static|continuous)["']"""
                 r"""|(?:my_\w+|schedule_step|OneAtATime)\b)"""
                 r"""|["']scheduling_policy["']\s*:(?!\s*(?:["'](?:fcfs|priority|lpm)["']|CacheAwareOrder\b))"""
                 r"""|scheduler_cls\s*=\s*CacheAwareOrder\b|["']scheduler_cls["']\s*:\s*CacheAwareOrder\b"""
                 r"""|--scheduling-policy[ =](?:static|continuous)\b""")
SCANNED = ["README.md", "docs/*.md", "notebooks/*.ipynb", "solutions/*.ipynb", "exercises/*.ipynb", "tests/*.py",
           "benchmarks/*.py", "tinypaged/lab/*.py", "tinypaged/course/checks/*.py", "tinypaged/entrypoints/*.py",
           "tinypaged/sched/*.py", "tinypaged/engine/*.py", "tinypaged/*.py", "tinypaged/course/*.py"]


def _texts():
    for pattern in SCANNED:
        for path in sorted(ROOT.glob(pattern)):
            if path.name in ("test_knob_names.py", "config.py"):  # config.py holds the old names' error messages
                continue
            text = path.read_text()
            if path.suffix == ".ipynb":
                text = "\n".join("".join(cell["source"]) for cell in json.loads(text)["cells"])
            yield path.relative_to(ROOT), text


def test_the_course_writes_the_new_spellings():
    """Lessons, docs, tests and tools spell the knobs as vLLM does (the engine would refuse the old spellings)."""
    found = [f"{path}: {m.group(0)!r}" for path, text in _texts() for m in OLD.finditer(text)]
    assert not found, "\n".join(found)


def test_an_order_given_as_the_scheduler_names_its_knob_now():
    """Stage 7's ``CacheAwareOrder`` orders the requests: it is ``scheduling_policy``'s, and ``scheduler_cls`` (the
    course's earlier spelling for it) refuses it, naming the knob."""
    from tinypaged.sched.radix_policy import CacheAwareOrder

    with pytest.raises(ValueError, match=r"^scheduler_cls=CacheAwareOrder\(\.\.\.\) is an order of the requests: "
                                         r"it is now scheduling_policy=CacheAwareOrder\(\.\.\.\) "):
        config(scheduler_cls=CacheAwareOrder("lpm"))
    assert config(scheduling_policy=CacheAwareOrder("lpm")).has_plugins


def test_each_scheduling_name_builds_what_the_registry_says():
    """``config``'s names (what the knobs accept, the CLI and docs list) and ``sched/registry.py``'s builders are the
    same sets: a name cannot be accepted and then fail to build, nor built and never accepted."""
    from tinypaged.sched import registry

    assert registry.ORDERS.keys() == SCHEDULING_POLICIES.keys()
    assert registry.SCHEDULERS.keys() == SCHEDULERS.keys()
    for name in SCHEDULING_POLICIES:
        assert make_scheduler(config(scheduling_policy=name), None).order is not None
