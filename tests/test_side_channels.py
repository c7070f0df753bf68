"""No side channels: the KV manager and the scheduler only decide, the worker moves KV data (issue #47).

The KV manager's copy-on-write copies and the swap preemption's swaps reach the worker as data, in the
step's ``SchedulerOutput`` (vLLM v0's ``blocks_to_swap_out`` / ``blocks_to_swap_in`` / ``blocks_to_copy``),
and ``ModelRunner.move_blocks`` applies them before the forward: swap-outs, swap-ins, then copies. Checked here:

* no module of ``tinypaged/kv/`` or ``tinypaged/sched/`` moves tensor data or names the worker's KV tensors
  (an ``ast`` scan), and nothing reachable from the scheduler or the KV manager of a live engine is a handle
  on the KV data (its tensors, or code that closes over them);
* a copy-on-write step and a swap step list their moves, and the tokens are those of runs without them;
  without the worker's moves they would not be (the moves carry the data);
* applying a step's moves in that order equals making each one when it was decided (``BlockMoves.take``
  resolves a copy-on-write destination swapped out in the same step, and refuses what it cannot apply).
"""

import ast
import functools
import types
from collections import deque
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinypaged import LLM, SamplingParams
from tinypaged.interfaces import InvariantError
from tinypaged.kv.block_manager import BlockManager
from tinypaged.kv.block_moves import BlockMoves
from tinypaged.sequence import Sequence
from tinypaged.worker.kv_cache import KVCacheTensors

pytestmark = pytest.mark.usefixtures("shared_weights", "one_thread")

PACKAGE = Path(__file__).resolve().parents[1] / "tinypaged"
DECIDING = ("kv", "sched")  # the packages that only decide

# calls that move tensor data (torch's, and the worker's KV-tensor methods)
MOVING_CALLS = {"copy_", "index_copy", "index_copy_", "index_put", "index_put_", "scatter_", "masked_scatter_",
                "cpu", "cuda", "to", "pin_memory", "copy_block", "copy_blocks", "copy_to_cpu", "copy_to_gpu",
                "move_blocks", "swap_blocks"}
KV_DATA = {"keys", "values", "cpu_keys", "cpu_values", "key_cache", "value_cache", "kv_cache", "k_cache", "v_cache"}
WORKER_NAMES = {"KVCacheTensors", "kv_tensors", "swapper", "ModelRunner"}


PROMPT = {"prompt_token_ids": [11, 402, 9, 77, 1234, 5, 6]}  # 7 tokens: blocks of 4, the second one partial


def tiny(**kw):
    return LLM("tiny", **{"dtype": "float64", "device": "cpu", "block_size": 4, "max_model_len": 96,
                          "num_gpu_blocks_override": 128, **kw})


def find_device_copies(source: str) -> list[str]:
    """``line: text`` for every tensor-data move in ``source``: a call named in ``MOVING_CALLS``, an indexed
    write into a KV tensor (``X.keys[...] = ...``), or a name of the worker's KV tensors (a handle on them)."""
    lines, found = source.splitlines(), []

    def hit(node):
        found.append(f"{node.lineno}: {lines[node.lineno - 1].strip()}")

    def name_of(node):
        return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and name_of(node.func) in MOVING_CALLS:
            hit(node)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Subscript) and name_of(t.value) in KV_DATA for t in targets):
                hit(node)
        elif isinstance(node, (ast.Name, ast.Attribute)) and name_of(node) in WORKER_NAMES:
            hit(node)
        elif isinstance(node, ast.arg) and node.arg in WORKER_NAMES | {"copy_to_cpu", "copy_to_gpu"}:
            hit(node)
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_the_scan_finds_the_side_channels_there_were():
    """The scan is not vacuous: it flags the lines the KV manager and preemption used to move data with."""
    before = '''
def swap_out(self, tables, copy_to_cpu):
    copy_to_cpu(gpu, cpu)
def preempt(sched, group):
    sched.kv.swap_out(group, sched.swapper.copy_to_cpu)
def allocate(self, copy):
    self.copy_block(*copy)
def copy(self, s, d):
    self.keys[:, d] = self.keys[:, s]
    dst.copy_(src)
'''
    assert len(find_device_copies(before)) == 6
    assert find_device_copies("self.moves.copy(src, dst)\nidx = torch.tensor(rows)\nrefs[b] = 1\n") == []


def test_kv_and_sched_modules_make_no_device_copies():
    found = [f"{path.relative_to(PACKAGE)}:{line}" for pkg in DECIDING for path in sorted((PACKAGE / pkg).rglob("*.py"))
             for line in find_device_copies(path.read_text())]
    assert not found, "tinypaged/kv and tinypaged/sched only decide; the worker moves KV data:\n" + "\n".join(found)


def reaches(root, targets, stop=()) -> list[str]:
    """Paths from ``root`` to any object in ``targets`` (compared by identity) through attributes, containers,
    bound methods, partials and closures; objects in ``stop`` (the engine that owns both sides) end a path."""
    want, stop = {id(t) for t in targets}, {id(s) for s in stop}
    seen, todo, found = set(), deque([(root, "root")]), []
    while todo:
        obj, path = todo.popleft()
        if id(obj) in want:
            found.append(path)
            continue
        if id(obj) in seen or id(obj) in stop or isinstance(obj, (type, types.ModuleType, torch.Tensor, str, bytes)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo.extend((v, f"{path}[{k!r}]") for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            todo.extend((v, f"{path}[{i}]") for i, v in enumerate(obj))
        elif isinstance(obj, types.MethodType):
            todo.extend([(obj.__self__, f"{path}.__self__"), (obj.__func__, f"{path}.__func__")])
        elif isinstance(obj, functools.partial):
            todo.extend([(obj.func, f"{path}.func"), (obj.args, f"{path}.args"), (obj.keywords, f"{path}.keywords")])
        elif isinstance(obj, types.FunctionType):
            cells = obj.__closure__ or ()
            todo.extend((c.cell_contents, f"{path}.<closure {n}>") for n, c in zip(obj.__code__.co_freevars, cells))
            todo.append((obj.__defaults__ or (), f"{path}.__defaults__"))
        if hasattr(obj, "__dict__") and not isinstance(obj, types.FunctionType):
            todo.extend((v, f"{path}.{k}") for k, v in vars(obj).items())
    return found


def test_the_walk_finds_a_handle_hidden_in_a_closure():
    t = KVCacheTensors(1, 8, 1, 2, torch.float32, "cpu", block_size=4, num_cpu_blocks=2)
    holder = types.SimpleNamespace(cb=functools.partial(lambda f: f, lambda g, c: t.copy_to_cpu(g, c)))
    assert reaches(holder, [t]) and not reaches(types.SimpleNamespace(cb=lambda: None), [t])


def test_the_scheduler_and_the_kv_manager_hold_no_handle_on_the_kv_data():
    llm = tiny(preemption_mode="swap", parallel_sampling="fork", enable_prefix_caching=True)
    llm.generate(PROMPT, SamplingParams(n=3, max_tokens=4, seed=1, temperature=1.0))
    eng = llm.llm_engine
    data = [eng.kv_tensors, eng.runner, eng.kv_tensors.keys, eng.kv_tensors.values, eng.kv_tensors.cpu_keys]
    assert eng.kv_tensors.cpu_keys is not None
    for root in (eng.scheduler, eng.kv):
        assert not reaches(root, data, stop=[eng, llm]), f"{type(root).__name__} can reach the KV data"


# -- copy-on-write and swaps, listed in the step's output -------------------------------------------------
def generate(llm, prompts, params, drop=()):
    """Tokens per request and each step's ``SchedulerOutput``; ``drop`` names moves the worker skips."""
    eng, outs = llm.llm_engine, []
    schedule, move = eng.scheduler.schedule, eng.runner.move_blocks

    def recording(now):
        outs.append(schedule(now))
        return outs[-1]

    def moving(swap_out, swap_in, copies):
        kept = {"swap_out": swap_out, "swap_in": swap_in, "copies": copies}
        move(*[[] if k in drop else v for k, v in kept.items()])

    eng.scheduler.schedule, eng.runner.move_blocks = recording, moving
    try:
        tokens = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    finally:
        del eng.scheduler.schedule, eng.runner.move_blocks
    return tokens, outs


SAMPLES = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6)


def test_a_copy_on_write_step_lists_its_copies_and_the_samples_are_unchanged():
    fork = tiny(parallel_sampling="fork")
    got, outs = generate(fork, PROMPT, SAMPLES)
    copying = [o for o in outs if o.blocks_to_copy]
    assert len(copying) == 1 and not any(o.blocks_to_swap_out or o.blocks_to_swap_in for o in outs)
    copies = copying[0].blocks_to_copy
    # the 4 samples share the prompt's partial block: the first 3 writers copy it, the last writes in place
    assert len(copies) == 3 and len({s for s, _ in copies}) == 1 and len({d for _, d in copies}) == 3
    assert fork.get_metrics()["cow_copies"] == 3
    assert got == generate(tiny(parallel_sampling="fanout"), PROMPT, SAMPLES)[0], "fork must sample as fan-out"
    assert generate(tiny(parallel_sampling="fork"), PROMPT, SAMPLES, drop=("copies",))[0] != got, \
        "the copies carry the shared block's data: without them the samples change"


SWAP = dict(preemption_mode="swap", max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=10)
SWAP_PROMPTS = [{"prompt_token_ids": list(range(5 + i, 14 + i + i % 3))} for i in range(2)]
SWAP_PARAMS = SamplingParams(n=4, max_tokens=10, seed=3, temperature=0.8)


def test_a_swap_step_lists_its_swaps_and_the_tokens_are_unchanged():
    got, outs = generate(tiny(**SWAP), SWAP_PROMPTS, SWAP_PARAMS)
    want = generate(tiny(max_num_seqs=8, num_gpu_blocks_override=200), SWAP_PROMPTS, SWAP_PARAMS)[0]
    assert got == want, "swap preemption must not change the samples"
    outs_i = [i for i, o in enumerate(outs) if o.blocks_to_swap_out]
    ins_i = [i for i, o in enumerate(outs) if o.blocks_to_swap_in]
    assert outs_i and ins_i and outs_i[0] < ins_i[0], "a group is swapped out, then back in"
    for o in outs:
        if o.blocks_to_swap_out:
            assert o.preempted, "a swap-out comes from a preemption of this step"
        for pairs in (o.blocks_to_swap_out, o.blocks_to_swap_in, o.blocks_to_copy):
            assert len({dst for _, dst in pairs}) == len(pairs), "each destination once per list"
    assert generate(tiny(**SWAP), SWAP_PROMPTS, SWAP_PARAMS, drop=("swap_in",))[0] != got, \
        "the swap-ins carry the data back: without them the tokens change"


def test_a_copy_on_write_block_swapped_out_in_the_same_step_carries_the_copied_data():
    """A sibling preempted with its group after another sibling's copy-on-write (in one step): the swap-out
    reads the copy's source, since swap-outs are applied before copies."""
    t = KVCacheTensors(1, 32, 1, 2, torch.float32, "cpu", block_size=4, num_cpu_blocks=8)
    t.keys.copy_(torch.arange(t.keys.numel(), dtype=torch.float32).view_as(t.keys))
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    parent = Sequence("r", list(range(6)), SamplingParams())
    assert bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1, None)
    bm.fork(parent, child)
    bm.take_block_moves()
    child.output_token_ids.append(9)
    assert bm.allocate_slots(child, 1)  # copy-on-write: the shared partial block -> a private one
    shared, private = bm.block_ids(parent)[1], bm.block_ids(child)[1]
    bm.swap_out([parent, child])
    swap_out, swap_in, copies = bm.take_block_moves()
    assert copies == [(shared, private)] and not swap_in
    assert (shared, bm.swap.swapped[child.seq_id][1]) in swap_out, "the private block is swapped out from its source"
    before = t.keys.clone()
    t.move_blocks(swap_out, swap_in, copies)
    for gpu, cpu in swap_out:
        assert torch.equal(t.cpu_keys[:, cpu * 4:cpu * 4 + 4], before[:, gpu * 4:gpu * 4 + 4])


# -- applying a step's moves in order equals making each when decided -------------------------------------
def apply_now(moves, gpu, cpu):
    for kind, a, b in moves:
        if kind == "copy":
            gpu[b] = gpu[a]
        elif kind == "out":
            cpu[b] = gpu[a]
        else:
            gpu[b] = cpu[a]


def apply_in_phases(lists, gpu, cpu):
    swap_out, swap_in, copies = lists
    for g, c in swap_out:
        cpu[c] = gpu[g]
    for c, g in swap_in:
        gpu[g] = cpu[c]
    read = {s: gpu[s] for s, _ in copies}  # one batch: every source read before any destination is written
    for s, d in copies:
        gpu[d] = read[s]


MOVE = st.tuples(st.sampled_from(["copy", "out", "in"]), st.integers(0, 5), st.integers(0, 5))


@settings(max_examples=300, deadline=None)
@given(st.lists(MOVE, max_size=12))
def test_moves_applied_in_phases_equal_the_moves_made_when_decided(moves):
    log = BlockMoves()
    for kind, a, b in moves:
        {"copy": log.copy, "out": log.swap_out, "in": log.swap_in}[kind](a, b)
    try:
        lists = log.take()
    except InvariantError:
        return  # a step that cannot be applied in phases is refused, never applied wrong
    now = ({g: ("gpu", g) for g in range(6)}, {c: ("cpu", c) for c in range(6)})
    phased = ({g: ("gpu", g) for g in range(6)}, {c: ("cpu", c) for c in range(6)})
    apply_now(moves, *now)
    apply_in_phases(lists, *phased)
    assert phased == now
    assert not log and log.take() == ([], [], []), "take starts the log over"


def test_a_swapped_out_block_reused_in_the_same_step_needs_no_resolution():
    log = BlockMoves()
    log.swap_out(3, 0)  # block 3 leaves for CPU block 0 ...
    log.swap_in(5, 3)  # ... and takes a swapped group's data back, in the same step
    log.copy(1, 4)
    assert log.take() == ([(3, 0)], [(5, 3)], [(1, 4)])


def test_a_step_that_cannot_be_applied_in_phases_is_refused():
    log = BlockMoves()
    log.swap_in(2, 7)  # CPU block 2 is read back ...
    log.swap_out(1, 2)  # ... then rewritten by a swap-out of the same step, which would be applied first
    with pytest.raises(InvariantError, match="swap-outs are applied first"):
        log.take()
