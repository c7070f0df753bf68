"""No callback from a lower layer into a higher one (issue #47): a step walks down and comes back with data.

The layers are pyproject.toml's import-linter contract (course, lab, __main__, entrypoints, llm, engine, worker,
sched, kv | model | sampling, attention, kernels). Imports there already run one way; a callback can still run
the other way at run time (a scheduler calling the engine's clock, a KV manager calling a sink the server gave it).
This test records every Python call while real workloads run (``sys.setprofile``) and fails on a call whose
caller's code lives in a lower layer than the callee's: the offline engine with prefix caching, swap preemption
and forked samples, stop strings, a stream, beam search, the in-process server's loop, the process engine core's
message handling, KV events, and the lab's model-free simulator. ``find_upcalls`` is checked on its own first,
with a callback it must catch. One caller is exempt: ``interfaces.py``, whose Protocol checks read the attributes
of the object they are given to check (``require``).
"""

from __future__ import annotations

import os
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from tinypaged import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = str(ROOT / "tinypaged") + os.sep
KERNELS = str(ROOT / "kernels") + os.sep
CHECKER = str(ROOT / "tinypaged" / "interfaces.py")


def _ranks() -> dict[str, int]:
    """Module prefix -> rank (higher layers rank higher)."""
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    rank = {}
    for i, entry in enumerate(layers):
        for name in entry.strip("()").split("|"):
            rank[name.strip()] = len(layers) - i
    return rank


RANK = _ranks()


def layer_of(filename: str) -> int | None:
    """The rank of the layer a source file belongs to; None outside tinypaged (tests, libraries, plug-ins)."""
    if filename.startswith(KERNELS):
        return RANK["kernels"]
    if not filename.startswith(PACKAGE):
        return None
    parts = Path(filename[len(PACKAGE):]).with_suffix("").parts
    for name in (parts[0],):
        if name in RANK:
            return RANK[name]
    return None  # a module no layer names (the package's own __init__, say): not judged


class UpcallRecorder:
    """Counts calls from a lower layer's code into a higher layer's, while active."""

    def __init__(self):
        self.found: Counter = Counter()

    def _profile(self, frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee = layer_of(frame.f_code.co_filename)
        if callee is None:
            return
        caller_file = frame.f_back.f_code.co_filename
        if caller_file == CHECKER:  # the Protocols' run-time checks read the objects they are handed to check
            return
        caller = layer_of(caller_file)
        if caller is not None and caller < callee:
            def where(f):
                return f"{Path(f.f_code.co_filename).relative_to(ROOT)}:{f.f_code.co_name}"

            self.found[f"{where(frame.f_back)} -> {where(frame)}"] += 1

    def __enter__(self):
        import threading

        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        import threading

        sys.setprofile(None)
        threading.setprofile(None)


def find_upcalls(run) -> list[str]:
    with UpcallRecorder() as rec:
        run()
    return sorted(rec.found)


def _call_from(path: str, fn, *args):
    """``fn(*args)`` called from code that counts as ``tinypaged/<path>`` (compiled under that file name)."""
    scope = {"fn": fn, "args": args}
    exec(compile("result = fn(*args)", str(ROOT / "tinypaged" / path), "exec"), scope)
    return scope["result"]


def test_the_recorder_catches_a_call_upward_and_lets_calls_downward_pass():
    from tinypaged.engine.core import EngineCore
    from tinypaged.sampling.sampler import sample_generator

    started = type("Core", (), {"_t0": 0.0})()  # what EngineCore.clock reads
    up = find_upcalls(lambda: _call_from("sched/scheduler.py", EngineCore.clock, started))
    assert up == ["tinypaged/sched/scheduler.py:<module> -> tinypaged/engine/core.py:clock"]
    assert find_upcalls(lambda: _call_from("engine/core.py", sample_generator, 1, 2)) == []
    assert find_upcalls(lambda: _call_from("sched/scheduler.py", sample_generator, 1, 2)) == []


@pytest.fixture(scope="module")
def engines(shared_weights):
    from tinypaged.lab.serving import quiet

    base = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=4, seed=0)
    with quiet():
        tight = LLM("tiny", num_gpu_blocks_override=10, enable_prefix_caching=True, enable_kv_cache_events=True,
                    preemption_mode="swap", swap_space=1, **base)
        roomy = LLM("tiny", num_gpu_blocks_override=64, **base)
    return tight, roomy


PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}, {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 10, 11]}]


def test_no_upcall_in_the_offline_engine(engines):
    from tinypaged.sampling_params import BeamSearchParams

    tight, roomy = engines
    got = []
    tight.llm_engine.set_kv_event_sink(got.append)

    def run():
        tight.generate(PROMPTS * 3, SamplingParams(n=2, max_tokens=12, ignore_eos=True, seed=1, temperature=1.0))
        roomy.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, stop=["a", "the"]))
        for _ in roomy.generate_stream(PROMPTS, SamplingParams(max_tokens=4)):
            pass
        roomy.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3))

    try:
        found = find_upcalls(run)
    finally:
        tight.llm_engine.set_kv_event_sink(None)
    assert got and tight.llm_engine.counters["num_steps"] > 0  # the workload ran: events, preemptions, forks
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert found == []


def test_no_upcall_in_the_server_loop_and_the_process_core(engines):
    import threading

    from tinypaged.entrypoints import engine_core as ec
    from tinypaged.entrypoints.engine_loop import EngineLoop

    _, roomy = engines
    engine = roomy.llm_engine

    class Outbox:
        def __init__(self):
            self.sent = []

        def send(self, data, *flags, **kw):
            self.sent.append(data)

    def run():
        loop = EngineLoop(engine, engine.detokenizer.stream_text).start()
        done = threading.Event()
        events = []

        def deliver(ev):
            events.append(ev)
            if ev.finished:
                done.set()

        try:
            loop.submit("s0", PROMPTS[0], SamplingParams(max_tokens=5, temperature=0), deliver)
            assert done.wait(60)
        finally:
            loop.stop()
        proc = ec.EngineCoreProc(engine.core, None, Outbox(), os.getppid())
        params = ec.params_message(SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8))
        proc.handle(ec.Add("p0", None, [1, 2, 3, 4, 5], params))
        proc.handle(ec.GetMetrics(1))
        while engine.has_unfinished_requests():
            proc.step()
        assert not proc.live

    assert find_upcalls(run) == []


def test_no_upcall_in_the_lab_simulator():
    from tinypaged.config import EngineConfig
    from tinypaged.lab.simulator import ModelFreeEngine

    def run():
        sim = ModelFreeEngine(EngineConfig(model="tiny", kv_cache_tokens=64, block_size=4, max_model_len=64,
                                           max_num_seqs=4, enable_prefix_caching=True))
        for i in range(6):
            sim.add(f"r{i}", [1, 2, 3, 4, 5, 6, i], 5, arrival=0.1 * i)
        now = 0.0
        while sim.has_unfinished():
            sim.schedule(now)
            now += 0.05
            sim.complete(now)

    assert find_upcalls(run) == []
