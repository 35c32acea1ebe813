"""T5's relative position bias: a learned scalar per head and bucket of (key - query) distance.

T5 has no position embeddings. Instead the first layer of each stack owns an embedding of
`num_buckets` rows by heads; every attention score of every layer of that stack gets the row of
its distance bucket added (unscaled). Half the buckets count exact small distances, the other
half logarithmically wider ones up to `max_distance`; the encoder's buckets are bidirectional
(half of them for keys after the query), the decoder's causal (only keys at or before it).

Tensor-parallel: heads are split across ranks like the attention projections, so each rank
keeps its heads' columns of the embedding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.weights.reader import Weights


def relative_position_bucket(
    relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """The bucket (int64, in [0, num_buckets)) of each relative position key - query, with
    transformers' T5Attention._relative_position_bucket's arithmetic (held equal by a test)."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).to(torch.long) * num_buckets
        distance = relative.abs()
    else:
        distance = -torch.clamp(relative, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # float32 log as transformers computes it; distance 0 is masked out by is_small.
    large = max_exact + (
        torch.log(distance.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """This rank's heads' bias for given (query, key) position pairs."""

    def __init__(
        self, weight: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
    ) -> None:
        super().__init__()
        # [num_buckets, heads of this rank]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bidirectional = bidirectional
        self.num_buckets = num_buckets
        self.max_distance = max_distance

    @classmethod
    def load(
        cls, weights: Weights, name: str, bidirectional: bool, num_buckets: int, max_distance: int
    ) -> RelativePositionBias:
        """`name`: the checkpoint's embedding [num_buckets, num_heads], split by heads."""
        return cls(weights.get_sharded(name, dim=1), bidirectional, num_buckets, max_distance)

    def forward(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """[..., heads, q, k]: the bias of every query position (query_pos [..., q]) toward every
        key position (key_pos [..., k]; leading dims broadcast), in the weight's dtype."""
        relative = key_pos.unsqueeze(-2) - query_pos.unsqueeze(-1)
        buckets = relative_position_bucket(
            relative, self.bidirectional, self.num_buckets, self.max_distance
        )
        return F.embedding(buckets, self.weight).movedim(-1, -3)
