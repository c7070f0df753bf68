"""Synthetic traces and the memory simulator behind the stage-1 / stage-2 utilization figures."""

import pytest

from tinypaged.lab import memory_sim, workloads
from tinypaged.lab.workloads import TraceRequest


# -- traces -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sharegpt", "alpaca"])
def test_trace_means_match_the_paper(name):
    shape = workloads.SHAPES[name]
    pooled = []
    for seed in range(4):
        trace = workloads.make_trace(name, 2000, seed=seed)
        s = workloads.summarize(trace)
        assert abs(s["mean_input"] / shape.paper_mean_input - 1) < 0.05, (seed, s)
        assert abs(s["mean_output"] / shape.paper_mean_output - 1) < 0.05, (seed, s)
        assert s["median_output"] < s["mean_output"]  # right-skewed
        assert s["max_total"] <= workloads.MAX_SEQ_LEN
        pooled += trace
    s = workloads.summarize(pooled)
    assert abs(s["mean_input"] / shape.paper_mean_input - 1) < 0.03
    assert abs(s["mean_output"] / shape.paper_mean_output - 1) < 0.03


def test_traces_are_seeded_and_deterministic():
    assert workloads.sharegpt_like(200, seed=3) == workloads.sharegpt_like(200, seed=3)
    assert workloads.sharegpt_like(200, seed=3) != workloads.sharegpt_like(200, seed=4)
    timed = workloads.alpaca_like(100, seed=1, rate=5.0)
    arrivals = [r.arrival_time for r in timed]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert 100 / 5.0 * 0.6 < arrivals[-1] < 100 / 5.0 * 1.4  # Poisson: mean gap 1 / rate
    assert all(r.arrival_time == 0.0 for r in workloads.alpaca_like(10))
    small = workloads.sharegpt_like(200, seed=3, scale=0.25)
    assert sum(r.total_len for r in small) < 0.3 * sum(r.total_len for r in workloads.sharegpt_like(200, seed=3))
    req = workloads.sharegpt_like(1)[0]
    ids = workloads.prompt_token_ids(req, 1000)
    assert len(ids) == req.prompt_len and ids == workloads.prompt_token_ids(req, 1000)


# -- the simulator ----------------------------------------------------------------------------
def test_simulator_hand_checked_case():
    """8 slots, oracle: two 4-token requests fill the arena while the third waits for two steps."""
    trace = [TraceRequest(i, 2, 2) for i in range(3)]
    r = memory_sim.simulate(trace, 8, "contiguous", "oracle")
    # step 1 prefills both prompts: 2 + 2 token states of 4 + 4 reserved; step 2 decodes: 3 + 3 (the last
    # sampled token's keys and values are never written); then both leave and the third runs alone
    assert (r.steps, r.busy_steps) == (4, 2)
    assert r.token_states == pytest.approx((4 / 8 + 6 / 8) / 2)
    assert r.reservation == pytest.approx((4 / 8 + 2 / 8) / 2)
    assert r.internal_fragmentation == r.external_fragmentation == r.free == 0
    assert r.mean_resident == 2


def test_simulator_counts_external_fragmentation_only_when_the_slots_would_suffice():
    """10 slots: A(2) B(6) C(2) admitted, D(4) waits. A and C leave after one step: 4 slots are free,
    enough for D, but in two 2-slot holes around B, so D waits until B is gone."""
    trace = [TraceRequest(0, 1, 1), TraceRequest(1, 1, 5), TraceRequest(2, 1, 1), TraceRequest(3, 3, 1)]
    rows = ["".join(map(str, row)) for row in memory_sim.memory_map(trace, 10, "contiguous", "oracle")]
    # 0 free, 1 token state, 2 reservation, 4 external fragmentation
    assert rows == ["1212222212", "4411222244", "4411122244", "4411112244", "4411111244", "1112000000"]
    r = memory_sim.simulate(trace, 10, "contiguous", "oracle")
    assert (r.steps, r.busy_steps) == (6, 5)
    assert r.external_fragmentation == pytest.approx(4 * 4 / 10 / 5)  # 4 scattered slots in 4 of 5 busy steps
    assert r.token_states == pytest.approx((3 + 2 + 3 + 4 + 5) / 10 / 5)
    total = r.token_states + r.reservation + r.internal_fragmentation + r.external_fragmentation + r.free
    assert total == pytest.approx(1.0)
    # with too few free slots in total the waiting is not fragmentation: counted as free
    r = memory_sim.simulate(trace[:2] + [TraceRequest(2, 1, 1), TraceRequest(3, 4, 1)], 10, "contiguous", "oracle")
    assert r.external_fragmentation == 0 and r.free > 0


@pytest.fixture(scope="module")
def sharegpt_reports():
    return memory_sim.compare_policies(workloads.sharegpt_like(300, seed=0), 16384)


@pytest.fixture(scope="module")
def alpaca_reports():
    return memory_sim.compare_policies(workloads.alpaca_like(1000, seed=0), 4096)


@pytest.mark.parametrize("which", ["sharegpt_reports", "alpaca_reports"])
def test_simulator_invariants(which, request):
    reports = request.getfixturevalue(which)
    by = {r.name: r for r in reports}
    for r in reports:
        parts = (r.token_states, r.reservation, r.internal_fragmentation, r.external_fragmentation, r.free)
        assert all(p >= 0 for p in parts) and sum(parts) <= 1 + 1e-9
        assert sum(parts) == pytest.approx(1.0)  # every slot is accounted for
        assert r.busy_steps > 0.6 * r.steps  # the budget keeps memory the bottleneck
    paged, oracle, pow2, mx = by["paged (block 16)"], by["contiguous oracle"], by["contiguous pow2"], by["contiguous max"]
    assert paged.utilization >= oracle.utilization >= mx.utilization
    assert paged.token_states > 0.85 > oracle.token_states
    assert paged.external_fragmentation == 0 and paged.reservation == 0
    assert oracle.internal_fragmentation == 0 and oracle.external_fragmentation > 0.05  # first-fit holes
    assert pow2.internal_fragmentation > 0 and mx.internal_fragmentation > pow2.internal_fragmentation
    assert mx.mean_resident == mx.capacity_tokens // 2048  # every request reserves max_model_len
    assert paged.mean_resident > oracle.mean_resident > pow2.mean_resident > mx.mean_resident


def test_paged_utilization_matches_the_block_tail_theory_on_sharegpt(sharegpt_reports):
    paged = sharegpt_reports[-1]
    assert abs(paged.utilization - paged.theory_utilization) < 0.005
    assert paged.mean_resident / sharegpt_reports[0].mean_resident > 3  # paper: 30.42 / 7.00 = 4.3x vs max


def test_larger_blocks_waste_more():
    trace = workloads.sharegpt_like(150, seed=1)
    utils = [memory_sim.simulate(trace, 16384, "paged", block_size=bs).utilization for bs in (1, 16, 256)]
    assert utils[0] == pytest.approx(1.0) and utils[0] > utils[1] > utils[2]


def test_paged_memory_map_has_no_reservation_and_counts_tokens():
    trace = workloads.alpaca_like(40, seed=2)
    rows = memory_sim.memory_map(trace, 512, "paged", block_size=16, max_steps=30)
    assert len(rows) == 30 and all(len(row) == 512 for row in rows)
    assert all(memory_sim.RESERVED not in row and memory_sim.EXTERNAL not in row for row in rows)
    blocks, admitted = 0, 0  # step 0: requests admitted in order while their prompt fits (the prefill)
    for r in trace:
        need = -(-r.prompt_len // 16)
        if blocks + need > 32:
            break
        blocks, admitted = blocks + need, admitted + 1
    assert rows[0].count(memory_sim.TOKEN) == sum(r.prompt_len for r in trace[:admitted])
    assert rows[0].count(memory_sim.TOKEN) + rows[0].count(memory_sim.INTERNAL) == blocks * 16


def test_a_request_that_can_never_fit_is_refused():
    with pytest.raises(ValueError, match="never run"):
        memory_sim.simulate([TraceRequest(0, 100, 100)], 150, "paged")
    with pytest.raises(ValueError, match="never run"):
        memory_sim.simulate([TraceRequest(0, 10, 10)], 1000, "contiguous", "max")  # reserves 2048
    with pytest.raises(ValueError, match="kv_cache"):
        memory_sim.simulate([TraceRequest(0, 10, 10)], 1000, "virtual")
