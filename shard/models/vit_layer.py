"""The pre-norm ViT encoder layer CLIP's and SigLIP's towers share (transformers' CLIPEncoderLayer
and SiglipEncoderLayer store the same names), tensor-parallel as the text decoder's layers:

    x = x + out_proj(attention(q, k, v))   on layer_norm1(x)   # q|k|v column-, out_proj row-
    x = x + fc2(act(fc1(x)))               on layer_norm2(x)   # fc1 column-, fc2 row-parallel

`weights` is the tower's view (models/vision_sharding.py): split over the decoder's ranks, or a
world of one when the tower is replicated. Attention is full (not causal) over each sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.layers.layernorm import LayerNorm
from pytgi_shard.layers.linear import ColumnParallelLinear, RowParallelLinear, load_qkv
from pytgi_shard.layers.mlp import activation
from pytgi_shard.weights.reader import Weights


class ViTLayer(nn.Module):
    def __init__(self, weights: Weights, prefix: str, hidden_size: int, num_heads: int,
                 hidden_act: str, eps: float) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm.load(weights, f"{prefix}.layer_norm1", eps)
        self.layer_norm2 = LayerNorm.load(weights, f"{prefix}.layer_norm2", eps)
        attn = f"{prefix}.self_attn"
        # q, k and v fused into one matmul: one read of the normed rows instead of three.
        self.qkv = load_qkv(weights, attn, num_heads, num_heads, bias=True)
        self.out_proj = RowParallelLinear.load(weights, f"{attn}.out_proj", bias=True)
        self.fc1 = ColumnParallelLinear.load(weights, f"{prefix}.mlp.fc1", bias=True)
        self.fc2 = RowParallelLinear.load(weights, f"{prefix}.mlp.fc2", bias=True)
        self.act = activation(hidden_act)
        self.num_heads = num_heads // weights.dist.world_size  # this rank's
        self.head_dim = hidden_size // num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., tokens, hidden]: one sequence, or a batch of them (CLIP's tiles)."""
        *lead, n, _ = x.shape
        qkv = self.qkv(self.layer_norm1(x)).view(*lead, n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.movedim(-3, 0).transpose(-3, -2).unbind(0)  # each [..., heads, n, d]
        # SDPA's default scale is head_dim ** -0.5, CLIP's and SigLIP's.
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        x = x + self.out_proj(attended.transpose(-3, -2).reshape(*lead, n, -1))
        return x + self.fc2(self.act(self.fc1(self.layer_norm2(x))))
