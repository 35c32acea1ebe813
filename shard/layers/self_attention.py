"""A decoder's self-attention block over the paged cache, shared by the models whose checkpoints
fuse q/k/v (GPT-2, StarCoder, NeoX, Falcon, BLOOM, MPT) and those that do not (OPT).

    q, k, v = split(qkv(x))      this rank's heads, [q | k | v] (layers/fused_qkv.py)
    q, k = rotary(q, k)          on the first `rotary_dim` dims of each head, when given (NeoX's
                                 partial rotary: the rest pass through)
    out(attention(q, k, v))      ALiBi slopes (this rank's heads) when the model has them
"""

from __future__ import annotations

import torch
from torch import nn

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.layers.fused_qkv import HeadShape
from pytgi_shard.layers.linear import ColumnParallelLinear, RowParallelLinear, kv_head_partition
from pytgi_shard.layers.rotary import apply_rotary
from pytgi_shard.weights.reader import Weights

# rotation_tables' (both_cos, signed_sin) for the forward's positions, or None (no rotary).
Rotation = tuple[torch.Tensor, torch.Tensor] | None


class SelfAttention(nn.Module):
    def __init__(
        self,
        qkv: ColumnParallelLinear,
        out: RowParallelLinear,
        heads: HeadShape,
        weights: Weights,
        layer_idx: int,
        backend: AttentionBackend,
        *,
        scale: float | None = None,
        rotary_dim: int = 0,
        clip_qkv: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        dist = weights.dist
        self.qkv = qkv
        self.out = out
        self.head_dim = heads.head_dim
        self.num_heads = heads.num_heads // dist.world_size
        self.num_kv_heads = heads.num_kv_heads // kv_head_partition(heads.num_kv_heads, dist)[1]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = heads.head_dim**-0.5 if scale is None else scale
        self.rotary_dim = rotary_dim
        self.clip_qkv = clip_qkv
        self.alibi_slopes = alibi_slopes
        self.layer_idx = layer_idx
        self.backend = backend

    def _rotate(self, x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        if rotation is None or self.rotary_dim == 0:
            return x
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, *rotation)
        rotated = apply_rotary(x[..., : self.rotary_dim], *rotation)
        return torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)

    def forward(
        self,
        hidden: torch.Tensor,
        rotation: Rotation,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv(hidden)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self._rotate(q.view(-1, self.num_heads, self.head_dim), rotation)
        k = self._rotate(k.view(-1, self.num_kv_heads, self.head_dim), rotation)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        keys, values = kv_cache.keys[self.layer_idx], kv_cache.values[self.layer_idx]
        out = self.backend.forward(
            q, k, v, keys, values, meta, self.scale, alibi_slopes=self.alibi_slopes,
            kv_scales=kv_cache.scales_of(self.layer_idx),
        )
        return self.out(out.reshape(-1, self.q_size))
