"""GPT-NeoX (Pythia, GPT-NeoX-20B), tensor-parallel, over the paged cache.

    x = embed_in(ids)
    for each layer:  a = dense(attention(partial_rope(split(query_key_value(ln_1(x))))))
                     x = x + a + mlp(ln_2(x))          parallel residual (use_parallel_residual)
                     or x = x + a; x = x + mlp(ln_2(x))
    logits = embed_out(final_layer_norm(x))

query_key_value interleaves q, k and v per head; rotary covers the first rotary_pct of each head's
dimensions (Pythia: a quarter), the rest pass through.
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
from pytgi_shard.layers.fused_qkv import HeadShape, load_grouped_qkv
from pytgi_shard.layers.layernorm import LayerNorm
from pytgi_shard.layers.linear import RowParallelLinear
from pytgi_shard.layers.lm_head import ParallelLMHead
from pytgi_shard.layers.mlp import PlainMLP
from pytgi_shard.layers.rotary import RotaryEmbedding
from pytgi_shard.layers.self_attention import Rotation, SelfAttention
from pytgi_shard.models.fused_qkv_decoder import DecoderModel
from pytgi_shard.weights.reader import Weights


@dataclass(frozen=True)
class GPTNeoXConfig:
    """config.json read with transformers' GPTNeoXConfig defaults."""

    hidden_size: int
    num_layers: int
    heads: HeadShape
    rotary_dim: int
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    max_position_embeddings: int
    activation: str
    eps: float
    attention_bias: bool
    parallel_residual: bool

    @classmethod
    def from_dict(cls, c: Mapping[str, Any]) -> GPTNeoXConfig:
        hidden, heads = int(c.get("hidden_size", 6144)), int(c.get("num_attention_heads", 64))
        head_dim = hidden // heads
        rotary_pct = float(c.get("rotary_pct", c.get("partial_rotary_factor", 0.25)))
        return cls(
            hidden_size=hidden,
            num_layers=int(c.get("num_hidden_layers", 44)),
            heads=HeadShape(heads, heads, head_dim),
            rotary_dim=int(head_dim * rotary_pct),
            rope_theta=float(c.get("rope_theta", c.get("rotary_emb_base", 10000))),
            rope_scaling=c.get("rope_scaling") or None,
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
            activation=str(c.get("hidden_act", "gelu")),
            eps=float(c.get("layer_norm_eps", 1e-5)),
            attention_bias=bool(c.get("attention_bias", True)),
            parallel_residual=bool(c.get("use_parallel_residual", True)),
        )


class GPTNeoXLayer(nn.Module):
    def __init__(
        self, config: GPTNeoXConfig, weights: Weights, prefix: str, layer_idx: int,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm.load(weights, f"{prefix}.input_layernorm", config.eps)
        self.post_attention_layernorm = LayerNorm.load(
            weights, f"{prefix}.post_attention_layernorm", config.eps
        )
        bias = config.attention_bias
        self.attention = SelfAttention(
            load_grouped_qkv(weights, f"{prefix}.attention.query_key_value", config.heads, bias),
            RowParallelLinear.load(weights, f"{prefix}.attention.dense", bias),
            config.heads, weights, layer_idx, backend, rotary_dim=config.rotary_dim,
        )
        self.mlp = PlainMLP.load(
            weights, f"{prefix}.mlp.dense_h_to_4h", f"{prefix}.mlp.dense_4h_to_h", config.activation
        )
        self.parallel_residual = config.parallel_residual

    def forward(
        self, x: torch.Tensor, rotation: Rotation, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(x), rotation, kv_cache, meta)
        if self.parallel_residual:
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTNeoX(DecoderModel[GPTNeoXConfig]):
    def __init__(
        self, config: GPTNeoXConfig, weights: Weights, backend: AttentionBackend
    ) -> None:
        super().__init__(config, weights, backend)
        self.embed_in = VocabParallelEmbedding.load(weights, "gpt_neox.embed_in.weight")
        self.layers = nn.ModuleList(
            GPTNeoXLayer(config, weights, f"gpt_neox.layers.{i}", i, backend)
            for i in range(config.num_layers)
        )
        self.final_layer_norm = LayerNorm.load(weights, "gpt_neox.final_layer_norm", config.eps)
        self.embed_out = ParallelLMHead.load(weights, "embed_out.weight")
        self.rotary = RotaryEmbedding(
            config.rotary_dim, config.rope_theta, config.max_position_embeddings,
            config.rope_scaling, weights.dist.device,
        )
        self.set_shapes(
            "gpt_neox", config.heads, config.num_layers, weights, "embed_out.weight",
            config.max_position_embeddings,
        )

    @classmethod
    def read_config(cls, raw: Mapping[str, Any]) -> GPTNeoXConfig:
        return GPTNeoXConfig.from_dict(raw)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_in(input_ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.embed_out(self.final_layer_norm(hidden))
