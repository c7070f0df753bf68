"""The CPU step profile (tinypaged.lab.step_profile): its categories add up, and it leaves no hook behind."""

from __future__ import annotations

from tinypaged import LLM, SamplingParams
from tinypaged.lab.step_profile import CATEGORIES, profile_generate


def test_categories_add_up_to_the_step_time_and_hooks_go_away():
    llm = LLM("tiny", device="cpu", max_num_seqs=4, kv_cache_tokens=512, max_model_len=64)
    prompts = [{"prompt_token_ids": list(range(3 + i, 15 + i))} for i in range(4)]
    r = profile_generate(llm, prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert r["steps"] == 5 and r["decode_only"] == 4  # one prefill step, then four decodes
    assert all(r[c] > 0 for c in CATEGORIES if c != "host") and r["host"] >= 0
    assert abs(sum(r[c] for c in CATEGORIES) - r["total"]) < 1e-9
    assert r["steps"] == llm.get_metrics()["num_steps"]
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in llm.llm_engine.model.modules())
    assert [len(o.outputs[0].token_ids) for o in r["outputs"]] == [5] * 4
