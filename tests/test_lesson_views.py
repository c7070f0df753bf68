"""The lessons' read-only views: interfaces without bodies, tables from the manager, memory shares."""

from tinypaged.kv import contiguous
from tinypaged.lab import memory_sim, workloads
from tinypaged.kv.block_manager import BlockManager
from tinypaged.course.lesson_views import block_owners, format_tables, interface, memory_shares
from tinypaged.sampling_params import SamplingParams
from tinypaged.sequence import Sequence


def test_interface_shows_signature_and_contract_not_body():
    text = interface(contiguous.first_fit)
    assert text.startswith("first_fit(holes: list[tuple[int, int]], size: int) -> int | None")
    assert "external fragmentation" in text
    assert "for start, gap in holes" not in text and "return" not in text


def test_tables_and_owners_come_from_the_manager():
    bm = BlockManager(num_blocks=6, block_size=4)
    params = SamplingParams(max_tokens=4)
    a, b = Sequence("a", [5] * 6, params), Sequence("b", [6] * 3, params)
    assert bm.allocate_slots(a, 6) and bm.allocate_slots(b, 3)
    a.num_computed_tokens = 6
    c = a.fork(1, None)
    bm.fork(a, c)
    assert format_tables(bm, {"A": a, "B": b, "C": c}) == "A:[0, 1]  B:[2]  C:[0, 1]"
    assert block_owners(bm, [a, b, c]) == {0: ["a", "a"], 1: ["a", "a"], 2: ["b"]}
    bm.free(b)
    assert format_tables(bm, {"B": b}) == ""


def test_memory_shares_agree_with_memory_sim_on_busy_steps():
    trace = workloads.sharegpt_like(60, seed=1, scale=0.125)
    for kv_cache, policy in (("contiguous", "max"), ("contiguous", "oracle"), ("paged", "max")):
        report = memory_sim.simulate(trace, 1024, kv_cache, policy, block_size=16, max_model_len=256)
        shares = memory_shares(trace, 1024, kv_cache, policy, block_size=16, max_model_len=256)
        assert (shares.steps, shares.busy_steps) == (report.steps, report.busy_steps)
        assert abs(shares.busy_token_share - report.token_states) < 1e-12
        assert 0 < shares.whole_run_token_share <= 1
    # paged: the measured utilization sits between the worst case and a perfect fill
    assert shares.worst_utilization <= report.utilization <= 1
    assert abs(shares.expected_utilization - report.theory_utilization) < 1e-12
