"""Stage 7: watch a radix tree and vLLM's hashed blocks take the same requests, event by event.

``replay(events, capacity_tokens, block_size)`` drives a ``RadixKVManager`` (page 1) and a prefix-caching
``BlockManager`` (blocks of ``block_size``) with the same requests, without a model: an ``("arrive", name,
prompt)`` event looks the prompt up and allocates it (as the engine does at admission), a ``("finish", name,
outputs)`` event decodes the outputs one by one and frees the request. After each event it takes a
``Snapshot``: the tree's nodes (tokens, lock count, which leaf LRU eviction takes next) and every block's state.
``tree_lines`` prints a snapshot as text (stable, for notebooks); ``animate`` draws them side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinypaged.block_manager import BlockManager
from tinypaged.radix_cache import RadixKVManager
from tinypaged.sampling_params import SamplingParams
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


def _tree_view(tree) -> list[NodeView]:
    victim = tree.next_victim()
    out, stack = [], [(c, None, 0) for c in sorted(tree.root.children.values(), key=lambda n: n.key, reverse=True)]
    while stack:
        node, parent, depth = stack.pop()
        out.append(NodeView(node.id, parent, depth, node.key, node.lock_ref, node is victim))
        stack += [(c, node.id, depth + 1) for c in sorted(node.children.values(), key=lambda n: n.key, reverse=True)]
    return out


def _block_view(bm: BlockManager) -> list[str]:
    pool = bm.pool
    return ["used" if pool.ref_count(b) else ("cached" if b in pool.hash_of else "free") for b in range(pool.num_blocks)]


def replay(events, capacity_tokens: int = 64, block_size: int = 4) -> list[Snapshot]:
    radix = RadixKVManager(capacity_tokens, page_size=1)
    blocks = BlockManager(capacity_tokens // block_size, block_size, enable_prefix_caching=True)
    seqs: dict[tuple[str, str], Sequence] = {}
    snaps = [Snapshot("empty", _tree_view(radix.tree), _block_view(blocks))]
    for kind, name, tokens in events:
        hits = {}
        for label, kv in (("radix", radix), ("blocks", blocks)):
            if kind == "arrive":
                seq = seqs[(label, name)] = Sequence(name, list(tokens), SamplingParams(max_tokens=len(tokens) + 64))
                hit = kv.get_computed_blocks(seq)
                cached = len(hit) * kv.block_size
                if not kv.allocate_slots(seq, len(seq) - cached, hit):
                    raise ValueError(f"event {name}: the cache of {capacity_tokens} tokens is too small for it")
                seq.num_computed_tokens = len(seq)
                hits[label] = cached
            elif kind == "finish":
                seq = seqs.pop((label, name))
                for i, tok in enumerate(tokens):  # each sampled token but the last is fed back (decoded)
                    seq.output_token_ids.append(tok)
                    if i < len(tokens) - 1:
                        if not kv.allocate_slots(seq, 1):
                            raise ValueError(f"event {name}: no room to decode")
                        seq.num_computed_tokens += 1
                kv.free(seq)
            else:
                raise ValueError(f"event kind {kind!r}: use 'arrive' or 'finish'")
        what = f"{name} arrives ({len(tokens)} tokens)" if kind == "arrive" else f"{name} finishes (+{len(tokens)} out)"
        snaps.append(Snapshot(what, _tree_view(radix.tree), _block_view(blocks), hits))
    return snaps


def describe(tree, width: int = 8) -> list[str]:
    """``tree_lines`` of a tree as it is now."""
    return tree_lines(Snapshot("now", _tree_view(tree), []), width)


def tree_lines(snap: Snapshot, width: int = 8) -> list[str]:
    """One line per node: indentation by depth, the first ``width`` tokens, the lock count, the next victim."""
    lines = []
    for n in snap.nodes:
        toks = " ".join(map(str, n.tokens[:width])) + (" ..." if len(n.tokens) > width else "")
        mark = "  <- evicted next" if n.victim else ""
        lines.append(f"{'  ' * n.depth}[{toks}] ({len(n.tokens)} tokens, lock {n.lock_ref}){mark}")
    return lines or ["(empty tree)"]


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
