"""A verification step's drafted positions as rows of a NextTokenChooser: each position's token
chosen exactly as the plain step would choose it there, had the drafts before it been emitted.

Position j of a row that drafted d_0 .. d_(n-1) (j = 1 .. n; position 0 is the step's plain row,
chosen by the batch's own chooser) holds the target's logits after d_(j-1). Its choice runs
through a chooser whose row j has:

- the request's parameters (temperature, top-k, top-p, typical-p, penalties, watermark);
- its history with d_0 .. d_(j-1) after its known tokens (the repetition and frequency
  penalties count them, the watermark's green list follows d_(j-1));
- the draws of its token index (the request's next index + j: shard/sample/token_draws.py),
  so a sampling row draws there what a plain run draws for that token;
- for a grammar-constrained row, the mask of its matcher advanced through d_0 .. d_(j-1) (a
  copy of it: BatchGrammar.drafted_banned).

Every row of this chooser is chosen as if it ran alone (shard/sample/chooser.py), so the tokens,
logprobs and top tokens of a kept position are those of the plain run's step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.drafting import Drafts
from pytgi_shard.sample.chooser import NextTokenChooser
from pytgi_shard.structured_output.masks import SharedBias


@dataclass(frozen=True, slots=True)
class DraftedPositions:
    """The positions j = 1 .. n of each drafting row, flat in Drafts.rows' order."""

    # [positions] int64: each position's batch row and its j.
    batch_row: torch.Tensor
    step: torch.Tensor
    # The same on the host.
    batch_rows: list[int]
    steps: list[int]


def drafted_positions(drafts: Drafts, device: torch.device) -> DraftedPositions:
    """Positions j = 1 .. len(tokens) of every drafting row."""
    batch_rows = [row for row, t in zip(drafts.rows, drafts.tokens, strict=True) for _ in t]
    steps = [j for t in drafts.tokens for j in range(1, len(t) + 1)]
    both = torch.tensor([batch_rows, steps], dtype=torch.long).to(device, non_blocking=True)
    return DraftedPositions(both[0], both[1], batch_rows, steps)


def position_chooser(batch: Batch, positions: DraftedPositions) -> NextTokenChooser:
    """The chooser of the positions: each its request's parameters and its token's draws. The
    batch's chooser has drawn the step's plain token (index i): position j draws i + j, which
    is the batch chooser's next index plus j - 1."""
    chooser = batch.chooser
    params = [chooser.params[row] for row in positions.batch_rows]
    draws = [
        None if d is None else d.at(j - 1)
        for d, j in zip((chooser.draws[row] for row in positions.batch_rows), positions.steps,
                        strict=True)
    ]
    out = NextTokenChooser(params, draws, chooser.device, chooser.watermark)
    out.inverse_transform = chooser.inverse_transform
    return out


def drafted_history(
    batch: Batch, drafts: Drafts, positions: DraftedPositions, chooser: NextTokenChooser
) -> tuple[torch.Tensor, torch.Tensor]:
    """([positions, width] ids, [positions] lengths): each position's history, its row's
    known tokens before the step, then the drafts before it; only for a chooser that reads
    histories (penalties, watermark; else empty: the greedy and plain sampling rows that
    most drafting steps have pay nothing for it). Called after the step's plain token was
    appended (batch.lengths counts it; the drafts are written over it)."""
    device = batch.lengths.device
    if chooser.repetition is None and chooser.frequency is None and not chooser.watermark_rows:
        return batch.all_ids[:0], batch.lengths[:0]
    # The positions' own drafts, flat: position (row, j) writes its row's d_0 .. d_(j-1).
    columns: list[int] = []
    values: list[int] = []
    owners: list[int] = []
    at = 0
    for tokens in drafts.tokens:
        for j in range(1, len(tokens) + 1):
            owners.extend([at] * j)
            columns.extend(range(j))
            values.extend(tokens[:j])
            at += 1
    history = batch.all_ids.index_select(0, positions.batch_row)
    known = batch.lengths.index_select(0, positions.batch_row) - 1
    owner = torch.tensor(owners, dtype=torch.long, device=device)
    column = known[owner] + torch.tensor(columns, dtype=torch.long, device=device)
    history[owner, column] = torch.tensor(values, dtype=torch.long, device=device)
    return history, known + positions.step


def drafted_banned(
    batch: Batch, drafts: Drafts, positions: DraftedPositions, first: list[int]
) -> tuple[torch.Tensor | None, torch.Tensor | SharedBias] | None:
    """The constrained positions' grammar masks, as the chooser takes them (None: no drafting
    row is constrained). `first`: each drafting row's plain token this step."""
    grammar = batch.grammar
    if grammar is None:
        return None
    return grammar.drafted_banned(
        drafts.rows, drafts.tokens, first, positions.batch_rows
    )
