"""Falcon, tensor-parallel, over the paged cache.

    x = word_embeddings(ids)
    for each layer:  a = dense(attention(rope(split(query_key_value(ln(x))))))
                     parallel_attn:  x = x + a + mlp(ln(x))       (7B: one norm shared;
                                                                   40B/180B: ln_attn and ln_mlp)
                     otherwise:      x = x + a; x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(ln_f(x))

Falcon-7B is multi-query (one KV head after the query heads, replicated on every rank);
the "new decoder architecture" (40B, 180B, Falcon 2) groups its query heads with num_kv_heads
key/value heads, fused per group. Without either, q/k/v are interleaved per head.
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
from pytgi_shard.layers.embedding import VocabParallelEmbedding
from pytgi_shard.layers.fused_qkv import HeadShape, load_grouped_qkv, load_stacked_qkv
from pytgi_shard.layers.layernorm import LayerNorm
from pytgi_shard.layers.linear import RowParallelLinear
from pytgi_shard.layers.lm_head import ParallelLMHead
from pytgi_shard.layers.mlp import PlainMLP
from pytgi_shard.layers.rotary import RotaryEmbedding
from pytgi_shard.layers.self_attention import Rotation, SelfAttention
from pytgi_shard.models.fused_qkv_decoder import DecoderModel
from pytgi_shard.weights.reader import Weights


@dataclass(frozen=True)
class FalconConfig:
    """config.json read with transformers' FalconConfig defaults."""

    hidden_size: int
    num_layers: int
    heads: HeadShape
    # The checkpoint's fused layout: "stacked" (multi-query) or "grouped" (per KV group).
    qkv_layout: str
    ffn_hidden_size: int
    activation: str
    eps: float
    bias: bool
    parallel_attn: bool
    # Two norms (ln_attn, ln_mlp) before the parallel branches rather than one input_layernorm.
    two_norms: bool
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, c: Mapping[str, Any]) -> FalconConfig:
        if c.get("alibi", False):
            raise ValueError("falcon with alibi=True (Falcon-RW) is not supported")
        hidden = int(c.get("hidden_size", 4544))
        heads = int(c.get("num_attention_heads", c.get("n_head", 71)))
        head_dim = hidden // heads
        new_arch = bool(c.get("new_decoder_architecture", False))
        multi_query = bool(c.get("multi_query", True))
        kv_heads = int(c.get("num_kv_heads") or heads) if new_arch else (1 if multi_query else heads)
        num_ln = c.get("num_ln_in_parallel_attn") or (2 if new_arch else 1)
        return cls(
            hidden_size=hidden,
            num_layers=int(c.get("num_hidden_layers", c.get("n_layer", 32))),
            heads=HeadShape(heads, kv_heads, head_dim),
            qkv_layout="stacked" if not new_arch and multi_query else "grouped",
            ffn_hidden_size=int(c.get("ffn_hidden_size") or 4 * hidden),
            activation=str(c.get("activation", "gelu")),
            eps=float(c.get("layer_norm_epsilon", 1e-5)),
            bias=bool(c.get("bias", False)),
            parallel_attn=new_arch or bool(c.get("parallel_attn", True)),
            two_norms=new_arch and int(num_ln) == 2,
            rope_theta=float(c.get("rope_theta", 10000.0)),
            rope_scaling=c.get("rope_scaling") or None,
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        )


class FalconDecoderLayer(nn.Module):
    def __init__(
        self, config: FalconConfig, weights: Weights, prefix: str, layer_idx: int,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        eps = config.eps
        self.two_norms = config.two_norms
        self.parallel_attn = config.parallel_attn
        if config.two_norms:
            self.ln_attn = LayerNorm.load(weights, f"{prefix}.ln_attn", eps)
            self.ln_mlp = LayerNorm.load(weights, f"{prefix}.ln_mlp", eps)
        else:
            self.input_layernorm = LayerNorm.load(weights, f"{prefix}.input_layernorm", eps)
        if not config.parallel_attn:
            self.post_attention_layernorm = LayerNorm.load(
                weights, f"{prefix}.post_attention_layernorm", eps
            )
        attn = f"{prefix}.self_attention"
        load_qkv = load_stacked_qkv if config.qkv_layout == "stacked" else load_grouped_qkv
        self.self_attention = SelfAttention(
            load_qkv(weights, f"{attn}.query_key_value", config.heads, config.bias),
            RowParallelLinear.load(weights, f"{attn}.dense", config.bias),
            config.heads, weights, layer_idx, backend, rotary_dim=config.heads.head_dim,
        )
        self.mlp = PlainMLP.load(
            weights, f"{prefix}.mlp.dense_h_to_4h", f"{prefix}.mlp.dense_4h_to_h",
            config.activation, config.bias,
        )

    def forward(
        self, x: torch.Tensor, rotation: Rotation, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.two_norms:
            attn_in, mlp_in = self.ln_attn(x), self.ln_mlp(x)
        else:
            attn_in = mlp_in = self.input_layernorm(x)
        attn = self.self_attention(attn_in, rotation, kv_cache, meta)
        if self.parallel_attn:
            return x + (self.mlp(mlp_in) + attn)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class Falcon(DecoderModel[FalconConfig]):
    def __init__(self, config: FalconConfig, weights: Weights, backend: AttentionBackend) -> None:
        super().__init__(config, weights, backend)
        embed = "transformer.word_embeddings.weight"
        self.word_embeddings = VocabParallelEmbedding.load(weights, embed)
        self.layers = nn.ModuleList(
            FalconDecoderLayer(config, weights, f"transformer.h.{i}", i, backend)
            for i in range(config.num_layers)
        )
        self.ln_f = LayerNorm.load(weights, "transformer.ln_f", config.eps)
        untied = not config.tie_word_embeddings and "lm_head.weight" in weights
        head = "lm_head.weight" if untied else embed
        self.lm_head = ParallelLMHead.load(weights, head)
        self.rotary = RotaryEmbedding(
            config.heads.head_dim, config.rope_theta, config.max_position_embeddings,
            config.rope_scaling, weights.dist.device,
        )
        self.set_shapes(
            "falcon", config.heads, config.num_layers, weights, head,
            config.max_position_embeddings,
        )

    @classmethod
    def read_config(cls, raw: Mapping[str, Any]) -> FalconConfig:
        return FalconConfig.from_dict(raw)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))
