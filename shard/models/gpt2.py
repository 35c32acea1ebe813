"""GPT-2 and GPT-BigCode (StarCoder, SantaCoder), tensor-parallel, over the paged cache.

    x = wte(ids) + wpe(positions)
    for each layer:  x = x + c_proj(attention(split(c_attn(ln_1(x)))))
                     x = x + mlp(ln_2(x))                 c_proj(act(c_fc(.)))
    logits = lm_head(ln_f(x))                             lm_head tied to wte

GPT-2 stores its linears as Conv1D ([in, out]) with q/k/v stacked in c_attn; GPT-BigCode stores
nn.Linear, with multi-query attention (one KV head, replicated on every rank) stacked after the
query heads, or without it the per-head interleaved layout. Positions are a learned table.
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
from pytgi_shard.layers.conv1d import load_conv1d_column, load_conv1d_row
from pytgi_shard.layers.embedding import VocabParallelEmbedding
from pytgi_shard.layers.fused_qkv import HeadShape, load_grouped_qkv, load_stacked_qkv
from pytgi_shard.layers.layernorm import LayerNorm
from pytgi_shard.layers.linear import RowParallelLinear
from pytgi_shard.layers.lm_head import ParallelLMHead
from pytgi_shard.layers.mlp import PlainMLP, activation
from pytgi_shard.layers.positions import LearnedPositions
from pytgi_shard.layers.self_attention import Rotation, SelfAttention
from pytgi_shard.models.fused_qkv_decoder import DecoderModel
from pytgi_shard.weights.reader import Weights

# transformers' GPT2Config / GPTBigCodeConfig defaults for keys a config.json may omit.
_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "gpt2": {"activation_function": "gelu_new", "multi_query": False},
    "gpt_bigcode": {"activation_function": "gelu_pytorch_tanh", "multi_query": True},
}


@dataclass(frozen=True)
class GPT2Config:
    model_type: str
    hidden_size: int
    num_layers: int
    heads: HeadShape
    inner_size: int
    activation: str
    eps: float
    scale: float | None
    # GPT-2's scale_attn_by_inverse_layer_idx: layer i's scores are also divided by i + 1.
    scale_by_layer: bool
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> GPT2Config:
        model_type = str(raw["model_type"])
        c = {**_DEFAULTS[model_type], **raw}
        hidden, heads = int(c.get("n_embd", 768)), int(c.get("n_head", 12))
        head_dim = hidden // heads
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_layers=int(c.get("n_layer", 12)),
            heads=HeadShape(heads, 1 if c["multi_query"] else heads, head_dim),
            inner_size=int(c.get("n_inner") or 4 * hidden),
            activation=str(c["activation_function"]),
            eps=float(c.get("layer_norm_epsilon", 1e-5)),
            scale=None if c.get("scale_attn_weights", True) else 1.0,
            scale_by_layer=bool(c.get("scale_attn_by_inverse_layer_idx", False)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        )


class GPT2Block(nn.Module):
    def __init__(
        self, config: GPT2Config, weights: Weights, prefix: str, layer_idx: int,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.ln_1 = LayerNorm.load(weights, f"{prefix}.ln_1", config.eps)
        self.ln_2 = LayerNorm.load(weights, f"{prefix}.ln_2", config.eps)
        heads = config.heads
        scale = heads.head_dim**-0.5 if config.scale is None else config.scale
        if config.scale_by_layer:
            scale /= layer_idx + 1
        if config.model_type == "gpt2":
            qkv = load_stacked_qkv(weights, f"{prefix}.attn.c_attn", heads, True, transposed=True)
            out = load_conv1d_row(weights, f"{prefix}.attn.c_proj")
            self.mlp = PlainMLP(
                load_conv1d_column(weights, f"{prefix}.mlp.c_fc"),
                load_conv1d_row(weights, f"{prefix}.mlp.c_proj"),
                activation(config.activation),
            )
        else:
            if heads.num_kv_heads == 1:
                qkv = load_stacked_qkv(weights, f"{prefix}.attn.c_attn", heads, True)
            else:
                qkv = load_grouped_qkv(weights, f"{prefix}.attn.c_attn", heads, True)
            out = RowParallelLinear.load(weights, f"{prefix}.attn.c_proj", True)
            self.mlp = PlainMLP.load(
                weights, f"{prefix}.mlp.c_fc", f"{prefix}.mlp.c_proj", config.activation
            )
        self.attn = SelfAttention(qkv, out, heads, weights, layer_idx, backend, scale=scale)

    def forward(
        self, x: torch.Tensor, rotation: Rotation, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rotation, kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2(DecoderModel[GPT2Config]):
    learned_positions = True

    def __init__(self, config: GPT2Config, weights: Weights, backend: AttentionBackend) -> None:
        super().__init__(config, weights, backend)
        root = "transformer." if "transformer.wte.weight" in weights else ""
        self.wte = VocabParallelEmbedding.load(weights, f"{root}wte.weight")
        self.wpe = LearnedPositions.load(weights, f"{root}wpe.weight")
        self.layers = nn.ModuleList(
            GPT2Block(config, weights, f"{root}h.{i}", i, backend)
            for i in range(config.num_layers)
        )
        self.ln_f = LayerNorm.load(weights, f"{root}ln_f", config.eps)
        untied = not config.tie_word_embeddings and "lm_head.weight" in weights
        head = "lm_head.weight" if untied else f"{root}wte.weight"
        self.lm_head = ParallelLMHead.load(weights, head)
        self.set_shapes(
            config.model_type, config.heads, config.num_layers, weights, head,
            self.wpe.max_positions,
        )

    @classmethod
    def read_config(cls, raw: Mapping[str, Any]) -> GPT2Config:
        return GPT2Config.from_dict(raw)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids) + self.wpe(positions)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))
