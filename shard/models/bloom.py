"""BLOOM, tensor-parallel, over the paged cache.

    x = word_embeddings_layernorm(word_embeddings(ids))
    for each layer:  a = dense(attention(split(query_key_value(ln_1(x))), alibi)) + x
                     x = mlp(ln_2(a)) + a
    logits = lm_head(ln_f(x))                          lm_head tied to word_embeddings

No position embeddings: ALiBi biases each head's scores by its slope times the distance (each
rank passes its heads' slopes to the attention backend). query_key_value interleaves q, k and v
per head. With apply_residual_connection_post_layernorm the residuals are the norms' outputs.
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
from pytgi_shard.layers.fused_qkv import HeadShape, load_grouped_qkv
from pytgi_shard.layers.layernorm import LayerNorm
from pytgi_shard.layers.linear import RowParallelLinear
from pytgi_shard.layers.lm_head import ParallelLMHead
from pytgi_shard.layers.mlp import PlainMLP
from pytgi_shard.layers.self_attention import Rotation, SelfAttention
from pytgi_shard.models.fused_qkv_decoder import DecoderModel
from pytgi_shard.weights.reader import Weights


@dataclass(frozen=True)
class BloomConfig:
    """config.json read with transformers' BloomConfig defaults."""

    num_layers: int
    heads: HeadShape
    eps: float
    residual_after_norm: bool
    # BLOOM states no position limit (ALiBi extrapolates); the length it was trained at.
    max_position_embeddings: int

    @classmethod
    def from_dict(cls, c: Mapping[str, Any]) -> BloomConfig:
        hidden = int(c.get("n_embed") or c.get("hidden_size", 64))
        heads = int(c.get("n_head", c.get("num_attention_heads", 8)))
        return cls(
            num_layers=int(c.get("n_layer", c.get("num_hidden_layers", 2))),
            heads=HeadShape(heads, heads, hidden // heads),
            eps=float(c.get("layer_norm_epsilon", 1e-5)),
            residual_after_norm=bool(c.get("apply_residual_connection_post_layernorm", False)),
            max_position_embeddings=int(c.get("seq_length") or 2048),
        )


class BloomBlock(nn.Module):
    def __init__(
        self, config: BloomConfig, weights: Weights, prefix: str, layer_idx: int,
        backend: AttentionBackend, slopes: torch.Tensor,
    ) -> None:
        super().__init__()
        eps = config.eps
        self.input_layernorm = LayerNorm.load(weights, f"{prefix}.input_layernorm", eps)
        self.post_attention_layernorm = LayerNorm.load(
            weights, f"{prefix}.post_attention_layernorm", eps
        )
        attn = f"{prefix}.self_attention"
        self.self_attention = SelfAttention(
            load_grouped_qkv(weights, f"{attn}.query_key_value", config.heads, True),
            RowParallelLinear.load(weights, f"{attn}.dense", True),
            config.heads, weights, layer_idx, backend, alibi_slopes=slopes,
        )
        # BLOOM's gelu is the tanh approximation.
        self.mlp = PlainMLP.load(
            weights, f"{prefix}.mlp.dense_h_to_4h", f"{prefix}.mlp.dense_4h_to_h", "gelu_new"
        )
        self.residual_after_norm = config.residual_after_norm

    def forward(
        self, x: torch.Tensor, rotation: Rotation, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        normed = self.input_layernorm(x)
        residual = normed if self.residual_after_norm else x
        x = self.self_attention(normed, rotation, kv_cache, meta) + residual
        normed = self.post_attention_layernorm(x)
        residual = normed if self.residual_after_norm else x
        return self.mlp(normed) + residual


class Bloom(DecoderModel[BloomConfig]):
    def __init__(self, config: BloomConfig, weights: Weights, backend: AttentionBackend) -> None:
        super().__init__(config, weights, backend)
        dist = weights.dist
        root = "transformer." if "transformer.word_embeddings.weight" in weights else ""
        embed = f"{root}word_embeddings.weight"
        self.word_embeddings = VocabParallelEmbedding.load(weights, embed)
        self.word_embeddings_layernorm = LayerNorm.load(
            weights, f"{root}word_embeddings_layernorm", config.eps
        )
        slopes = rank_alibi_slopes(config.heads.num_heads, dist)
        self.layers = nn.ModuleList(
            BloomBlock(config, weights, f"{root}h.{i}", i, backend, slopes)
            for i in range(config.num_layers)
        )
        self.ln_f = LayerNorm.load(weights, f"{root}ln_f", config.eps)
        self.lm_head = ParallelLMHead.load(weights, embed)
        self.set_shapes(
            "bloom", config.heads, config.num_layers, weights, embed,
            config.max_position_embeddings,
        )

    @classmethod
    def read_config(cls, raw: Mapping[str, Any]) -> BloomConfig:
        return BloomConfig.from_dict(raw)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings_layernorm(self.word_embeddings(input_ids))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))
