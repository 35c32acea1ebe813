"""Root-mean-square layer normalisation (Llama family), with the residual add folded in."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.weights import Weights


def triton_kernels_on(device: torch.device) -> bool:
    """Whether the layers run their fused Triton kernels: on CUDA devices, when Triton is there.

    Decided once when a model is built; the eager ops stay the CPU path and the tests' oracle.
    """
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in float32 whatever the model dtype (as trained)."""

    def __init__(self, weight: torch.Tensor, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.fused = fused

    @classmethod
    def load(cls, weights: Weights, prefix: str, eps: float) -> RMSNorm:
        fused = triton_kernels_on(weights.dist.device)
        return cls(weights.get_tensor(f"{prefix}.weight"), eps, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_forward(x, None)[0]

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a decoder layer's residual add and the next
        norm, one kernel on GPU. Without a residual the sum is x."""
        if self.fused and x.dim() == 2 and x.stride(-1) == 1:
            from pytgi_shard.layers.triton_norm import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        total = x if residual is None else x + residual
        return self._eager(total), total

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op instead of five: on small batches each op's dispatch is the cost.
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        # Half precision: normalise in float32, cast, then scale in the model dtype (as HF).
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)
