"""MPT (MosaicML), tensor-parallel, over the paged cache.

    x = wte(ids)
    for each layer:  x = x + out_proj(attention(split(clip(Wqkv(norm_1(x)))), alibi))
                     x = x + down_proj(gelu(up_proj(norm_2(x))))
    logits = lm_head(norm_f(x))                       lm_head tied to wte

No biases anywhere (the norms included); ALiBi with MPT's alibi_bias_max; Wqkv stacks q, k and v,
clamped to +-clip_qkv when the config sets it. alibi_bias_max is read as MosaicML's code reads
it (transformers' port always uses 8, the value every published MPT has).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.layers.alibi import rank_alibi_slopes
from pytgi_shard.layers.embedding import VocabParallelEmbedding
from pytgi_shard.layers.fused_qkv import HeadShape, load_stacked_qkv
from pytgi_shard.layers.layernorm import LayerNorm
from pytgi_shard.layers.linear import RowParallelLinear
from pytgi_shard.layers.lm_head import ParallelLMHead
from pytgi_shard.layers.mlp import PlainMLP
from pytgi_shard.layers.self_attention import Rotation, SelfAttention
from pytgi_shard.models.fused_qkv_decoder import DecoderModel
from pytgi_shard.weights.reader import Weights

# attn_config options transformers' MPT ignores but a checkpoint might rely on: refused.
_UNSUPPORTED = {"qk_ln": False, "prefix_lm": False, "attn_uses_sequence_id": False}


@dataclass(frozen=True)
class MPTConfig:
    """config.json read with transformers' MptConfig defaults."""

    num_layers: int
    heads: HeadShape
    eps: float
    scale: float | None
    clip_qkv: float | None
    alibi_bias_max: float
    max_position_embeddings: int

    @classmethod
    def from_dict(cls, c: Mapping[str, Any]) -> MPTConfig:
        attn = dict(c.get("attn_config") or {})
        for key, default in _UNSUPPORTED.items():
            if attn.get(key, default) != default:
                raise ValueError(f"mpt with attn_config.{key}={attn[key]!r} is not supported")
        hidden, heads = int(c.get("d_model", 2048)), int(c.get("n_heads", 16))
        scale, clip = attn.get("softmax_scale"), attn.get("clip_qkv")
        return cls(
            num_layers=int(c.get("n_layers", 24)),
            heads=HeadShape(heads, heads, hidden // heads),
            eps=float(c.get("layer_norm_epsilon", 1e-5)),
            scale=None if scale is None else float(scale),
            clip_qkv=float(clip) if clip else None,
            alibi_bias_max=float(attn.get("alibi_bias_max", 8)),
            max_position_embeddings=int(c.get("max_seq_len", 2048)),
        )


class MPTBlock(nn.Module):
    def __init__(
        self, config: MPTConfig, weights: Weights, prefix: str, layer_idx: int,
        backend: AttentionBackend, slopes: torch.Tensor,
    ) -> None:
        super().__init__()
        self.norm_1 = LayerNorm.load(weights, f"{prefix}.norm_1", config.eps, bias=False)
        self.norm_2 = LayerNorm.load(weights, f"{prefix}.norm_2", config.eps, bias=False)
        self.attn = SelfAttention(
            load_stacked_qkv(weights, f"{prefix}.attn.Wqkv", config.heads, False),
            RowParallelLinear.load(weights, f"{prefix}.attn.out_proj", False),
            config.heads, weights, layer_idx, backend,
            scale=config.scale, clip_qkv=config.clip_qkv, alibi_slopes=slopes,
        )
        self.ffn = PlainMLP.load(
            weights, f"{prefix}.ffn.up_proj", f"{prefix}.ffn.down_proj", "gelu", bias=False
        )

    def forward(
        self, x: torch.Tensor, rotation: Rotation, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), rotation, kv_cache, meta)
        return x + self.ffn(self.norm_2(x))


class MPT(DecoderModel[MPTConfig]):
    def __init__(self, config: MPTConfig, weights: Weights, backend: AttentionBackend) -> None:
        super().__init__(config, weights, backend)
        embed = "transformer.wte.weight"
        self.wte = VocabParallelEmbedding.load(weights, embed)
        slopes = rank_alibi_slopes(config.heads.num_heads, weights.dist, config.alibi_bias_max)
        self.layers = nn.ModuleList(
            MPTBlock(config, weights, f"transformer.blocks.{i}", i, backend, slopes)
            for i in range(config.num_layers)
        )
        self.norm_f = LayerNorm.load(weights, "transformer.norm_f", config.eps, bias=False)
        self.lm_head = ParallelLMHead.load(weights, embed)
        self.set_shapes(
            "mpt", config.heads, config.num_layers, weights, embed, config.max_position_embeddings
        )

    @classmethod
    def read_config(cls, raw: Mapping[str, Any]) -> MPTConfig:
        return MPTConfig.from_dict(raw)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm_f(hidden))
