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

    # [positions] int64: each position's row among the drafting rows, and its j - 1.
    owner: torch.Tensor
    offset: torch.Tensor
    # Per position (host): its batch row and j.
    batch_rows: list[int]
    steps: list[int]


def drafted_positions(drafts: Drafts, device: torch.device) -> DraftedPositions:
    """Positions j = 1 .. len(tokens) of every drafting row."""
    batch_rows = [row for row, t in zip(drafts.rows, drafts.tokens, strict=True) for _ in t]
    steps = [j for t in drafts.tokens for j in range(1, len(t) + 1)]
    owners = [i for i, t in enumerate(drafts.tokens) for _ in t]
    return DraftedPositions(
        owner=torch.tensor(owners, dtype=torch.long, device=device),
        offset=torch.tensor(steps, dtype=torch.long, device=device) - 1,
        batch_rows=batch_rows,
        steps=steps,
    )


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
    batch: Batch, drafts: Drafts, positions: DraftedPositions, padded: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """([positions, width] ids, [positions] lengths): each position's history, its row's
    known tokens before the step, then the drafts before it. Called after the step's plain
    token was appended (batch.lengths counts it; the drafts are written over it)."""
    device = batch.lengths.device
    rows = torch.tensor(drafts.rows, dtype=torch.long, device=device)
    row_of = rows[positions.owner]
    history = batch.all_ids.index_select(0, row_of)
    known = (batch.lengths[rows] - 1)[positions.owner]
    k = padded.shape[1]
    column = known.unsqueeze(1) + torch.arange(k, device=device)
    written = torch.arange(k, device=device) <= positions.offset.unsqueeze(1)
    flat = torch.arange(len(positions.steps), device=device).unsqueeze(1).expand(-1, k)
    history[flat[written], column[written]] = padded[positions.owner][written]
    return history, known + positions.offset + 1


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
