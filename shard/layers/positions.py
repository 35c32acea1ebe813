"""Learned absolute position embeddings (GPT-2's wpe, OPT's embed_positions), replicated.

Every rank holds the whole table: positions index rows and each row is the full hidden size, so
splitting it would only add a communication. OPT's table starts at row 2 (its first two rows were
reserved for padding when it was trained): `offset` shifts every position by that much.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.weights.reader import Weights


class LearnedPositions(nn.Module):
    """positions [T] -> [T, hidden]: row `position + offset` of the table."""

    def __init__(self, weight: torch.Tensor, offset: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.offset = offset

    @classmethod
    def load(cls, weights: Weights, name: str, offset: int = 0) -> LearnedPositions:
        return cls(weights.get_tensor(name), offset)

    @property
    def max_positions(self) -> int:
        """How many positions the table has a row for (past it, no position exists)."""
        return int(self.weight.shape[0]) - self.offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)
