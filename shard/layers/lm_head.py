"""The output projection to the vocabulary, split by vocabulary rows when they divide evenly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.device.distributed import Dist
from pytgi_shard.weights.reader import Weights


class ParallelLMHead(nn.Module):
    """Each rank computes logits for its vocab slice; all-gather gives every rank all of them.

    Every rank needs the full row because sampling runs identically on all ranks (same seeds).
    A vocabulary that does not divide by world_size is kept whole on every rank instead.
    """

    def __init__(self, weight: torch.Tensor, sharded: bool, dist: Dist) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.sharded = sharded and dist.world_size > 1
        self.dist = dist

    @classmethod
    def load(cls, weights: Weights, name: str) -> ParallelLMHead:
        dist = weights.dist
        if weights.shape(name)[0] % dist.world_size == 0:
            return cls(weights.get_sharded(name, dim=0), True, dist)
        return cls(weights.get_tensor(name), False, dist)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab]."""
        logits = F.linear(hidden, self.weight)
        if self.sharded:
            logits = self.dist.all_gather(logits, dim=-1)
        return logits.float()
