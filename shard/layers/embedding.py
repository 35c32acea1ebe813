"""Token embedding split by vocabulary rows across ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.device.distributed import Dist
from pytgi_shard.weights.reader import Weights


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * block, (r + 1) * block); ids outside contribute zeros, then sum.

    block = ceil(vocab / world_size); the last shard is zero-padded so every rank has the same
    shape and no id needs a special case.
    """

    def __init__(self, weight: torch.Tensor, start: int, dist: Dist) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.block = int(weight.shape[0])
        self.dist = dist

    @classmethod
    def load(cls, weights: Weights, name: str) -> VocabParallelEmbedding:
        dist = weights.dist
        vocab = weights.shape(name)[0]
        block = -(-vocab // dist.world_size)
        start = min(dist.rank * block, vocab)
        stop = min(start + block, vocab)
        weight = weights.get_range(name, 0, start, stop)
        if stop - start < block:
            pad = weight.new_zeros((block - (stop - start), weight.shape[1]))
            weight = torch.cat([weight, pad], dim=0)
        return cls(weight, start, dist)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.dist.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.block)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.dist.all_reduce(out)
