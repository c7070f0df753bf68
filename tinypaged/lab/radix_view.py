"""Stage 7: watch a radix tree and vLLM's hashed blocks take the same requests, event by event.

``replay(events, capacity_tokens, block_size)`` drives a ``RadixKVManager`` (page 1) and a prefix-caching
``BlockManager`` (blocks of ``block_size``) with the same requests, without a model: an ``("arrive", name,
prompt)`` event looks the prompt up and allocates it (as the engine does at admission), a ``("finish", name,
outputs)`` event decodes the outputs one by one and frees the request. After each event it takes a
``Snapshot``: the tree's nodes (tokens, lock count, which leaf LRU eviction takes next) and every block's state.
``tree_lines`` prints a snapshot as text (stable, for notebooks); ``animate`` draws them side by side.

``serve_with_tree`` serves SmolLM2 with a given tree class (a learner's) inside ``RadixKVManager`` and an order inside
``CacheAwareOrder``; ``show_at_work`` prints two such runs (the order, then arrival order) side by side: what each
request found in the tree, the admission order, the prefill tokens saved, the calls into the tree and the tree
itself. Everything here reads a tree through the assignment's interface only (``tree_nodes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinypaged.kv.block_manager import BlockManager
from tinypaged.kv.radix_cache import RadixKVManager, node_tokens, tree_nodes
from tinypaged.sampling_params import SamplingParams
from tinypaged.sched.output import ScheduledSeq, SchedulerOutput
from tinypaged.sched.scheduler import Scheduler
from tinypaged.sequence import Sequence


@dataclass
class NodeView:
    id: int
    parent: int | None
    depth: int
    tokens: tuple
    lock_ref: int
    victim: bool


@dataclass
class Snapshot:
    event: str
    nodes: list[NodeView]
    blocks: list[str]  # per block: "used", "cached" (free, hash kept), "free"
    hits: dict[str, int] = field(default_factory=dict)  # manager -> tokens the event's request found cached


def next_victim(tree):
    """The leaf ``evict`` frees first: unlocked, the smallest ``last_access``, then the oldest. Read through the
    assignment's interface only (``root``, ``children``, ``lock_ref``, ``last_access``), so a learner's tree works."""
    leaves = [n for n in tree_nodes(tree) if not n.children and n.lock_ref == 0]
    return min(leaves, key=lambda n: (n.last_access, n.order), default=None)


def _tree_view(tree) -> list[NodeView]:
    victim, number = next_victim(tree), {}
    out, stack = [], [(c, None, 0) for c in sorted(tree.root.children.values(), key=lambda n: n.key, reverse=True)]
    while stack:
        node, parent, depth = stack.pop()
        number[id(node)] = len(out)  # nodes are numbered in drawing order: any tree's nodes will do
        out.append(NodeView(number[id(node)], parent, depth, node_tokens(node), node.lock_ref, node is victim))
        stack += [(c, number[id(node)], depth + 1)
                  for c in sorted(node.children.values(), key=lambda n: n.key, reverse=True)]
    return out


def _block_view(bm: BlockManager) -> list[str]:
    cached = bm.allocator.hash_of  # the prefix cache: block -> the prefix hash it holds
    return ["used" if bm.ref_count(b) else ("cached" if b in cached else "free") for b in range(bm.num_blocks)]


def replay(events, capacity_tokens: int = 64, block_size: int = 4) -> list[Snapshot]:
    radix = RadixKVManager(capacity_tokens, page_size=1)
    blocks = BlockManager(capacity_tokens // block_size, block_size, enable_prefix_caching=True)
    # each manager's own scheduler writes the sequences' progress (the only writer of Sequence state)
    scheds = {"radix": Scheduler(None, radix, None), "blocks": Scheduler(None, blocks, None)}
    seqs: dict[tuple[str, str], Sequence] = {}
    snaps = [Snapshot("empty", _tree_view(radix.tree), _block_view(blocks))]
    for kind, name, tokens in events:
        hits = {}
        for label, sched in scheds.items():
            kv = sched.kv
            if kind == "arrive":
                seq = seqs[(label, name)] = Sequence(name, list(tokens), SamplingParams(max_tokens=len(tokens) + 64))
                hit = kv.get_computed_blocks(seq)
                cached = len(hit) * kv.block_size
                if not sched.allocate(seq, len(seq) - cached, hit):
                    raise ValueError(f"event {name}: the cache of {capacity_tokens} tokens is too small for it")
                sched.advance(SchedulerOutput([ScheduledSeq(seq, len(seq) - cached)]))  # prefilled
                hits[label] = cached
            elif kind == "finish":
                seq = seqs.pop((label, name))
                for i, tok in enumerate(tokens):  # each sampled token but the last is fed back (decoded)
                    sched.append_tokens([seq], [tok], [0.0], now=0.0)
                    if i < len(tokens) - 1:
                        if not sched.allocate(seq, 1):
                            raise ValueError(f"event {name}: no room to decode")
                        sched.advance(SchedulerOutput([ScheduledSeq(seq, 1)]))
                kv.free(seq)
            else:
                raise ValueError(f"event kind {kind!r}: use 'arrive' or 'finish'")
        what = f"{name} arrives ({len(tokens)} tokens)" if kind == "arrive" else f"{name} finishes (+{len(tokens)} out)"
        snaps.append(Snapshot(what, _tree_view(radix.tree), _block_view(blocks), hits))
    return snaps


def describe(tree, width: int = 8, decode=None) -> list[str]:
    """``tree_lines`` of a tree as it is now."""
    return tree_lines(Snapshot("now", _tree_view(tree), []), width, decode)


def tree_lines(snap: Snapshot, width: int = 8, decode=None) -> list[str]:
    """One line per node: indentation by depth, the first ``width`` tokens (or, with ``decode``, the text of the
    node's tokens, cut to ``4 * width`` characters), the lock count, the next victim."""
    lines = []
    for n in snap.nodes:
        if decode is not None:
            text = decode(list(n.tokens))
            toks = repr(text[: 4 * width]) + (" ..." if len(text) > 4 * width else "")
        else:
            toks = " ".join(map(str, n.tokens[:width])) + (" ..." if len(n.tokens) > width else "")
        mark = "  <- evicted next" if n.victim else ""
        lines.append(f"{'  ' * n.depth}[{toks}] ({len(n.tokens)} tokens, lock {n.lock_ref}){mark}")
    return lines or ["(empty tree)"]


TREE_CALLS = ("match_prefix", "insert", "evict", "inc_lock_ref", "dec_lock_ref")


class CountedTree:
    """The tree the KV manager is given in ``serve_with_tree``: ``tree`` itself, the calls to its ``TREE_CALLS``
    counted into ``calls`` (a ``Counter``) on the way (composition: ``tree`` is left as it is)."""

    def __init__(self, tree, calls):
        self._tree, self._calls = tree, calls

    def __getattr__(self, name):
        value = getattr(self._tree, name)
        if name not in TREE_CALLS:
            return value

        def counted(*args, **kwargs):
            self._calls[name] += 1
            return value(*args, **kwargs)

        return counted


@dataclass
class ServedRun:
    """One engine run on a radix tree: what each request found cached and the tree afterwards."""

    order: str
    admitted: list[int]  # prompt indexes in the order the engine first scheduled them
    cached: list[int]  # per prompt: tokens its admission found in the tree
    prompt_tokens: list[int]
    prefill_tokens: int  # prompt tokens the engine computed (the engine's own count)
    tokens: list[list[int]]  # the greedy output tokens, per prompt
    calls: dict[str, int]  # calls the engine's KV manager made into the tree
    tree: object  # the tree after the run


def serve_with_tree(make_tree, order, prompts, max_tokens: int = 8, model: str = "smollm2-135m", page_size: int = 1,
                    **engine_kwargs) -> ServedRun:
    """Serve ``prompts`` (greedy) with ``RadixKVManager(page_size)`` over ``make_tree()`` and
    ``CacheAwareOrder(order)`` (``order``: a function ``order(seqs, cached_tokens)`` or ``"lpm"``, ``"fcfs"``, ...)."""
    from collections import Counter

    from tinypaged import LLM
    from tinypaged.sched.radix_policy import CacheAwareOrder

    calls, trees = Counter(), []

    def tree_factory():
        tree = make_tree()
        trees.append(tree)
        return CountedTree(tree, calls)

    llm = LLM(model, kv_cache_manager=RadixKVManager.factory(page_size=page_size, tree_factory=tree_factory),
              scheduling_policy=CacheAwareOrder(order), **engine_kwargs)
    outs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    admitted = sorted(range(len(outs)), key=lambda i: (outs[i].metrics.first_scheduled_time, i))
    name = order if isinstance(order, str) else getattr(order, "__name__", "your order")
    return ServedRun(name, admitted, [o.metrics.num_cached_tokens for o in outs],
                     [len(o.prompt_token_ids) for o in outs], llm.get_metrics()["num_prefill_tokens"],
                     [list(o.outputs[0].token_ids) for o in outs], {k: calls[k] for k in TREE_CALLS}, trees[0])


def served_lines(yours: ServedRun, fcfs: ServedRun, decode=None, reference_tokens=None) -> list[str]:
    """Two runs of the same prompts side by side: admission order, cached and computed tokens per request, the
    prefill saved, the calls into the tree and the tree after ``yours``."""
    lines = []
    for run in (yours, fcfs):
        lines.append(f"{run.order}: admitted requests {', '.join(map(str, run.admitted))}")
        for i in run.admitted:
            lines.append(f"  request {i}: {run.prompt_tokens[i]} prompt tokens, {run.cached[i]} found in the tree, "
                         f"{run.prompt_tokens[i] - run.cached[i]} computed")
    saved = fcfs.prefill_tokens - yours.prefill_tokens
    lines.append(f"prefill tokens computed: {yours.prefill_tokens} with {yours.order}, {fcfs.prefill_tokens} with "
                 f"{fcfs.order}: {saved} saved")
    lines.append(f"the same output tokens under both orders: {yours.tokens == fcfs.tokens}")
    if reference_tokens is not None:
        same = [list(r) for r in reference_tokens] == yours.tokens
        lines.append(f"the same output tokens as transformers: {same}")
    lines.append("calls into your tree (" + yours.order + "): " + ", ".join(f"{k} {n}" for k, n in yours.calls.items()))
    lines.append(f"your tree after {yours.order}'s run (each edge's text, its tokens, its lock count):")
    lines += ["  " + line for line in describe(yours.tree, decode=decode)]
    return lines


def show_at_work(make_tree, order, prompts, max_tokens: int = 8, decode=None, reference=None, **engine_kwargs) -> None:
    """Stage 7's payoff: serve ``prompts`` with ``make_tree()`` under ``order`` and again in arrival order, and print
    ``served_lines``. ``reference(prompts, max_tokens)``: other greedy tokens to compare with (transformers').
    An unfinished tree or order (``NotImplementedError``) is said in one line, before the model loads."""
    try:
        tree = make_tree()
        tree.insert([1, 2, 3], [0, 1, 2])
        tree.match_prefix([1, 2])
        tree.evict(3)
        order([], lambda s: 0)
    except NotImplementedError:
        print("not implemented yet: finish (a) and (b), then run this cell again")
        return
    yours = serve_with_tree(make_tree, order, prompts, max_tokens, **engine_kwargs)
    arrival = serve_with_tree(make_tree, "fcfs", prompts, max_tokens, **engine_kwargs)
    want = reference(tuple(prompts), max_tokens) if reference is not None else None
    print("\n".join(served_lines(yours, arrival, decode, want)))


def block_line(snap: Snapshot) -> str:
    sym = {"used": "U", "cached": "c", "free": "."}
    return "".join(sym[s] for s in snap.blocks)


def _draw(snap: Snapshot, ax_tree, ax_blocks, block_size: int) -> None:
    from matplotlib.patches import Rectangle

    ax_tree.clear()
    ax_blocks.clear()
    ax_tree.set_title(f"radix tree, page 1: {snap.event}", fontsize=9, loc="left")
    # x: leaves left to right in DFS order, a parent over the middle of its children
    kids: dict[int | None, list[NodeView]] = {}
    for n in snap.nodes:
        kids.setdefault(n.parent, []).append(n)
    x: dict[int, float] = {}
    leaf = [0]

    def place(n: NodeView) -> float:
        cs = kids.get(n.id, [])
        if not cs:
            x[n.id] = leaf[0]
            leaf[0] += 1
        else:
            xs = [place(c) for c in cs]
            x[n.id] = sum(xs) / len(xs)
        return x[n.id]

    for n in kids.get(None, []):
        place(n)
    for n in snap.nodes:
        y = -n.depth
        px, py = (x[n.parent], -(n.depth - 1)) if n.parent is not None else (sum(x.values()) / max(len(x), 1), 1)
        ax_tree.plot([px, x[n.id]], [py, y], color="0.6", lw=1, zorder=1)
        color = "#f5a623" if n.lock_ref else "#9ecae1"
        edge = "red" if n.victim else "black"
        ax_tree.scatter([x[n.id]], [y], s=500, c=color, edgecolors=edge, linewidths=2.5 if n.victim else 1, zorder=2)
        ax_tree.text(x[n.id], y, f"{len(n.tokens)}\nL{n.lock_ref}", ha="center", va="center", fontsize=7, zorder=3)
    ax_tree.scatter([sum(x.values()) / max(len(x), 1)], [1], s=120, c="black")
    ax_tree.set_xlim(-1, max(leaf[0], 1))
    ax_tree.set_ylim(-max([n.depth for n in snap.nodes] + [1]) - 0.7, 1.6)
    ax_tree.axis("off")
    ax_tree.text(0, -0.08, "orange: locked by a running request; blue: evictable; red ring: the LRU leaf evicted next; "
                 "numbers: tokens, lock count", transform=ax_tree.transAxes, fontsize=7)
    colors = {"used": "#f5a623", "cached": "#9ecae1", "free": "white"}
    for i, s in enumerate(snap.blocks):
        ax_blocks.add_patch(Rectangle((i % 8, -(i // 8)), 0.9, 0.9, facecolor=colors[s], edgecolor="black"))
        ax_blocks.text(i % 8 + 0.45, -(i // 8) + 0.45, str(i), ha="center", va="center", fontsize=7)
    rows = -(-len(snap.blocks) // 8)
    ax_blocks.set_xlim(-0.1, 8)
    ax_blocks.set_ylim(-rows + 0.8, 1)
    ax_blocks.set_aspect("equal")
    ax_blocks.axis("off")
    hit = f" (hit: radix {snap.hits.get('radix', 0)}, blocks {snap.hits.get('blocks', 0)} tokens)" if snap.hits else ""
    ax_blocks.set_title(f"hashed blocks of {block_size}{hit}", fontsize=9, loc="left")
    ax_blocks.text(0, -rows + 0.5, "orange: in use; blue: free but cached (hash kept); white: free", fontsize=7)


def animate(snaps: list[Snapshot], block_size: int = 4, interval_ms: int = 1400):
    """A matplotlib animation, one frame per snapshot (``.to_jshtml()`` shows it in a notebook)."""
    import matplotlib.pyplot as plt
    from matplotlib.animation import FuncAnimation

    fig, (ax_tree, ax_blocks) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [2.2, 1]}, dpi=72)
    anim = FuncAnimation(fig, lambda i: _draw(snaps[i], ax_tree, ax_blocks, block_size), frames=len(snaps),
                         interval=interval_ms, repeat=False)
    plt.close(fig)
    return anim
