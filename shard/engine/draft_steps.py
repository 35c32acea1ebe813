"""The forwards of a drafting step over a drafter's own paged KV cache, shared by the draft model
(shard/engine/draft_model.py) and the EAGLE-3 head (shard/engine/eagle3.py): which rows a
step's catch-up feeds and which of them draft (`plan_catch_up`), the catch-up's one varlen
forward over the fed positions (`catch_up_inputs`), and the one-position forwards that feed
drafts 2..k (`one_position_meta`).

Both drafters' caches have the target cache's block ids, so the batch's slot and block tables
index them as they index the target's: these build the same metadata the target's forwards
would over the same positions, only for the drafter's cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.engine.batch import Batch

# Catch-up tokens per step until Warmup sets the prefill budget.
CATCH_UP_TOKENS = 512

# A catch-up's fed rows, as (batch row, start, end): positions [start, end) go into the cache.
Feed = list[tuple[int, int, int]]


def plan_catch_up(
    batch: Batch, asks: Sequence[tuple[int, int]], budget: int, lag: int = 0
) -> tuple[Feed, list[tuple[int, int]]]:
    """The rows fed by a catch-up forward, as (row, start, end) positions from each row's
    DraftState.written to its length less `lag` (an EAGLE-3 head's cache ends a position
    before the newest token, shard/engine/eagle3.py), and the ones that draft, as (index into
    the feed, k): a row drafts once its catch-up fits what is left of `budget` tokens; the first
    that does not fit takes what is left. A row with nothing to catch up is skipped (its first
    draft needs the catch-up's last position)."""
    feed: Feed = []
    drafting: list[tuple[int, int]] = []
    for row, k in asks:
        r = batch.requests[row]
        assert r.draft is not None, "plan_asks asks only rows with a DraftState"
        start, end = r.draft.written, r.length - lag
        if end <= start:
            continue
        if end - start <= budget:
            drafting.append((len(feed), k))
            feed.append((row, start, end))
            budget -= end - start
        elif budget > 0:
            feed.append((row, start, start + budget))
            budget = 0
    return feed, drafting


@dataclass(frozen=True, slots=True)
class CatchUpInputs:
    """A catch-up forward's flat tokens: every fed row's positions [start, end), in feed order."""

    # [tokens] int64: each token's position in its sequence, and its batch row (the drafters
    # read its id, or the id after it, from batch.all_ids with the two).
    positions: torch.Tensor
    row_of_token: torch.Tensor
    # Over the drafter's cache; meta.slot_mapping is each token's KV slot.
    meta: AttentionMetadata
    # [drafting rows] int64: the flat index of each drafting row's last token, whose output
    # gives its first draft ([1]: the last token, when none drafts, so a forward always has
    # an output row to compute).
    last: torch.Tensor


def catch_up_inputs(batch: Batch, feed: Feed, drafting: Sequence[int],
                    block_size: int) -> CatchUpInputs:
    """The inputs of one varlen forward over each fed row's positions [start, end), built on
    the device from the host's plan (one small copy per list, no read back). `drafting`: the
    indexes into `feed` of the rows that draft."""
    device = batch.lengths.device
    counts = [end - start for _, start, end in feed]
    total = sum(counts)
    rows = torch.tensor([row for row, _, _ in feed], dtype=torch.long, device=device)
    q_lens = torch.tensor(counts, dtype=torch.long, device=device)
    cu = torch.nn.functional.pad(torch.cumsum(q_lens, 0), (1, 0))
    fed = torch.repeat_interleave(torch.arange(len(feed), device=device), q_lens,
                                  output_size=total)
    starts = torch.tensor([start for _, start, _ in feed], dtype=torch.long, device=device)
    positions = starts[fed] + torch.arange(total, device=device) - cu[:-1][fed]
    row_of_token = rows[fed]
    meta = AttentionMetadata(
        is_prefill=max(counts) > 1,
        cu_seqlens_q=cu.to(torch.int32),
        seqlens_k=(starts + q_lens).to(torch.int32),
        slot_mapping=batch.slot_table[row_of_token, positions],
        block_tables=batch.block_tables[rows],
        max_seqlen_q=max(counts),
        max_seqlen_k=max(end for _, _, end in feed),
        block_size=block_size,
    )
    ends = [sum(counts[: i + 1]) - 1 for i in drafting]
    last = torch.tensor(ends or [total - 1], dtype=torch.long, device=device)
    return CatchUpInputs(positions, row_of_token, meta, last)


def one_position_meta(batch: Batch, rows: torch.Tensor, positions: torch.Tensor,
                      max_seqlen_k: int, block_size: int) -> AttentionMetadata:
    """A decode forward's metadata for one new token per row: batch row `rows[j]` writes
    position `positions[j]` (its KV into that position's slot) and attends to every position up
    to it. A draft step's positions lie past what the target has (the slots the router holds
    for the verification), so the batch's own decode metadata, which ends at each row's length,
    does not fit. `max_seqlen_k`: the longest row's keys, from the host (no read back)."""
    return AttentionMetadata(
        is_prefill=False,
        cu_seqlens_q=torch.arange(rows.shape[0] + 1, dtype=torch.int32, device=positions.device),
        seqlens_k=(positions + 1).to(torch.int32),
        slot_mapping=batch.slot_table[rows, positions],
        block_tables=batch.block_tables[rows],
        max_seqlen_q=1,
        max_seqlen_k=max_seqlen_k,
        block_size=block_size,
    )
