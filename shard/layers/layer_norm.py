"""LayerNorm (mean and variance, an affine weight, an optional bias): GPT-2, OPT, BLOOM, NeoX...

Replicated on every rank, like RMSNorm: the hidden states it normalises are whole on each rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.weights import Weights


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias, the statistics in float32 (as trained).

    Without a weight (OPT's layer_norm_elementwise_affine=False) the normalised value is the
    output; without a bias (MPT) nothing is added.
    """

    def __init__(
        self, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
    ) -> None:
        super().__init__()
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.eps = eps

    @classmethod
    def load(
        cls, weights: Weights, prefix: str, eps: float, bias: bool = True, affine: bool = True
    ) -> LayerNorm:
        w = weights.get_tensor(f"{prefix}.weight") if affine else None
        b = weights.get_tensor(f"{prefix}.bias") if affine and bias else None
        return cls(w, b, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:
            return F.layer_norm(x, shape, self.weight, self.bias, self.eps)
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), shape, weight, bias, self.eps).to(x.dtype)
