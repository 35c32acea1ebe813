"""OPT (and Galactica), tensor-parallel, over the paged cache.

    x = project_in(embed_tokens(ids)) + embed_positions(positions + 2)
    for each layer:  x = x + out_proj(attention(q_proj, k_proj, v_proj of ln(x)))
                     x = x + fc2(relu(fc1(ln(x))))
    logits = lm_head(project_out(final_layer_norm(x)))        lm_head tied to embed_tokens

Pre-norm as above when do_layer_norm_before (every size but 350m); post-norm otherwise (each
norm after its residual add, no final norm). project_in/out exist when the embeddings are
narrower than the hidden states (350m); they are small and replicated. The position table's
first two rows are padding (offset 2).
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
from pytgi_shard.layers.fused_qkv import HeadShape
from pytgi_shard.layers.layernorm import LayerNorm
from pytgi_shard.layers.linear import ColumnParallelLinear, RowParallelLinear, load_qkv
from pytgi_shard.layers.lm_head import ParallelLMHead
from pytgi_shard.layers.mlp import PlainMLP
from pytgi_shard.layers.positions import LearnedPositions
from pytgi_shard.layers.self_attention import Rotation, SelfAttention
from pytgi_shard.models.fused_qkv_decoder import DecoderModel
from pytgi_shard.weights.reader import Weights

# OPT's learned positions start after two padding rows.
POSITION_OFFSET = 2


@dataclass(frozen=True)
class OPTConfig:
    """config.json read with transformers' OPTConfig defaults."""

    num_layers: int
    heads: HeadShape
    activation: str
    pre_norm: bool
    final_norm: bool
    affine_norms: bool
    bias: bool

    @classmethod
    def from_dict(cls, c: Mapping[str, Any]) -> OPTConfig:
        hidden, heads = int(c.get("hidden_size", 768)), int(c.get("num_attention_heads", 12))
        pre_norm = bool(c.get("do_layer_norm_before", True))
        return cls(
            num_layers=int(c.get("num_hidden_layers", 12)),
            heads=HeadShape(heads, heads, hidden // heads),
            activation=str(c.get("activation_function", "relu")),
            pre_norm=pre_norm,
            final_norm=pre_norm and not c.get("_remove_final_layer_norm", False),
            affine_norms=bool(c.get("layer_norm_elementwise_affine", True)),
            bias=bool(c.get("enable_bias", True)),
        )


class OPTDecoderLayer(nn.Module):
    def __init__(
        self, config: OPTConfig, weights: Weights, prefix: str, layer_idx: int,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        heads, bias, affine = config.heads, config.bias, config.affine_norms
        self.self_attn_layer_norm = LayerNorm.load(
            weights, f"{prefix}.self_attn_layer_norm", 1e-5, affine=affine
        )
        self.final_layer_norm = LayerNorm.load(
            weights, f"{prefix}.final_layer_norm", 1e-5, affine=affine
        )
        self.self_attn = SelfAttention(
            load_qkv(weights, f"{prefix}.self_attn", heads.num_heads, heads.num_kv_heads, bias),
            RowParallelLinear.load(weights, f"{prefix}.self_attn.out_proj", bias),
            heads, weights, layer_idx, backend,
        )
        self.mlp = PlainMLP.load(weights, f"{prefix}.fc1", f"{prefix}.fc2", config.activation, bias)
        self.pre_norm = config.pre_norm

    def forward(
        self, x: torch.Tensor, rotation: Rotation, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), rotation, kv_cache, meta)
            return x + self.mlp(self.final_layer_norm(x))
        x = self.self_attn_layer_norm(x + self.self_attn(x, rotation, kv_cache, meta))
        return self.final_layer_norm(x + self.mlp(x))


def _replicated(weights: Weights, name: str) -> ColumnParallelLinear | None:
    """project_in / project_out: whole on every rank (a few hundred thousand parameters)."""
    return ColumnParallelLinear(weights.get_tensor(name), None) if name in weights else None


class OPT(DecoderModel[OPTConfig]):
    learned_positions = True

    def __init__(self, config: OPTConfig, weights: Weights, backend: AttentionBackend) -> None:
        super().__init__(config, weights, backend)
        root = "model.decoder." if "model.decoder.embed_tokens.weight" in weights else "decoder."
        embed = f"{root}embed_tokens.weight"
        self.embed_tokens = VocabParallelEmbedding.load(weights, embed)
        self.embed_positions = LearnedPositions.load(
            weights, f"{root}embed_positions.weight", POSITION_OFFSET
        )
        self.project_in = _replicated(weights, f"{root}project_in.weight")
        self.project_out = _replicated(weights, f"{root}project_out.weight")
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, weights, f"{root}layers.{i}", i, backend)
            for i in range(config.num_layers)
        )
        self.final_layer_norm = (
            LayerNorm.load(weights, f"{root}final_layer_norm", 1e-5, affine=config.affine_norms)
            if config.final_norm else None
        )
        head = embed if "lm_head.weight" not in weights else "lm_head.weight"
        self.lm_head = ParallelLMHead.load(weights, head)
        self.set_shapes(
            "opt", config.heads, config.num_layers, weights, head,
            self.embed_positions.max_positions,
        )

    @classmethod
    def read_config(cls, raw: Mapping[str, Any]) -> OPTConfig:
        return OPTConfig.from_dict(raw)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        return hidden + self.embed_positions(positions)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return self.lm_head(hidden)
