"""The projectors from SigLIP's last hidden state [patches, vision hidden] to the language
model's image-token embeddings, as transformers' modeling files compute them:

- PaliGemma (PaliGemmaMultiModalProjector): one Linear with bias, every patch one token. No
  scaling here: transformers 5 scales the token embeddings by sqrt(hidden_size) inside the
  embedding (Gemma's normalizer) and the image features replace already-scaled rows, so they go
  in as projected (transformers 4.4x divided them by sqrt(hidden_size) before a scaling that
  covered both; the net is the same).
- Gemma 3 (Gemma3MultiModalProjector): the patch grid average-pooled to mm_tokens_per_image
  tokens (kernel = stride = patches per side / tokens per side), RMSNorm with (1 + w) in
  float32, then a matmul by mm_input_projection_weight [vision hidden, text hidden].

Replicated on every rank (the tower itself is split, models/vision_sharding.py): one small
matmul per image (PaliGemma-3B's is 1152 x 2048, 2.4M parameters), not worth a collective.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.layers.layernorm import RMSNorm
from pytgi_shard.weights.reader import Weights


class PaliGemmaProjector(nn.Module):
    def __init__(self, weights: Weights, prefix: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(weights.get_tensor(f"{prefix}.linear.weight"),
                                   requires_grad=False)
        self.bias = nn.Parameter(weights.get_tensor(f"{prefix}.linear.bias"), requires_grad=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return F.linear(features, self.weight, self.bias)


class Gemma3Projector(nn.Module):
    def __init__(self, weights: Weights, prefix: str, patches_per_side: int, tokens: int,
                 eps: float) -> None:
        super().__init__()
        side = math.isqrt(tokens)
        if side * side != tokens or patches_per_side % side:
            raise ValueError(f"gemma3 mm_tokens_per_image {tokens} is not a square whose side "
                             f"divides the tower's {patches_per_side} patches a side")
        self.patches_per_side = patches_per_side
        self.kernel = patches_per_side // side
        self.norm = RMSNorm.load(weights, f"{prefix}.mm_soft_emb_norm", eps, plus_one=True)
        self.weight = nn.Parameter(weights.get_tensor(f"{prefix}.mm_input_projection_weight"),
                                   requires_grad=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[patches, vision hidden] (row-major patch grid) -> [tokens, text hidden]."""
        n, hidden = features.shape
        grid = features.transpose(0, 1).reshape(1, hidden, self.patches_per_side,
                                                self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2)[0].transpose(0, 1)
        return torch.matmul(self.norm(pooled), self.weight).to(features.dtype)
