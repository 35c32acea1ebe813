"""The rows of a batch that top-p and typical-p run on, with their values.

A warper must leave the rows that did not ask for it alone. Run over the whole batch with the
neutral value 1.0 for the others, it did not: in float32 a running mass reaches 1.0 before the end
of a row, and the tokens past that point were masked (a top_p = 1.0 row at temperature 0.1 kept
332 of 4,096 tokens; beside a typical_p request, a top-k request lost its second-best token from
its top tokens). So the warpers keep every token of a row whose value is neutral
(chooser._top_p and _typical_p, and their candidate forms), and they run on a copy of just the
rows that asked for either when not every row did: a batch with one top-p request sorts one
row, not the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class WarpedRows:
    """The batch rows with a top-p or typical-p below 1.0, and their values as [rows, 1]
    columns (None for a warper none of them uses; 1.0, neutral, for a row that asked only for
    the other one)."""

    # Their indices in the batch; None when they are every row of it (no copy needed).
    index: torch.Tensor | None
    top_p: torch.Tensor | None
    typical_p: torch.Tensor | None
    # Every one of these rows has a top-k: the warpers may run over its candidates alone
    # (shard/sample/candidate_warpers.py).
    top_k_everywhere: bool

    @classmethod
    def of(
        cls,
        top_p: Sequence[float],
        typical_p: Sequence[float],
        top_k: Sequence[int],
        device: torch.device,
    ) -> WarpedRows | None:
        """The warped rows of a batch whose rows have these parameters; None if there are none."""
        rows = [i for i, (p, t) in enumerate(zip(top_p, typical_p, strict=True)) if p < 1 or t < 1]
        if not rows:
            return None
        index = None
        if len(rows) < len(top_p):
            index = torch.tensor(rows, dtype=torch.long, device=device)
        return cls(
            index=index,
            top_p=_column_unless_neutral([top_p[i] for i in rows], device),
            typical_p=_column_unless_neutral([typical_p[i] for i in rows], device),
            top_k_everywhere=all(top_k[i] > 0 for i in rows),
        )

    def select(self, batch: torch.Tensor) -> torch.Tensor:
        """These rows of a [batch, ...] tensor: the tensor itself when they are all of it, else
        a copy to warp and `put_back`."""
        return batch if self.index is None else batch.index_select(0, self.index)

    def put_back(self, scores: torch.Tensor, warped: torch.Tensor) -> None:
        """Writes the warped copy made by `select(scores)` back into its rows of `scores`."""
        if self.index is not None:
            scores.index_copy_(0, self.index, warped)


def _column_unless_neutral(values: list[float], device: torch.device) -> torch.Tensor | None:
    """A [rows, 1] float32 column of `values`, or None when every one is 1.0 (the warper off)."""
    if all(v >= 1 for v in values):
        return None
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
