"""Real-time replay and per-request serving metrics (TTFT, TPOT, normalized latency), the systems list,
sustainable rates, and the vLLM path of the serving benchmark."""

import math
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tinypaged import LLM, SamplingParams
from tinypaged.lab.serving import (SYSTEM_NAMES, RequestRecord, ServingRun, StepRecord, BatchShape, get_system, quiet,
                               rate_ratios, replay, replay_vllm, scaled_max_model_len, serve_systems, serving_table,
                               serving_trace,
                               shared_weights, sustainable_rate, system_config, vllm_available, with_rate)
from tinypaged.lab.workloads import TraceRequest, summarize

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent


def test_request_metrics_follow_their_definitions():
    r = RequestRecord("a", prompt_len=10, output_len=5, arrival=1.0, first_token=1.5, finished=3.5)
    assert r.ttft == 0.5
    assert r.tpot == (3.5 - 1.5) / 4
    assert r.e2e == 2.5
    assert r.normalized_latency == 2.5 / 5
    one = RequestRecord("b", 3, 1, 0.0, 0.2, 0.2)
    assert one.tpot == 0.0 and one.normalized_latency == 0.2


def test_systems_are_the_papers_and_differ_only_in_their_own_knobs():
    assert SYSTEM_NAMES == ("static", "orca-max", "orca-pow2", "orca-oracle", "vllm")
    assert get_system("vllm").engine_kwargs == {"scheduling_policy": "fcfs", "kv_cache_manager": "paged"}
    assert system_config("orca-pow2", kv_cache_tokens=100, max_num_seqs=4) == {
        "scheduling_policy": "fcfs", "kv_cache_manager": "contiguous", "reservation_policy": "pow2",
        "kv_cache_tokens": 100, "max_num_seqs": 4}
    with pytest.raises(ValueError, match="Unknown system 'orca'"):
        get_system("orca")
    with pytest.raises(ValueError, match="define the system"):
        system_config("static", scheduler_cls="static")


def test_scaled_trace_fits_the_scaled_cap_and_keeps_poisson_arrivals():
    for scale in (1 / 16, 1 / 8, 0.5, 1.0):
        trace = serving_trace("sharegpt", 200, rate=3.0, seed=0, scale=scale)
        cap = scaled_max_model_len(scale)
        assert all(1 <= r.prompt_len and 1 <= r.output_len and r.total_len <= cap for r in trace)
        assert all(a.arrival_time < b.arrival_time for a, b in zip(trace, trace[1:]))
    big = summarize(serving_trace("sharegpt", 400, None, seed=0))
    small = summarize(serving_trace("sharegpt", 400, None, seed=0, scale=1 / 8))
    assert small["mean_output"] == pytest.approx(big["mean_output"] / 8, rel=0.05)
    mean_gap = serving_trace("alpaca", 2000, rate=4.0, seed=1)[-1].arrival_time / 2000
    assert mean_gap == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError, match="scale"):
        serving_trace("alpaca", 3, None, scale=2.0)
    with pytest.raises(ValueError, match="rate"):
        with_rate(serving_trace("alpaca", 3, None), 0.0)


def test_sustainable_rate_interpolates_the_crossing():
    rates, lat = [1, 2, 4, 8], [0.1, 0.2, 0.6, 2.0]
    assert sustainable_rate(rates, lat, 0.4) == pytest.approx(3.0)
    assert sustainable_rate(rates, lat, 5.0) == 8  # never over: the top of the sweep
    assert sustainable_rate(rates, lat, 0.05) == 0.0  # over even at the lowest rate
    assert sustainable_rate(reversed(rates), reversed(lat), 0.4) == pytest.approx(3.0)
    assert rate_ratios({"vllm": 6.0, "orca-max": 2.0, "static": 0.0}) == {"orca-max": 3.0, "static": math.inf}


def test_replay_times_every_request_on_the_real_engine():
    trace = serving_trace("alpaca", 12, rate=200.0, seed=2, scale=0.25)
    with quiet(), shared_weights():
        llm = LLM("tiny", device="cpu", dtype="float32", **system_config("vllm", kv_cache_tokens=512, max_num_seqs=8,
                                                                         max_model_len=512))
        run = replay(llm, trace, "vllm", 200.0)
    assert len(run.requests) == 12
    assert sorted((r.prompt_len, r.output_len) for r in run.requests) == \
        sorted((r.prompt_len, r.output_len) for r in trace)
    for r in run.requests:
        assert r.arrival >= 0 and r.arrival <= r.first_token <= r.finished
        assert r.ttft <= r.e2e and r.normalized_latency > 0
    # no preemption here, so every prompt token and every output token but the last was computed once
    assert run.num_preemptions == 0
    assert sum(s.shape.num_tokens for s in run.steps) == sum(r.prompt_len + r.output_len - 1 for r in trace)
    assert max(s.num_seqs for s in run.steps) <= 8
    m = run.summary()
    assert m["requests"] == 12 and m["useful_slot_share"] == 1.0 and 0 < m["occupancy"] <= 1
    table = serving_table({("vllm", 200.0): run})
    assert "vLLM" in table and "200" in table


def test_serve_systems_replays_the_same_span_of_traffic_at_every_rate():
    trace = serving_trace("alpaca", 30, None, seed=3, scale=0.25)
    common = dict(kv_cache_tokens=512, max_num_seqs=8, max_model_len=512)
    exp = serve_systems("tiny", trace, common, rates=[100.0, 400.0], systems=["vllm", "orca-max"], seconds=0.05,
                        min_requests=8)
    # the closed loop takes the first min_requests; each rate max(min_requests, rate x seconds) of them
    assert {k: len(run.requests) for k, run in exp.runs.items()} == {
        ("vllm", None): 8, ("orca-max", None): 8, ("vllm", 100.0): 8, ("orca-max", 100.0): 8,
        ("vllm", 400.0): 20, ("orca-max", 400.0): 20}
    run = exp.runs[("vllm", 400.0)]
    assert sorted(int(r.request_id.rsplit(":", 1)[-1]) for r in run.requests) == list(range(20))
    assert max(r.arrival for r in run.requests) < 0.2  # 20 arrivals at 400 req/s: about 0.05 s
    with pytest.raises(ValueError, match="needs 40 requests"):
        serve_systems("tiny", trace, common, rates=[800.0], systems=["vllm"], seconds=0.05, min_requests=8)


def test_static_batching_leaves_finished_members_slots_idle():
    trace = serving_trace("sharegpt", 6, None, seed=5, scale=1 / 16)
    with quiet(), shared_weights():
        llm = LLM("tiny", device="cpu", dtype="float32", **system_config("static", kv_cache_tokens=1024,
                                                                         max_num_seqs=6, max_model_len=128))
        run = replay(llm, trace, "static")
    assert max(s.batch_slots for s in run.steps) == 6
    assert run.summary()["useful_slot_share"] < 1.0


def test_contiguous_decode_near_the_end_of_the_arena():
    """A short region at the arena's end decodes next to a long one: the padded gather of its
    context must stay inside the arena, and tokens must match running each request alone."""

    def run(prompts, outs):
        llm = LLM("tiny", device="cpu", dtype="float64", kv_cache_manager="contiguous", reservation_policy="oracle",
                  kv_cache_tokens=40, max_model_len=40)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs])
        return [r.outputs[0].token_ids for r in res]

    a, b = [5 + i for i in range(30)], [7, 8, 9]
    with shared_weights():
        assert run([a, b], [5, 2]) == [run([a], [5])[0], run([b], [2])[0]]


class FakeVLLMEngine:
    """vLLM's LLMEngine API in miniature: one token per running request per step, up to 2 at once."""

    def __init__(self):
        self.running, self.added = {}, []

    def add_request(self, request_id, prompt, params):
        assert isinstance(prompt["prompt_token_ids"], list) and params.ignore_eos
        self.added.append(request_id)
        self.running[request_id] = [params.max_tokens, []]

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outs = []
        for rid in list(self.running)[:2]:
            want, toks = self.running[rid]
            toks.append(1)
            done = len(toks) == want
            outs.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=list(toks))],
                                        finished=done))
            if done:
                del self.running[rid]
        return outs


def test_vllm_replay_drives_the_engine_api_and_times_requests():
    trace = serving_trace("alpaca", 5, rate=None, seed=0, scale=0.1)  # all at t=0: no timing involved
    params = lambda **kw: SimpleNamespace(**kw)  # noqa: E731  (stands in for vllm.SamplingParams)
    run = replay_vllm(FakeVLLMEngine(), trace, params, None, max_num_seqs=2)
    assert len(run.requests) == 5
    assert sorted(r.output_len for r in run.requests) == sorted(r.output_len for r in trace)
    assert all(r.arrival <= r.first_token <= r.finished for r in run.requests)
    assert [s.num_seqs for s in run.steps][0] == 2 and max(s.num_seqs for s in run.steps) == 2
    # a late arrival is added only when its time comes
    late = [TraceRequest(0, 3, 2, 0.0), TraceRequest(1, 3, 2, 0.05)]
    run = replay_vllm(FakeVLLMEngine(), late, params, None)
    first = {r.request_id: r for r in run.requests}
    assert first["vllm-None-1"].first_token >= 0.05


def test_serving_run_summary_weights_steps_equally():
    steps = [StepRecord(0, 1, BatchShape(num_seqs=2), 4), StepRecord(1, 3, BatchShape(num_seqs=4), 4)]
    reqs = [RequestRecord("a", 1, 2, 0.0, 3.0, 3.0)]
    m = ServingRun("static", None, reqs, steps, max_num_seqs=8).summary()
    assert m["batched"] == 3 and m["useful_slot_share"] == 6 / 8 and m["occupancy"] == 3 / 8
    assert m["step_time"] == 1.5 and m["throughput"] == 2 / 3
    # the drain after the last request started is left out of the batch average
    reqs = [RequestRecord("a", 1, 2, 0.0, 1.0, 3.0)]
    assert ServingRun("static", None, reqs, steps, max_num_seqs=8).summary()["batched"] == 2


def test_a_request_not_yet_arrived_waits_and_is_not_a_deadlock():
    """Real-time replay: the head request arrives after the step's time. The scheduler reads one time per step
    (``schedule(now)``: data, not a clock it calls), so the policy and the no-progress check agree that nothing
    could have been scheduled: no error; the request runs in the first step after it arrives."""
    with quiet(), shared_weights():
        engine = LLM("tiny", device="cpu", kv_cache_tokens=256, max_model_len=64).llm_engine
    engine.add_request("late", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), arrival_time=engine.clock() + 0.3)
    assert engine.step().scheduled == []  # not yet arrived at the step's time
    time.sleep(0.35)
    assert [s.seq.request_id for s in engine.step().scheduled] == ["late"]


def test_stage06_references_agree_with_the_engine():
    from tinypaged.course.checks import stage06

    for kv_bytes, dtype, nbytes, bs in ((300_000, "float32", 4, 8), (1 << 19, "float16", 2, 32)):
        assert stage06.kv_blocks(kv_bytes, 2, 2, 16, nbytes, bs) == stage06.engine_blocks(kv_bytes, dtype, bs)
    for num_blocks, bs, mml in ((24, 4, 30), (40, 16, 40)):
        want = int(stage06.max_concurrency(num_blocks, bs, mml))  # vLLM's ratio; its whole part runs at once
        assert stage06.engine_admits(num_blocks, bs, mml, want + 2) == want
