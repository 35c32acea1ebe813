"""Root-mean-square layer normalisation (Llama family)."""

from __future__ import annotations

import torch
from torch import nn

from pytgi_shard.weights import Weights


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in float32 whatever the model dtype (as trained)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    @classmethod
    def load(cls, weights: Weights, prefix: str, eps: float) -> RMSNorm:
        return cls(weights.get_tensor(f"{prefix}.weight"), eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
