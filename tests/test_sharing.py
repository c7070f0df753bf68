"""Stage 3: sharing blocks between the sequences of one request (parallel sampling, beam search)."""

import pytest
import torch

from tinypaged import LLM, SamplingParams
from tinypaged.engine.beam_search import beam_search, analytic_shared_blocks
from tinypaged.kv.block_manager import BlockManager
from tinypaged.sampling_params import BeamSearchParams
from tinypaged.sequence import Sequence


pytestmark = pytest.mark.usefixtures("one_thread")


BS = 4
PROMPTS = [[5, 17, 300, 41, 9, 77, 1000], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]]  # 7, 3 and 8 tokens


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny", dtype="float64", device="cpu", block_size=BS, num_gpu_blocks_override=96)


@pytest.fixture(scope="module")
def hf():
    from tinypaged.model.loader import tiny_hf_model

    return tiny_hf_model().double()


def _ids(p):
    return {"prompt_token_ids": p}


def _assert_all_free(llm):
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.tables, "blocks leaked"


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


# -- parallel sampling ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_parallel_sampling_seeded_is_reproducible(llm, n):
    sp = SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=6)
    a = llm.generate([_ids(p) for p in PROMPTS], sp)
    b = llm.generate([_ids(p) for p in PROMPTS], sp)
    assert _tokens(a) == _tokens(b)
    assert all(len(o.outputs) == n for o in a)
    assert [c.index for c in a[0].outputs] == list(range(n))
    assert len({tuple(c.token_ids) for c in a[0].outputs}) > 1, "the n samples should differ"
    _assert_all_free(llm)


def test_n1_unchanged_and_first_sample_matches(llm):
    one = llm.generate([_ids(p) for p in PROMPTS], SamplingParams(n=1, temperature=1.0, seed=7, max_tokens=6))
    four = llm.generate([_ids(p) for p in PROMPTS], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6))
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in four]
    greedy1 = llm.generate([_ids(p) for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=6))
    greedy3 = llm.generate([_ids(p) for p in PROMPTS], SamplingParams(n=3, temperature=0.0, max_tokens=6))
    for g1, g3 in zip(greedy1, greedy3):
        assert all(c.token_ids == g1.outputs[0].token_ids for c in g3.outputs)


def test_parallel_sampling_shares_blocks_and_counts_cow(llm):
    """n samples share the prompt's blocks; a shared, partially filled last block is copied n-1 times."""
    eng = llm.llm_engine
    kv = eng.kv
    seen = []
    cow0 = kv.num_cow_copies

    def watch(step):
        st = kv.stats()
        seen.append((st["kv_blocks_used"], st["kv_blocks_unshared"], st["kv_blocks_shared"]))

    n = 4
    llm.generate([_ids(PROMPTS[0])], SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=5), on_step=watch)
    # prompt of 7 tokens, block size 4: one full shared block + one partial block copied by 3 of 4 samples
    assert kv.num_cow_copies - cow0 == n - 1
    assert any(shared > 0 and used < unshared for used, unshared, shared in seen)
    _assert_all_free(llm)
    # a prompt that fills its blocks exactly needs no copy: every sample starts a new block
    cow0 = kv.num_cow_copies
    llm.generate([_ids(PROMPTS[2])], SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=5))
    assert kv.num_cow_copies == cow0
    _assert_all_free(llm)


def test_copy_on_write_block_manager_level():
    """fork shares every block; the first writer into the shared tail gets a private copy (src, dst)."""
    copies = []
    bm = BlockManager(8, BS, copy_block=lambda s, d: copies.append((s, d)))
    parent = Sequence("r", list(range(6)), SamplingParams())
    assert bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1, None)
    bm.fork(parent, child)
    assert bm.block_ids(child) == bm.block_ids(parent) and [bm.ref_count(b) for b in bm.tables[parent.seq_id]] == [2, 2]
    for s in (parent, child):
        s.output_token_ids.append(99)
    assert bm.allocate_slots(child, 1)
    assert copies == [(bm.block_ids(parent)[1], bm.block_ids(child)[1])]
    assert bm.block_ids(child)[0] == bm.block_ids(parent)[0] and bm.block_ids(child)[1] != bm.block_ids(parent)[1]
    assert bm.allocate_slots(parent, 1) and len(copies) == 1, "the last holder writes in place"
    assert [bm.ref_count(b) for b in bm.tables[parent.seq_id]] == [2, 1]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


# -- beam search ------------------------------------------------------------------------------
def test_beam_width_1_is_greedy(llm):
    greedy = llm.generate([_ids(p) for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    beams = llm.beam_search([_ids(p) for p in PROMPTS], BeamSearchParams(beam_width=1, max_tokens=7, ignore_eos=True))
    for g, b in zip(greedy, beams):
        assert len(b.sequences) == 1
        assert b.sequences[0].output_token_ids == g.outputs[0].token_ids
        assert b.sequences[0].cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=1e-4)
    _assert_all_free(llm)


def _hf_beams(hf, prompt, width, max_tokens, length_penalty=1.0, early_stopping=False, eos=2):
    from transformers import GenerationConfig

    gc = GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                          length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                          pad_token_id=0, bos_token_id=1, output_scores=True, return_dict_in_generate=True)
    g = hf.generate(torch.tensor([prompt]), generation_config=gc)
    seqs = []
    for row in g.sequences:
        out = row[len(prompt):].tolist()
        seqs.append(out[: out.index(eos) + 1] if eos in out else out)  # HF pads finished beams
    return seqs, g.sequences_scores.tolist()


@pytest.mark.parametrize("width,eos,length_penalty,early_stopping", [
    (2, None, 1.0, False),  # tiny's own EOS (2) never ranks high: plain top-k beams
    (3, None, 1.0, False),
    (3, 20938, 0.5, False),  # a token that does rank high plays EOS: finished hypotheses, heuristic stop
    (2, 14436, 1.0, False),
    (3, 42407, 2.0, True),
    (4, 20938, 1.0, "never"),
])
def test_beam_search_matches_transformers(llm, hf, width, eos, length_penalty, early_stopping):
    eng = llm.llm_engine
    saved = set(eng.eos_token_ids)
    if eos is not None:
        eng.eos_token_ids = {eos}
    try:
        outs = beam_search(eng, [_ids(p) for p in PROMPTS[:2]], BeamSearchParams(width, 6, False, length_penalty),
                           early_stopping=early_stopping)
    finally:
        eng.eos_token_ids = saved
    for p, o in zip(PROMPTS[:2], outs):
        ref, scores = _hf_beams(hf, p, width, 6, length_penalty, early_stopping, 2 if eos is None else eos)
        assert [s.output_token_ids for s in o.sequences] == ref
        assert [s.tokens[: len(p)] for s in o.sequences] == [p] * width
        assert [s.score for s in o.sequences] == pytest.approx(scores, abs=1e-4)
    _assert_all_free(llm)


def test_beam_search_block_accounting(llm):
    eng = llm.llm_engine
    checks = []

    def watch(beams_by_prompt):
        used = eng.kv.num_blocks - eng.kv.num_free_blocks
        checks.append((used, analytic_shared_blocks(beams_by_prompt, BS),
                       sum(-(-len(b) // BS) for beams in beams_by_prompt for b in beams), eng.kv.stats()["kv_blocks_unshared"]))

    stats = {}
    beam_search(eng, [_ids(p) for p in PROMPTS], BeamSearchParams(beam_width=4, max_tokens=9, ignore_eos=True),
                stats=stats, on_step=watch)
    assert checks and all(used == analytic for used, analytic, _, _ in checks)
    assert all(unshared == direct for _, _, unshared, direct in checks)
    assert stats["peak_blocks_used"] < stats["peak_blocks_unshared"]
    assert stats["block_steps_used"] < stats["block_steps_unshared"]
    assert stats["cow_copies"] > 0
    _assert_all_free(llm)


def test_beam_search_out_of_blocks_frees_everything():
    llm = LLM(model="tiny", dtype="float64", device="cpu", block_size=BS, num_gpu_blocks_override=6)
    with pytest.raises(RuntimeError, match="ran out of KV blocks"):
        llm.beam_search([_ids(PROMPTS[0])], BeamSearchParams(beam_width=6, max_tokens=12, ignore_eos=True))
    _assert_all_free(llm)


# -- the stage 3 checks fail on wrong code ------------------------------------------------------------
def _broken_implementations():
    from tinypaged.course.checks import stage03 as ref

    def fork_no_refcount(table, refcounts):
        return list(table)

    def fork_same_list(table, refcounts):
        for b in table:
            refcounts[b] += 1
        return table

    def append_never_copies(table, n, bs, refcounts, allocator):
        if n % bs == 0:
            table.append(allocator.allocate())
            refcounts[table[-1]] = 1
        return None

    def append_copies_full_blocks(table, n, bs, refcounts, allocator):
        if n % bs == 0 and table and refcounts[table[-1]] > 1:
            new = allocator.allocate()
            refcounts[table[-1]] -= 1
            refcounts[new] = 1
            src, table[-1] = table[-1], new
            return (src, new)
        return ref.append_slot(table, n, bs, refcounts, allocator)

    def free_head_first(table, refcounts, allocator):
        for b in table:
            refcounts[b] -= 1
            if refcounts[b] == 0:
                allocator.free(b)
        table.clear()

    def hash_unchained(tokens, bs):
        from tinypaged.kv.block_pool import hash_block_tokens

        return [hash_block_tokens(None, tokens[i * bs:(i + 1) * bs]) for i in range(len(tokens) // bs)]

    def hash_partial_too(tokens, bs):
        from tinypaged.kv.block_pool import hash_block_tokens

        out = []
        for i in range(-(-len(tokens) // bs)):
            out.append(hash_block_tokens(out[-1] if out else None, tokens[i * bs:(i + 1) * bs]))
        return out

    def prefix_uncapped(tokens, bs, cache):
        from tinypaged.kv.block_pool import hash_chain

        hit = []
        for h in hash_chain(tokens, bs):
            if h not in cache:
                break
            hit.append(cache[h])
        return hit

    def prefix_skips_misses(tokens, bs, cache):
        from tinypaged.kv.block_pool import hash_chain

        return [cache[h] for h in hash_chain(tokens[:-1], bs) if h in cache]

    def _chain(tokens, bs, extra_keys=None, known=()):  # hash_chain written again (not the package's code)
        from tinypaged.kv.block_pool import hash_block_tokens

        out = list(known)
        for i in range(len(out), len(tokens) // bs):
            out.append(hash_block_tokens(out[-1] if out else None, tokens[i * bs:(i + 1) * bs], extra_keys))
        return out

    def hash_drops_extra_keys(tokens, bs, extra_keys=None, known=()):
        return _chain(tokens, bs, None, known)

    def hash_recomputes_known(tokens, bs, extra_keys=None, known=()):
        return _chain(tokens, bs, extra_keys)

    def prefix_drops_extra_keys(tokens, bs, cache, extra_keys=None):
        hit = []
        for h in _chain(tokens[:-1], bs):
            if cache.lookup(h) is None:
                break
            hit.append(cache.lookup(h))
        return hit

    return [("fork_table", fork_no_refcount), ("fork_table", fork_same_list),
            ("hash_chain", hash_drops_extra_keys), ("hash_chain", hash_recomputes_known),
            ("longest_cached_prefix", prefix_drops_extra_keys),
            ("append_slot", append_never_copies), ("append_slot", append_copies_full_blocks),
            ("free_table", free_head_first), ("hash_chain", hash_unchained), ("hash_chain", hash_partial_too),
            ("longest_cached_prefix", prefix_uncapped), ("longest_cached_prefix", prefix_skips_misses)]


@pytest.mark.parametrize("name,impl", _broken_implementations(), ids=lambda x: getattr(x, "__name__", x))
def test_stage03_checks_fail_on_broken_code(name, impl):
    from tinypaged.course import checks

    status, msg = checks.evaluate(name, impl)
    assert status == checks.FAIL and msg, f"{name} accepted {impl.__name__}"


def test_stage03_checks_report_not_implemented():
    from tinypaged.course import checks

    def todo(*args):
        raise NotImplementedError("not implemented yet")

    for name in ("fork_table", "append_slot", "free_table", "hash_chain", "longest_cached_prefix"):
        assert checks.evaluate(name, todo)[0] == checks.TODO


# -- the serving checks take the learner's parts inside the engine's BlockManager, and only those ----------------
def _solution_cells(stage: str, grade_ids) -> dict:
    """A solution notebook's setup and graded cells and its given plug-in cell, executed without its check cells
    (which would load SmolLM2)."""
    import json

    from tinypaged.course import coursework
    from tinypaged.course.grading.notebook import source_of

    nb = json.loads((coursework.ROOT / "solutions" / f"{stage}.ipynb").read_text())
    ns: dict = {"__name__": "__submission__"}
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") in ("setup", *grade_ids, "plugin"):
            exec(compile(source_of(cell), f"<solutions/{stage} cell>", "exec"), ns)
    return ns


@pytest.mark.parametrize("stage,check,parts,swap,why", [
    ("02_block_table", "serve_paged", ("BlockAllocator", "slot_mapping", "BlockTables", "gather_kv", "paged_attention"),
     {"BlockAllocator": "BlockAllocator"}, "BlockAllocator must be yours"),
    ("02_block_table", "serve_paged", ("BlockAllocator", "slot_mapping", "BlockTables", "gather_kv", "paged_attention"),
     {"BlockTables": "BlockTables"}, "BlockTables must be yours"),
    ("03_prefix_sharing", "serve_prefix_cache",
     ("fork", "append_slot", "free_table", "hash_chain", "PrefixCache", "longest_cached_prefix"),
     {"PrefixCache": "PrefixCache"}, "PrefixCache must be yours"),
    ("03_prefix_sharing", "serve_prefix_cache",
     ("fork", "append_slot", "free_table", "hash_chain", "PrefixCache", "longest_cached_prefix"),
     {"free_table": "free_table"}, "free_table must be yours"),
])
def test_serving_checks_take_the_learners_parts_inside_the_block_manager(stage, check, parts, swap, why):
    """The given cell's ``BlockManager.factory`` around the solution's parts passes the preflight (no adapter
    class in the notebook); the package's own part in its place is refused before the model loads."""
    from tinypaged.course import checks
    from tinypaged.course.checks.serving import check_plugins
    from tinypaged.kv import block_manager

    ns = _solution_cells(stage, parts)
    plugins = ns["plugins"]
    serve = checks.get(check)
    check_plugins(plugins, ("kv_cache_manager",))
    serve_module = __import__(f"tinypaged.course.checks.stage{stage[:2]}", fromlist=["_preflight"])
    serve_module._preflight(plugins)  # the solution's parts: accepted
    mine = {p: ns[p] for p in parts if p in block_manager.PARTS}
    theirs = dict(mine, **{k: block_manager.PARTS[v] for k, v in swap.items()})
    bad = dict(plugins, kv_cache_manager=block_manager.BlockManager.factory(**theirs))
    (outcome,) = checks.observe(serve, bad)["outcomes"]
    assert why in outcome.get("error", ""), outcome
