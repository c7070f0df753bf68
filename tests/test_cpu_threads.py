"""The CPU thread/binding choice (tinypaged.model.cpu_threads) and the benchmark's bounded busy neighbour; and
``enforce_eager`` on a CPU (one forward: the knob changes nothing there)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tinypaged import LLM, SamplingParams
from tinypaged.model import cpu_threads
from tinypaged.model.cpu_threads import busy_neighbour, parse_cores, plan_cpu_threads


def test_enforce_eager_is_the_default_and_a_cpu_runs_the_same_forward_either_way():
    """vLLM's knob: False replays CUDA graphs on a GPU (tests/test_cuda_graphs.py); a CPU has no graphs here and
    runs the one eager forward: the same tokens, the same backend."""
    prompt, greedy = [{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=6)
    eager = LLM("tiny", device="cpu", kv_cache_tokens=256)
    other = LLM("tiny", device="cpu", kv_cache_tokens=256, enforce_eager=False)
    assert eager.llm_engine.config.enforce_eager is True and other.llm_engine.runner.graphs is None
    assert other.llm_engine.config.attention_backend == eager.llm_engine.config.attention_backend == "sdpa"
    assert other.generate(prompt, greedy)[0].outputs[0].token_ids == eager.generate(prompt, greedy)[0].outputs[0].token_ids
    with pytest.raises(TypeError, match="enforce_eager must be True or False, got 'no'"):
        LLM("tiny", device="cpu", kv_cache_tokens=256, enforce_eager="no")


# -- threads and binding ---------------------------------------------------------------------------
def test_an_explicit_omp_num_threads_is_kept(monkeypatch):
    monkeypatch.delenv(cpu_threads.BIND_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert plan_cpu_threads(allowed=[0, 1], busy=set()).cores is None  # nobind: the user's thread count stays
    monkeypatch.setenv(cpu_threads.BIND_ENV, "auto")  # unless the binding is asked for by name
    assert plan_cpu_threads(allowed=[0, 1], busy=set()).cores == (0, 1)


def test_auto_binds_the_free_cores_and_reserves_one_beyond_two(monkeypatch):
    monkeypatch.delenv(cpu_threads.BIND_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(cpu_threads.RESERVED_ENV, raising=False)
    quiet2 = plan_cpu_threads(allowed=[0, 1], busy=set())
    assert (quiet2.threads, quiet2.cores) == (2, (0, 1))
    busy2 = plan_cpu_threads(allowed=[0, 1], busy={1})  # a busy neighbour: one thread on the free core
    assert (busy2.threads, busy2.cores) == (1, (0,)) and "core(s) 1 busy" in busy2.describe()
    all_busy = plan_cpu_threads(allowed=[0, 1], busy={0, 1})
    assert all_busy.threads == 1
    eight = plan_cpu_threads(allowed=range(8), busy={2})  # one core left for the front end, as vLLM
    assert eight.cores == (0, 1, 3, 4, 5, 6) and eight.threads == 6
    monkeypatch.setenv(cpu_threads.RESERVED_ENV, "0")
    assert plan_cpu_threads(allowed=range(4), busy=set()).threads == 4


def test_explicit_binding_and_clear_errors(monkeypatch):
    monkeypatch.setenv(cpu_threads.BIND_ENV, "0-1,3")
    plan = plan_cpu_threads(allowed=range(4), busy={0, 1, 3})  # explicit: the load is not consulted
    assert (plan.threads, plan.cores) == (3, (0, 1, 3))
    assert plan_cpu_threads(bind="nobind", allowed=range(4)).cores is None
    assert parse_cores("2, 0-1") == (0, 1, 2)
    with pytest.raises(ValueError, match="TINYPAGED_CPU_OMP_THREADS_BIND='1-0'"):
        parse_cores("1-0")
    with pytest.raises(ValueError, match="names core\\(s\\) 5"):
        plan_cpu_threads(bind="0,5", allowed=range(2))
    monkeypatch.setenv(cpu_threads.BIND_ENV, "auto")
    monkeypatch.setenv(cpu_threads.RESERVED_ENV, "2")
    with pytest.raises(ValueError, match="TINYPAGED_CPU_NUM_OF_RESERVED_CPU=2 reserves every core"):
        plan_cpu_threads(allowed=[0, 1], busy=set())
    monkeypatch.setenv(cpu_threads.RESERVED_ENV, "-1")
    with pytest.raises(ValueError, match="TINYPAGED_CPU_NUM_OF_RESERVED_CPU='-1'"):
        plan_cpu_threads(allowed=[0, 1], busy=set())


def test_apply_sets_threads_and_affinity():
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("affinity is Linux-only")
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = min(affinity)
    try:
        cpu_threads.apply_cpu_threads(cpu_threads.CPUThreads(1, (core,), "test"))
        assert os.sched_getaffinity(0) == {core} and torch.get_num_threads() == 1
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


# -- the benchmark's busy neighbour ----------------------------------------------------------------
def test_busy_neighbour_is_pinned_bounded_and_killed():
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("the burner pins a core: Linux-only")
    core = max(os.sched_getaffinity(0))
    with busy_neighbour(core, 30) as proc:
        deadline = time.monotonic() + 10
        while os.sched_getaffinity(proc.pid) != {core} and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None and os.sched_getaffinity(proc.pid) == {core}
    assert proc.returncode is not None  # killed and reaped when the block ends: no orphan
    t0 = time.monotonic()
    with busy_neighbour(core, 0.3) as proc:  # and it ends on its own at its bound
        proc.wait(timeout=20)
        assert proc.returncode == 0
    assert time.monotonic() - t0 < 20
    with pytest.raises(ValueError, match="seconds=0"):
        with busy_neighbour(core, 0):
            pass
    with pytest.raises(ValueError, match="core 999"):
        with busy_neighbour(999, 1):
            pass


def test_the_offline_llm_applies_the_thread_plan_once_per_process(monkeypatch):
    """``LLM(...)`` on a CPU runs under the plan above, applied by the first engine of the process (as vLLM's CPU
    worker binds at start-up); later engines, and a plan a benchmark applied by hand, are not re-planned."""
    from tinypaged import LLM

    applied = []
    monkeypatch.setattr(cpu_threads, "_APPLIED", None)
    monkeypatch.setattr(cpu_threads, "plan_cpu_threads",
                        lambda: applied.append(1) or cpu_threads.CPUThreads(torch.get_num_threads(), None, "test"))
    for _ in range(2):
        LLM("tiny", device="cpu", dtype="float32", kv_cache_tokens=64)
    assert applied == [1] and cpu_threads.ensure_cpu_threads() == (cpu_threads._APPLIED, False)
    by_hand = cpu_threads.CPUThreads(torch.get_num_threads(), None, "by hand")
    cpu_threads.apply_cpu_threads(by_hand)
    LLM("tiny", device="cpu", dtype="float32", kv_cache_tokens=64)
    assert applied == [1] and cpu_threads._APPLIED is by_hand
