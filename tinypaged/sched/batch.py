"""The step's batch as the model runner reads it: the scheduler turns its checked ``SchedulerOutput``
into plain data (``ScheduledChunk``), asking the KV manager where each token goes, so the runner
reads no live ``Sequence`` and never calls the KV manager (vLLM v1: the scheduler's output carries
block ids; the runner only builds tensors from them).

``check_no_overwrite`` is the costlier half of the KV manager's contract (on for plug-ins, or with
``check_invariants=True``): no new token lands on a slot that another scheduled sequence has cached.
The cheap half (every slot inside the cache, no slot twice in a step) is the runner's
``check_slots``, which knows the cache's size.
"""

from __future__ import annotations

import torch

from tinypaged.interfaces import InvariantError
from tinypaged.kv.block_pool import blocks_needed
from tinypaged.sched.output import ScheduledChunk


def make_batch(scheduled, kv) -> list[ScheduledChunk]:
    """One ``ScheduledChunk`` per scheduled sequence, read before ``Scheduler.advance``: a paged
    manager's block ids, and context slots from a manager that has ``context_slots`` (or no
    ``block_ids``)."""
    paged = hasattr(kv, "block_ids")
    batched_slots = getattr(kv, "context_slots", None)
    batch = []
    for item in scheduled:
        seq, n = item.seq, item.num_tokens
        start = seq.num_computed_tokens
        end = start + n
        block_ids = list(kv.block_ids(seq)[:blocks_needed(end, kv.block_size)]) if paged else None
        if batched_slots is not None:
            context = batched_slots([seq], end)[0]
        else:
            context = None if paged else kv.slot_mapping(seq, 0, end)
        batch.append(ScheduledChunk(seq.seq_id, seq.token_ids[start:end], start, kv.slot_mapping(seq, start, end),
                                    item.is_prefill, end == len(seq), block_ids, context))
    return batch


def check_no_overwrite(out, kv) -> None:
    """No new token of this step may land on a slot another scheduled sequence has cached (a block
    handed out twice, or a shared block written without copy-on-write), unless it writes the very
    token at the very position the other expects there (``_same_step_sharing``)."""
    writes = [s for chunk in out.batch for s in chunk.slot_mapping]
    readers = [it.seq for it in out.scheduled if it.seq.num_computed_tokens]
    if not writes or not readers:
        return
    writes = torch.tensor(writes, dtype=torch.long)
    cached = torch.tensor([s for seq in readers for s in kv.slot_mapping(seq, 0, seq.num_computed_tokens)],
                          dtype=torch.long)
    clash = torch.isin(writes, cached)
    if bool(clash.any()) and not _same_step_sharing(writes, cached, out, readers):
        raise InvariantError(f"this step would overwrite slot {int(writes[clash][0])}, which holds "
                             f"another token's cached keys (a block handed out twice, or a shared "
                             f"block written without copy-on-write)")


def _same_step_sharing(writes, cached, out, readers) -> bool:
    """Whether every written slot that some sequence counts as cached is a prefix shared within this step:
    the writer writes the very token, at the very position, that the reader expects there (prefix caching
    hands a request the pages another one is prefilling now). That is sound because each layer writes all
    of the step's keys before any query reads them."""
    w_tok = [t for chunk in out.batch for t in chunk.token_ids]
    w_pos = [p for chunk in out.batch for p in range(chunk.start, chunk.context_len)]
    r_tok = [t for s in readers for t in s.token_ids[: s.num_computed_tokens]]
    r_pos = [p for s in readers for p in range(s.num_computed_tokens)]
    w_tok, w_pos = torch.tensor(w_tok), torch.tensor(w_pos)
    r_tok, r_pos = torch.tensor(r_tok), torch.tensor(r_pos)
    hit = torch.isin(cached, writes)
    order = torch.argsort(writes)
    idx = order[torch.searchsorted(writes[order], cached[hit])]
    return bool(((w_tok[idx] == r_tok[hit]) & (w_pos[idx] == r_pos[hit])).all())
