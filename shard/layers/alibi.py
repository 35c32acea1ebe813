"""ALiBi (attention with linear biases, BLOOM and MPT): per-head slopes, this rank's share.

Instead of position embeddings, head h adds slope_h * (key position - query position) to its
scores; the attention backends take the slopes (attention/backend.py `alibi_slopes`). The slopes
are MPT's build_mpt_alibi_tensor's, 2^(-max_bias * i / n) for the n heads rounded up to a power
of two, with the odd ones first when n is not a power of two; with max_bias 8 they are BLOOM's
build_alibi_tensor's exactly (the test holds both equal to transformers').
"""

from __future__ import annotations

import math

import torch

from pytgi_shard.device.distributed import Dist


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """float32 [num_heads]: every head's slope."""
    padded = 2 ** math.ceil(math.log2(num_heads))
    exponents = torch.arange(1, padded + 1, dtype=torch.float32) * (max_bias / padded)
    slopes = 1.0 / torch.pow(2, exponents)
    if padded != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


def rank_alibi_slopes(num_heads: int, dist: Dist, max_bias: float = 8.0) -> torch.Tensor:
    """The slopes of this rank's query heads (the heads split evenly, in order), on its device."""
    per_rank = num_heads // dist.world_size
    slopes = alibi_slopes(num_heads, max_bias)[dist.rank * per_rank : (dist.rank + 1) * per_rank]
    return slopes.contiguous().to(dist.device)
