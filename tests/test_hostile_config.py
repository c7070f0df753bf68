"""Hostile input to the knobs: every bad value is a clear TypeError / ValueError naming the knob, raised
before any work (no model load, no step); the contradictions between knobs are errors naming both.

Covers EngineConfig, SamplingParams, BeamSearchParams, the model loader and the command line.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinypaged.engine.core as llm_engine
from tinypaged import LLM, BeamSearchParams, EngineConfig, SamplingParams
from tinypaged.__main__ import main
from tinypaged.config import BOOLS, NUMBERS, OPTIONAL
from tinypaged.kv.block_manager import BlockManager
from tinypaged.kv.contiguous import ContiguousKVManager
from tinypaged.sched.policies import FcfsOrder, PlanPolicy, schedule_step
from tinypaged.sched.registry import make_scheduler
from tinypaged.sched.static import StaticScheduler

pytestmark = pytest.mark.usefixtures("shared_weights")

REPO = Path(__file__).resolve().parents[1]
TINY = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks_override=64)


def config(**kw):
    return EngineConfig(**{"model": "tiny", "device": "cpu", **kw})


@pytest.fixture
def no_model_load(monkeypatch):
    """A config error must come before the weights are read."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the configuration was checked")

    monkeypatch.setattr(llm_engine, "load_model", refuse)


# -- EngineConfig: each knob on its own ---------------------------------------------------------------
@pytest.mark.parametrize("kw, error, words", [
    (dict(enable_prefix_caching="False"), TypeError, r"enable_prefix_caching must be True or False, got 'False'"),
    (dict(enable_chunked_prefill="False"), TypeError, r"enable_chunked_prefill must be True or False.*'False'"),
    (dict(check_invariants=1), TypeError, r"check_invariants must be True or False.*got 1"),
    (dict(enforce_eager="yes"), TypeError, r"enforce_eager must be True or False, got 'yes'"),
    (dict(max_num_seqs=2.5), TypeError, r"max_num_seqs must be an integer >= 1, got 2.5"),
    (dict(max_num_seqs=True), TypeError, r"max_num_seqs must be an integer"),
    (dict(max_model_len=2.5), TypeError, r"max_model_len must be an integer >= 1.*got 2.5"),
    (dict(block_size=1.5), TypeError, r"block_size must be an integer >= 1.*got 1.5"),
    (dict(block_size="16"), TypeError, r"block_size must be an integer >= 1.*got '16'"),
    (dict(block_size=0), ValueError, r"block_size must be an integer >= 1.*got 0"),
    (dict(gpu_memory_utilization="0.9"), TypeError, r"gpu_memory_utilization must be a number in \(0, 1\], got '0.9'"),
    (dict(gpu_memory_utilization=math.nan), ValueError, r"gpu_memory_utilization must be a number in \(0, 1\]"),
    (dict(num_gpu_blocks_override=2.5), TypeError, r"num_gpu_blocks_override must be an integer >= 1.*got 2.5"),
    (dict(swap_space=-1), ValueError, r"swap_space must be a number of GiB >= 0, got -1"),
    (dict(swap_space=math.inf), ValueError, r"swap_space must be a number of GiB >= 0, got inf"),
    (dict(seed="x"), TypeError, r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\].*got 'x'"),
    (dict(seed=2**64), ValueError, r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
    (dict(history_size=-1), ValueError, r"history_size must be an integer >= 0.*got -1"),
    (dict(device=None), TypeError, r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got None"),
    (dict(device="cudax"), ValueError, r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'cudax'"),
    (dict(model=None), TypeError, r"model must be a model name \('smollm2-135m', 'tiny'\) or the path"),
    (dict(model=""), TypeError, r"model must be a model name"),
    (dict(kv_cache_manager=None), TypeError, r"kv_cache_manager must be 'paged', 'contiguous', 'radix' or a factory.*got None"),
    (dict(kv_cache_manager="virtual"), ValueError, r"kv_cache_manager='virtual': use one of 'paged', 'contiguous', 'radix'"),
    (dict(dtype="float8"), ValueError, r"dtype='float8': use one of 'float32'"),
    (dict(kv_cache_manager=object), TypeError, r"kv_cache_manager must be 'paged', 'contiguous', 'radix' or a factory called with one KVCacheSpec"),
    (dict(kv_cache_manager=5), TypeError, r"kv_cache_manager must be .*a factory.*got 5"),
])
def test_bad_knob_is_a_clear_error_naming_it(kw, error, words):
    with pytest.raises(error, match=words):
        config(**kw)


@pytest.mark.parametrize("knob", sorted(NUMBERS))
def test_every_numeric_knob_refuses_bools_and_strings(knob):
    for value in (True, "1", [1]):
        with pytest.raises(TypeError, match=f"^{knob} must be"):
            config(**{knob: value})
    if NUMBERS[knob][0] is int:
        with pytest.raises(TypeError, match=f"^{knob} must be an integer"):
            config(**{knob: 1.0})


@pytest.mark.parametrize("knob", BOOLS)
def test_bool_knobs_take_only_bools(knob):
    for value in ("False", "True", 0, 1):
        with pytest.raises(TypeError, match=f"^{knob} must be True or False"):
            config(**{knob: value})
    assert getattr(config(**{knob: False}), knob) is False
    if knob in OPTIONAL:
        config(**{knob: None})


@pytest.mark.parametrize("kw", [
    dict(block_size=1.5), dict(num_gpu_blocks_override=2.5), dict(swap_space=-1, preemption_mode="swap"),
    dict(seed="x"), dict(device=None), dict(model=None), dict(kv_cache_manager=object),
    dict(enable_prefix_caching="False"),
])
def test_llm_refuses_a_bad_knob_before_loading_the_model(no_model_load, kw):
    args = {**TINY, **kw}
    with pytest.raises((TypeError, ValueError), match=next(iter(kw))):
        LLM(args.pop("model", "tiny"), **args)


def test_kv_cache_manager_factories_that_take_a_spec_are_accepted():
    from tinypaged.kv.block_manager import BlockManager

    class Mine:
        def __init__(self, spec):
            self.spec = spec

    for factory in (BlockManager.from_spec, Mine, lambda spec: None):
        assert config(kv_cache_manager=factory).kv_cache_manager is factory


# -- the one policy knob ------------------------------------------------------------------------------
def test_scheduling_policy_is_the_order_and_defaults_to_fcfs():
    c = config()
    assert c.scheduling_policy == "fcfs" and not hasattr(c, "scheduler") and not c.has_plugins
    sched = make_scheduler(c, None)
    assert isinstance(sched.step, PlanPolicy) and isinstance(sched.order, FcfsOrder)
    assert isinstance(make_scheduler(config(scheduler_cls="static"), None), StaticScheduler)
    assert config(scheduler_cls=schedule_step).has_plugins


@pytest.mark.parametrize("policy, error, words", [
    ("fifo", ValueError, r"scheduling_policy='fifo': use 'fcfs', 'priority', 'lpm'; a scheduler of your own is "
                         r"scheduler_cls="),
    (5, TypeError, r"scheduling_policy must be 'fcfs', 'priority', 'lpm' \(or None: 'fcfs'\), or an order object "
                    r"with waiting_order\(scheduler\) and rank_running\(requests\), got 5"),
    (lambda: None, ValueError, r"scheduling_policy=<lambda> is now scheduler_cls=<lambda>"),
    (type("NoSchedule", (), {}), ValueError, r"scheduling_policy=NoSchedule is now scheduler_cls=NoSchedule"),
    (type("Plans", (), {"plan": lambda *a: None})(), ValueError, r"scheduling_policy=Plans\(\.\.\.\) is now scheduler_cls="),
])
def test_bad_scheduling_policy(policy, error, words):
    with pytest.raises(error, match=words):
        config(scheduling_policy=policy)


def test_the_removed_scheduler_alias_is_an_unknown_knob():
    """``scheduler=`` was the deprecated alias of the old ``scheduling_policy``; one knob per decision now."""
    with pytest.raises(TypeError, match="scheduler"):
        config(scheduler="static")


@pytest.mark.parametrize("old, new", [("kv_cache", "kv_cache_manager"), ("scheduler", "scheduler_cls")])
def test_a_merged_knob_names_the_one_that_replaced_it(old, new):
    """One knob per decision: ``LLM(kv_cache=...)`` (merged into ``kv_cache_manager``) and ``scheduler=`` fail
    before any model is loaded, naming the knob to use instead."""
    with pytest.raises(TypeError, match=rf"LLM\({old}=\.\.\.\) is gone: its decision is {new}="):
        LLM("no-such-model", **{old: "contiguous"})


def test_the_layout_follows_the_kv_manager():
    """The KV tensors' layout is the manager's: by name, or a factory's declared ``layout`` (paged when none)."""
    assert config(kv_cache_manager="contiguous").kv_layout == "contiguous"
    assert config(kv_cache_manager=ContiguousKVManager.factory()).kv_layout == "contiguous"
    assert config(kv_cache_manager=ContiguousKVManager.from_spec).kv_layout == "contiguous"
    assert config(kv_cache_manager=BlockManager.from_spec).kv_layout == "paged"
    assert config(kv_cache_manager=lambda spec: None).kv_layout == "paged"


def test_chunked_prefill_is_on_where_the_policy_can_split_prompts():
    assert config().enable_chunked_prefill is True  # vLLM v1's default
    assert config(scheduler_cls=schedule_step).enable_chunked_prefill is True
    assert config(scheduler_cls="static").enable_chunked_prefill is False
    assert config(scheduler_cls="static", enable_chunked_prefill=False).enable_chunked_prefill is False
    assert config(enable_chunked_prefill=False).enable_chunked_prefill is False


def test_static_with_chunked_prefill_is_a_contradiction_naming_both_knobs():
    with pytest.raises(ValueError, match="enable_chunked_prefill=True contradicts scheduler_cls='static'"):
        config(scheduler_cls="static", enable_chunked_prefill=True)


# -- SamplingParams and BeamSearchParams --------------------------------------------------------------
@pytest.mark.parametrize("kw, words", [
    (dict(temperature=math.nan), r"temperature must be a finite number >= 0.*got nan"),
    (dict(temperature=math.inf), r"temperature must be a finite number >= 0.*got inf"),
    (dict(temperature=-math.inf), r"temperature must be a finite number >= 0"),
    (dict(seed=2**64), r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\].*got 18446744073709551616"),
    (dict(seed=-2**63 - 1), r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
    (dict(seed=2**64 - 1, n=2), r"seed \+ n - 1 must be <= 2\*\*64 - 1.*seed=18446744073709551615 with n=2"),
    (dict(stop_token_ids=[5, -1]), r"stop_token_ids must hold token ids >= 0, got \[5, -1\]"),
])
def test_sampling_params_refused_like_vllm(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(-2**65, 2**65), n=st.integers(1, 8))
def test_accepted_seeds_always_seed_a_torch_generator(seed, n):
    """Either SamplingParams refuses the seed, or every sample's seed (seed + i) is one torch takes."""
    try:
        SamplingParams(seed=seed, n=n)
    except ValueError as e:
        assert "seed" in str(e)
        return
    for i in range(n):
        torch.Generator().manual_seed(seed + i)


def test_a_tiny_positive_temperature_is_greedy_not_a_crash():
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    llm = LLM("tiny", **TINY)
    prompt = {"prompt_token_ids": [11, 402, 9, 77]}
    tiny_t, greedy = llm.generate([prompt, prompt], [SamplingParams(temperature=t, max_tokens=4, ignore_eos=True)
                                                     for t in (1e-300, 0.0)])
    assert tiny_t.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_seeds_at_the_top_of_torchs_range_run_with_n_samples():
    llm = LLM("tiny", **TINY, parallel_sampling="fanout")
    out = llm.generate({"prompt_token_ids": [11, 402, 9]}, SamplingParams(seed=2**64 - 2, n=2, max_tokens=2))
    assert len(out[0].outputs) == 2


@pytest.mark.parametrize("kw, words", [
    (dict(beam_width=2.5), r"beam_width must be an integer >= 1, got 2.5"),
    (dict(beam_width=True), r"beam_width must be an integer >= 1, got True"),
    (dict(beam_width=0), r"beam_width must be an integer >= 1, got 0"),
    (dict(max_tokens="3"), r"max_tokens must be an integer >= 1, got '3'"),
    (dict(ignore_eos="no"), r"ignore_eos must be True or False, got 'no'"),
    (dict(length_penalty=math.nan), r"length_penalty must be a finite number, got nan"),
])
def test_beam_search_params_name_the_field(kw, words):
    with pytest.raises(ValueError, match=words):
        BeamSearchParams(**kw)


# -- the model loader ---------------------------------------------------------------------------------
def test_unknown_model_lists_the_known_names():
    with pytest.raises(ValueError, match=r"Unknown model 'gpt-17': the built-in names are 'smollm2-135m' and 'tiny'"):
        LLM("gpt-17", **TINY)


def test_missing_model_folder_says_no_such_folder(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=r"no such folder"):
        LLM(str(missing), **TINY)
    with pytest.raises(ValueError, match=r"has no config.json"):
        LLM(str(tmp_path), **TINY)


# -- the command line ---------------------------------------------------------------------------------
def cli(capsys, *args):
    """Run ``python -m tinypaged generate ...`` in this process: (exit status, stderr lines but the log)."""
    try:
        rc = main(["generate", *args])
    except SystemExit as e:
        rc = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("INFO tinypaged")]
    return rc, err


@pytest.mark.parametrize("args, words", [
    (["hi", "--max-tokens", "-5"], "argument --max-tokens: must be an integer >= 1, got -5"),
    (["hi", "--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1, got 0"),
    (["hi", "--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
    (["", "--model", "tiny"], "argument prompts: a prompt must hold some text"),
    (["hi", "--model", "gpt-17"], "Unknown model 'gpt-17': the built-in names are"),
    (["hi", "--model", "./no/such/folder"], "no such folder"),
    (["hi", "--model", "tiny", "--kv-cache-manager", "contiguous", "--enable-prefix-caching"],
     "enable_prefix_caching shares blocks, so it needs a paged KV manager"),
])
def test_cli_bad_input_is_one_error_line_and_exit_2(capsys, args, words):
    rc, err = cli(capsys, *args)
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("python -m tinypaged generate: error: ") and words in err[0], err


def test_cli_runs_the_real_module_without_a_traceback():
    """One real ``python -m tinypaged`` run: an engine-side error (caught around LLM) is one line, exit 2."""
    args = ["generate", "hi", "--model", "tiny", "--kv-cache-manager", "contiguous", "--enable-prefix-caching"]
    run = subprocess.run([sys.executable, "-m", "tinypaged", *args], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, timeout=300)
    err = run.stderr.strip().splitlines()
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert err == ["python -m tinypaged generate: error: enable_prefix_caching shares blocks, so it needs "
                   "a paged KV manager (kv_cache_manager='paged' or a paged factory)"], run.stderr


def test_numpy_numbers_are_stored_as_python_numbers():
    np = pytest.importorskip("numpy")
    c = config(max_num_seqs=np.int64(8), block_size=np.int32(4), gpu_memory_utilization=np.float32(0.5))
    assert (c.max_num_seqs, c.block_size) == (8, 4) and type(c.max_num_seqs) is int and type(c.block_size) is int
    assert type(c.gpu_memory_utilization) is float
    with pytest.raises(TypeError, match="max_num_seqs must be an integer"):
        config(max_num_seqs=np.float64(8.0))
