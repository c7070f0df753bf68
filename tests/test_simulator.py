"""The discrete-event simulator drives the real scheduler and KV managers: it must schedule exactly as
the engine does, finish every request, and its cost models must mean what they say."""

import math

import pytest

from tinypaged import LLM
from tinypaged.lab.serving import (PAPER_KV_TOKENS, BatchShape, StepRecord, quiet, replay, serving_trace, shared_weights,
                               system_config, with_rate)
from tinypaged.lab.simulator import (OPT13B_A100, LinearCostModel, ModelFreeEngine, RooflineCostModel, StepCostModel,
                                 check_against,
                                 knee_rates, paper_setup, simulate, sweep, validate)

pytestmark = pytest.mark.usefixtures("one_thread")

FIXED = LinearCostModel(per_step=0.01, per_token=0.001, per_seq=0.0005, per_context=0.0)


def _schedule(run):
    return [(s.shape.num_seqs, s.shape.num_prefill_tokens, s.shape.num_decode_tokens, s.shape.context_tokens,
             s.batch_slots) for s in run.steps]


@pytest.mark.parametrize("system,kv_tokens", [("static", 400), ("orca-pow2", 400), ("vllm", 400), ("vllm", 160)])
def test_simulator_schedules_exactly_like_the_engine(system, kv_tokens):
    """All requests queued at once, so no timing is involved: the simulator's step-by-step batches
    (sizes, prefill and decode tokens, context read) equal the engine's, preemptions included."""
    trace = serving_trace("sharegpt", 14, None, seed=3, scale=1 / 16)
    common = dict(max_model_len=128, kv_cache_tokens=kv_tokens, block_size=8, max_num_seqs=8,
                  max_num_batched_tokens=128)
    with quiet(), shared_weights():
        real = replay(LLM("tiny", device="cpu", **system_config(system, **common)), trace, system)
    sim = simulate(trace, FIXED, system, **common)
    assert _schedule(sim) == _schedule(real)
    assert sim.num_preemptions == real.num_preemptions
    if kv_tokens == 160:
        assert sim.num_preemptions > 0, "the small cache should force preemptions"
    assert [r.output_len for r in sim.requests] == [r.output_len for r in real.requests]


def test_every_request_finishes_with_its_length_and_times_add_up():
    trace = serving_trace("alpaca", 60, rate=4.0, seed=1, scale=0.5)
    run = simulate(trace, FIXED, "vllm", 4.0, **paper_setup(0.5, kv_tokens=600, max_num_seqs=16))
    assert sorted(int(r.request_id) for r in run.requests) == list(range(60))
    by_id = {r.request_id: t for t, r in zip(trace, trace)}
    for r in run.requests:
        t = by_id[int(r.request_id)]
        assert (r.prompt_len, r.output_len) == (t.prompt_len, t.output_len)
        assert math.isclose(r.arrival, t.arrival_time)
        assert r.arrival < r.first_token <= r.finished
        assert math.isclose(r.normalized_latency, (r.finished - r.arrival) / r.output_len)
    # the virtual clock only moves forward, one cost-model step at a time
    for a, b in zip(run.steps, run.steps[1:]):
        assert a.end <= b.start
        assert math.isclose(a.duration, FIXED(a.shape))
    # tokens computed = prompts + every output token but the last (recompute would add more)
    computed = sum(s.shape.num_tokens for s in run.steps)
    assert computed >= sum(r.prompt_len + r.output_len - 1 for r in run.requests)


def test_simulation_is_deterministic():
    trace = serving_trace("sharegpt", 40, rate=2.0, seed=2, scale=0.25)
    a = simulate(trace, OPT13B_A100, "orca-oracle", 2.0, **paper_setup(0.25))
    b = simulate(trace, OPT13B_A100, "orca-oracle", 2.0, **paper_setup(0.25))
    assert a.summary() == b.summary()


def test_contiguous_max_admits_kv_over_max_model_len_at_once():
    setup = paper_setup(1.0)  # 15,728 tokens, max_model_len 2048: 7 regions of 2048
    trace = serving_trace("sharegpt", 30, None, seed=0)
    run = simulate(trace, OPT13B_A100, "orca-max", **setup)
    assert max(s.num_seqs for s in run.steps) == PAPER_KV_TOKENS // 2048 == 7


def test_paged_batches_more_than_every_contiguous_policy_under_load():
    """The paper's Figure 13 ordering: vLLM > Oracle > Pow2 > Max requests batched at once."""
    trace = serving_trace("sharegpt", 150, None, seed=0)
    sw = sweep(trace, OPT13B_A100, [6.0], ["orca-max", "orca-pow2", "orca-oracle", "vllm"], **paper_setup())
    b = {s: v[0] for s, v in sw.batched.items()}
    assert b["vllm"] > b["orca-oracle"] > b["orca-pow2"] > b["orca-max"]
    lat = {s: v[0] for s, v in sw.latency.items()}
    assert lat["vllm"] < lat["orca-oracle"] < lat["orca-max"]


def test_roofline_decode_is_bound_by_reading_the_weights_and_prefill_by_arithmetic():
    decode = BatchShape(num_seqs=1, num_decode_tokens=1, context_tokens=1, attention_pairs=1)
    assert math.isclose(OPT13B_A100(decode), (26e9 + 2 * 819200) / 1555e9)
    prefill = BatchShape.of([(0, 2048, True)])
    flops = 2 * 13e9 * 2048 + 4 * 40 * 5120 * (2048 * 2049 // 2)
    assert math.isclose(OPT13B_A100(prefill), flops / 312e12)
    assert OPT13B_A100.kv_bytes_per_token == 800 * 1024
    # doubling a decode batch barely changes a memory-bound step: the GPU gets busier, not slower
    b8 = BatchShape.of([(500, 1, False)] * 8)
    b16 = BatchShape.of([(500, 1, False)] * 16)
    assert OPT13B_A100(b16) < 1.5 * OPT13B_A100(b8)


def test_batch_shape_counts_attention_work():
    s = BatchShape.of([(10, 1, False), (0, 4, True), (4, 3, True)])
    assert (s.num_seqs, s.num_decode_tokens, s.num_prefill_tokens, s.num_tokens) == (3, 1, 7, 8)
    assert s.context_tokens == 11 + 4 + 7
    assert s.attention_pairs == 11 + (1 + 2 + 3 + 4) + (5 + 6 + 7)


def test_linear_cost_model_fit_recovers_known_costs_and_stays_non_negative():
    true = LinearCostModel(0.004, 0.0002, 0.0007, 3e-6)
    steps, t = [], 0.0
    for i in range(40):
        shape = BatchShape.of([(i * 3 % 50, 1 + (i % 5) * (i % 3), True)] * (1 + i % 7))
        steps.append(StepRecord(t, t + true(shape), shape, shape.num_seqs))
        t += true(shape)
    fit = LinearCostModel.fit(steps)
    for a, b in zip(fit.coefficients, true.coefficients):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
    # a cost that falls with batch size cannot be fitted with a negative coefficient
    noisy = [StepRecord(0, 0.01 - 0.0001 * s.shape.num_seqs, s.shape, 1) for s in steps]
    assert all(c >= 0 for c in LinearCostModel.fit(noisy).coefficients)
    with pytest.raises(ValueError, match="at least"):
        LinearCostModel.fit(steps[:3])


def test_step_cost_model_learns_a_staircase_in_batch_size_and_falls_back_to_the_line():
    line = LinearCostModel(0.001, 0.0, 0.0005, 0.0)
    jump = lambda n: 0.0015 if n >= 4 else 0.0  # noqa: E731  (a kernel switch at 4 sequences, as on this CPU)
    steps = []
    for i in range(400):
        n = 1 + i % 8  # batches of 1-8 only
        shape = BatchShape.of([(10, 1, False)] * n)
        steps.append(StepRecord(0, line(shape) + jump(n), shape, n))
    fit = StepCostModel.fit(steps)
    lin = LinearCostModel.fit(steps)
    for n in range(1, 9):
        shape = BatchShape.of([(10, 1, False)] * n)
        assert abs(fit(shape) - (line(shape) + jump(n))) < 1e-4, n  # within 0.1 ms (the ridge shrinks a little)
    # the straight line misses the staircase by far more at the small batches a light load runs
    small = BatchShape.of([(10, 1, "decode")] * 3)
    assert abs(lin(small) - line(small)) > 4 * abs(fit(small) - line(small))
    # batch sizes never seen: no correction beyond the last knot it saw, the line's slope carries on
    assert abs(fit.correction(64) - fit.correction(32)) < 1e-4
    assert StepCostModel.fit(steps[:50]).describe().startswith(LinearCostModel.fit(steps[:50]).describe())


def test_bad_configurations_are_refused_with_the_reason():
    trace = serving_trace("alpaca", 3, None, seed=0)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        simulate(trace, FIXED, "vllm", max_model_len=2048)
    with pytest.raises(ValueError, match="never run"):
        simulate(serving_trace("sharegpt", 5, None, seed=0), FIXED, "orca-max", max_model_len=2048,
                 kv_cache_tokens=1000)
    with pytest.raises(ValueError, match="Unknown system"):
        simulate(trace, FIXED, "tgi", kv_cache_tokens=1000)
    with pytest.raises(ValueError, match="define the system"):
        simulate(trace, FIXED, "vllm", kv_cache_tokens=1000, kv_cache_manager="contiguous")
    from tinypaged.config import EngineConfig

    with pytest.raises(ValueError, match="recompute"):
        ModelFreeEngine(EngineConfig(model="x", device="cpu", kv_cache_tokens=64, preemption_mode="swap"))


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
@pytest.mark.parametrize("knob", [dict(kv_cache_tokens=300), dict(num_gpu_blocks_override=20)])
def test_the_simulator_sizes_its_cache_with_the_engines_sizing(kv_cache, knob):
    """One sizing function (tinypaged.kv.sizing) for both: the same knobs give the same cache."""
    from tinypaged.config import EngineConfig

    common = dict(kv_cache_manager=kv_cache, block_size=8, max_model_len=64, **knob)
    with quiet(), shared_weights():
        real = LLM("tiny", device="cpu", **common).llm_engine.kv
    sim = ModelFreeEngine(EngineConfig(model="tiny", device="cpu", **common)).kv
    [name] = knob
    want = {"kv_cache_tokens": 296 if kv_cache == "paged" else 300, "num_gpu_blocks_override": 20 * 8}[name]
    assert sim.capacity_tokens == real.capacity_tokens == want


def test_the_simulator_refuses_a_cache_smaller_than_a_block_like_the_engine():
    # before: the block manager's "needs at least one block, got num_blocks=0", which named no knob
    words = r"^kv_cache_tokens=4 gives a KV cache of 4 tokens, less than one block of block_size=8 tokens"
    with pytest.raises(ValueError, match=words + r": raise kv_cache_tokens or lower block_size"):
        simulate(serving_trace("alpaca", 3, None, seed=0), FIXED, "vllm", kv_cache_tokens=4, block_size=8)
    with quiet(), pytest.raises(ValueError, match=words + r" \(4096 bytes\): raise kv_cache_tokens"):
        LLM("tiny", device="cpu", kv_cache_tokens=4, block_size=8, max_model_len=64)


def test_roofline_is_a_plain_formula():
    m = RooflineCostModel("toy", params=1e9, weight_bytes=2e9, num_layers=2, hidden=8, kv_bytes_per_token=100,
                          peak_flops=1e12, hbm_bandwidth=1e12, per_step=0.5)
    shape = BatchShape.of([(9, 1, "decode")])
    assert math.isclose(m(shape), max((2e9 + 4 * 2 * 8 * 10) / 1e12, (2e9 + 100 * 11) / 1e12) + 0.5)


def test_rates_of_one_trace_keep_its_lengths():
    trace = serving_trace("sharegpt", 20, None, seed=4, scale=0.125)
    for rate in (1.0, 5.0):
        moved = with_rate(trace, rate, seed=1)
        assert [(r.prompt_len, r.output_len) for r in moved] == [(r.prompt_len, r.output_len) for r in trace]
        assert all(a.arrival_time < b.arrival_time for a, b in zip(moved, moved[1:]))


def test_check_against_reproduces_a_run_made_with_the_same_cost_model():
    """A "measured" run that the simulator itself produced is predicted exactly: the comparison
    rebuilds the same requests and arrivals from the run's records."""
    trace = serving_trace("sharegpt", 30, rate=None, seed=6, scale=1 / 8)
    common = paper_setup(1 / 8, max_num_seqs=16)
    runs = {r: simulate(with_rate(trace, r, seed=2), FIXED, "vllm", r, **common) for r in (5.0, 20.0)}
    for v in check_against(FIXED, runs, **common):
        assert v.error == pytest.approx(0.0, abs=1e-12) and v.step_model_error == pytest.approx(0.0, abs=1e-12)
    other = LinearCostModel(0.02, 0.001, 0.0005, 0.0)  # twice the per-step cost: predicts higher latency
    assert all(v.error > 0 for v in check_against(other, runs, **common))


def test_knee_rates_span_orca_max_to_vllm():
    trace = serving_trace("sharegpt", 40, None, seed=0, scale=1 / 8)
    rates = knee_rates(FIXED, trace, num=3, **paper_setup(1 / 8, max_num_seqs=32))
    assert len(rates) == 3 and rates == sorted(rates) and rates[0] < rates[-1]
    assert all(isinstance(r, float) for r in rates)


def test_fixed_duration_sweeps_replay_rate_times_seconds_requests():
    trace = serving_trace("alpaca", 400, None, seed=0)
    sw = sweep(trace, OPT13B_A100, [2.0, 20.0], ["vllm"], keep_runs=True, duration=10, min_requests=30,
               **paper_setup())
    assert [len(sw.runs[("vllm", r)].requests) for r in (2.0, 20.0)] == [30, 200]
    with pytest.raises(ValueError, match="needs 500 requests"):
        sweep(trace, OPT13B_A100, [50.0], ["vllm"], duration=10, **paper_setup())


def test_validate_measures_each_rate_right_after_its_calibration():
    trace = serving_trace("sharegpt", 10, None, seed=7, scale=1 / 16)
    calibration = serving_trace("sharegpt", 10, None, seed=8, scale=1 / 16)
    common = paper_setup(1 / 16, max_num_seqs=8)
    with quiet(), shared_weights():
        llm = LLM("tiny", device="cpu", **system_config("vllm", **common))
        checks = validate(llm, calibration, trace, [300.0, 600.0], attempts=2, max_step_error=10.0, **common)
    assert [(v.rate, v.attempt) for v in checks] == [(300.0, 1), (600.0, 1)]  # a 1000% bound accepts the first
    assert all(v.measured > 0 and v.predicted > 0 and v.own_steps_predicted > 0 for v in checks)
