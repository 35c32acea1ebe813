"""The decoders' norms, each with the residual add folded in: RMSNorm (Llama; Gemma's `(1 + w)`
form), LayerNorm with or without bias or affine weight (StarCoder2, Cohere, GPT-2, OPT, BLOOM,
NeoX, Falcon, MPT), and the per-head LayerNorm of Cohere's q/k norm. Replicated on every rank: the
hidden states they normalise are whole on each rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.weights.reader import Weights


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in float32 whatever the model dtype (as trained).

    Gemma's checkpoints store w for a scale of (1 + w), applied in float32 before the cast back
    (`plus_one`): the weight is kept as float32 (1 + w) and the Llama kernel, which scales in
    the model dtype, is not used for it.
    """

    def __init__(
        self, weight: torch.Tensor, eps: float, fused: bool = False, plus_one: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.fused = fused and not plus_one
        self.plus_one = plus_one

    @classmethod
    def load(cls, weights: Weights, prefix: str, eps: float, plus_one: bool = False) -> RMSNorm:
        # dist.caps.triton_kernels: decided once at start-up; the eager ops stay the CPU path
        # and the tests' oracle.
        fused = weights.dist.caps.triton_kernels
        weight = weights.get_tensor(f"{prefix}.weight")
        if plus_one:
            weight = 1.0 + weight.float()
        return cls(weight, eps, fused, plus_one)

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
        if self.plus_one:
            return F.rms_norm(x.float(), shape, self.weight, self.eps).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        # Half precision: normalise in float32, cast, then scale in the model dtype (as HF).
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias, the statistics in float32 (as trained) and
    cast back, with the same residual-add interface as RMSNorm.

    Without a bias (Cohere, MPT) nothing is added; without a weight (OPT's
    layer_norm_elementwise_affine=False) the normalised value is the output. Weight and bias are
    kept in float32 so no forward converts them.
    """

    def __init__(
        self, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
    ) -> None:
        super().__init__()
        self.weight = None if weight is None else nn.Parameter(weight.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.eps = eps

    @classmethod
    def load(
        cls, weights: Weights, prefix: str, eps: float, bias: bool = True, affine: bool = True
    ) -> LayerNorm:
        """`prefix`.weight and .bias; neither when not `affine`, no bias when not `bias`."""
        w = weights.get_tensor(f"{prefix}.weight") if affine else None
        b = weights.get_tensor(f"{prefix}.bias") if affine and bias else None
        return cls(w, b, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        return F.layer_norm(x.float(), shape, self.weight, self.bias, self.eps).to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x if residual is None else x + residual
        return self(total), total


class HeadLayerNorm(nn.Module):
    """Cohere's q/k norm: a bias-free LayerNorm over each head's dimensions with a weight per
    head ([heads, head_dim]), so each rank holds the rows of its own heads."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps

    @classmethod
    def load(
        cls, weights: Weights, name: str, eps: float, index: int, parts: int
    ) -> HeadLayerNorm:
        """Heads block `index` of `parts` (the rank's query heads, or its KV-head block)."""
        return cls(weights.get_part(name, 0, index, parts), eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim]."""
        normed = F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps)
        return (normed * self.weight).to(x.dtype)
