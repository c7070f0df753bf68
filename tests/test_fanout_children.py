"""n > 1 with ``parallel_sampling="fanout"``: child requests in the core, as vLLM v1's ``ParentRequest`` (issue #47).

The front end (``LLMEngine``) fans a request out into ``n`` child requests ``"k_<id>"`` with seeds ``seed + k``; the
core schedules each as a request of its own, so ending one sample (a stop string, an EOS) is ending one request,
and the parent's output joins the children's samples in index order. ``parallel_sampling="fork"`` (the paper's
copy-on-write samples) keeps one request in the core.
"""

from __future__ import annotations

import pytest

from tinypaged import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("shared_weights")

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}


def tiny(**knobs):
    return LLM("tiny", dtype="float32", device="cpu", block_size=4, num_gpu_blocks_override=64, seed=0, **knobs)


def test_the_core_holds_one_child_request_per_sample():
    llm = tiny(parallel_sampling="fanout")
    engine = llm.llm_engine
    engine.add_request("r", PROMPT, SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=4, ignore_eos=True))
    assert list(engine.requests) == ["r"]  # the caller's view: one request
    assert sorted(engine.core.requests) == ["0_r", "1_r", "2_r"]  # the core's: one per sample
    assert all(len(req.seqs) == 1 and req.params.n == 1 for req in engine.core.requests.values())
    assert [engine.core.requests[f"{k}_r"].params.seed for k in range(3)] == [11, 12, 13]
    outs = [o for step in engine.run_until_done(["r"]) for o in step.finished]
    assert [o.request_id for o in outs] == ["r"] and [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert not engine.requests and not engine.core.requests and not engine.parent_of and engine.kv.usage == 0


def test_sample_k_is_the_request_with_seed_plus_k():
    sp = SamplingParams(n=3, seed=21, temperature=1.0, max_tokens=6, ignore_eos=True)
    fanned = tiny(parallel_sampling="fanout").generate([PROMPT], sp)[0]
    alone = tiny().generate([PROMPT] * 3, [SamplingParams(seed=21 + k, temperature=1.0, max_tokens=6, ignore_eos=True)
                                           for k in range(3)])
    assert [c.token_ids for c in fanned.outputs] == [o.outputs[0].token_ids for o in alone]
    forked = tiny(parallel_sampling="fork").generate([PROMPT], sp)[0]  # the paper's forks: the same seeds
    assert [c.token_ids for c in forked.outputs] == [c.token_ids for c in fanned.outputs]


def test_a_sample_that_stops_ends_its_child_alone_and_an_abort_ends_them_all():
    llm = tiny(parallel_sampling="fanout")
    engine = llm.llm_engine
    sp = SamplingParams(n=2, seed=1, temperature=1.0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", PROMPT, sp)
    engine.add_request("b", PROMPT, SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=2, ignore_eos=True))
    step = engine.step()  # prefill of the four children
    while "b" in engine.requests:
        step = engine.step()
    assert [o.request_id for o in step.finished] == ["b"]
    assert sorted(engine.core.requests) == ["0_a", "1_a"]
    # one child of "a" ends by itself (as a stop string would end it): the other runs on
    seq0 = engine.core.requests["0_a"].seqs[0]
    assert engine.core.stop_sample(seq0, "x") is not None and sorted(engine.core.requests) == ["1_a"]
    assert "a" in engine.requests
    engine.abort_request("a")
    assert not engine.requests and not engine.core.requests and not engine.parent_of
    assert not engine.has_unfinished_requests() and engine.kv.usage == 0
