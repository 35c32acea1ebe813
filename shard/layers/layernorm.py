"""Root-mean-square layer normalisation (Llama family)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
        # One fused op instead of five: on small batches each op's dispatch is the cost.
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        # Half precision: normalise in float32, cast, then scale in the model dtype (as HF).
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)
