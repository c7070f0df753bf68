"""CUDA-graph decode (enforce_eager=False on a GPU, tinypaged/worker/cuda_graphs.py).

On a CPU the graph is ``EagerReplay``: replay re-runs the captured function into the captured output, so
everything but the recording itself is exercised here: the sizes, the padding rows, the static buffers, which
steps replay, and the tokens (the same as eager). The real capture runs where CUDA is (the last test).
"""

from __future__ import annotations

import pytest
import torch

from tinypaged import LLM, SamplingParams
from tinypaged.attention.backends import paged_attention
from tinypaged.worker.cuda_graphs import DecodeGraphs, EagerReplay, capture_sizes

PROMPTS = [[1, 5, 9, 2], [7, 3], [4, 4, 4, 4, 4, 4, 4, 8, 1], [2, 6, 6]]


def test_capture_sizes_follow_vllm_default_shape():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        capture_sizes(0)


def _engine(max_num_seqs=4, **kw):
    # a paged decode function reads block tables, as the Triton kernels do (the interpreter would be slow here)
    llm = LLM("tiny", device="cpu", dtype="float64", attention_backend=paged_attention, kv_cache_tokens=512,
              max_num_seqs=max_num_seqs, **kw)
    return llm


def _tokens(llm, prompts, max_tokens=12):
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def test_padded_replays_give_the_eager_tokens():
    lengths = [12, 6, 3]  # decode steps of 3 rows (size 4, one padding row), then 2, then 1
    eager = _tokens(_engine(), PROMPTS[:3], lengths)
    llm = _engine()
    runner = llm.llm_engine.runner
    runner.capture_graphs(4, llm.llm_engine.config.max_model_len, graph_factory=EagerReplay)
    assert runner.graphs.sizes == [1, 2, 4]
    assert _tokens(llm, PROMPTS[:3], lengths) == eager
    replays = {size: graph.replays for size, graph in runner.graphs.graphs.items()}
    assert replays == {4: 2, 2: 3, 1: 6}, replays
    # the padding row wrote nowhere and reads one key: its invariant holds after the replays
    inputs = runner.graphs.inputs
    assert inputs.slot_mapping[3].item() == -1 and inputs.context_lens[3].item() == 1


def test_prefills_run_eagerly_and_decodes_replay():
    llm = _engine(max_num_seqs=4)
    runner = llm.llm_engine.runner
    runner.capture_graphs(4, llm.llm_engine.config.max_model_len, graph_factory=EagerReplay)
    _tokens(llm, PROMPTS, max_tokens=5)
    # step 1 prefills the four prompts (eager); each of the 4 decode steps after it replays the size-4 graph
    assert runner.graphs.replays == 4
    assert runner.graphs.graphs[4].replays == 4 and runner.graphs.graphs[1].replays == 0


def test_too_wide_or_too_many_rows_run_eagerly():
    llm = _engine(max_num_seqs=4)
    runner = llm.llm_engine.runner
    runner.capture_graphs(2, 64, graph_factory=EagerReplay)  # graphs for <= 2 rows and 64-token tables
    eager = _tokens(_engine(max_num_seqs=4), PROMPTS, max_tokens=6)
    assert _tokens(llm, PROMPTS, max_tokens=6) == eager
    assert runner.graphs.padded_size(3) is None


def test_graphs_need_a_block_table_backend():
    llm = LLM("tiny", device="cpu", attention_backend="torch", kv_cache_tokens=256, max_num_seqs=2)
    with pytest.raises(ValueError, match="attention_backend='torch'"):
        llm.llm_engine.runner.capture_graphs(2, 64, graph_factory=EagerReplay)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: no CUDA device here")
def test_cuda_graphs_on_the_gpu_match_eager():
    kw = dict(device="cuda", dtype="float32", kv_cache_tokens=4096, max_num_seqs=8, attention_backend="triton")
    eager = _tokens(LLM("tiny", **kw), PROMPTS, max_tokens=16)
    llm = LLM("tiny", enforce_eager=False, **kw)
    assert isinstance(llm.llm_engine.runner.graphs, DecodeGraphs)
    assert _tokens(llm, PROMPTS, max_tokens=16) == eager
    assert llm.llm_engine.runner.graphs.replays > 0
