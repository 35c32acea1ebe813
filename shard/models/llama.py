"""The Llama family (Llama 2/3, Code Llama, Mistral, Qwen2), tensor-parallel, over the paged cache.

    x = embed(ids)
    for each layer:  x = x + o_proj(attention(rope(q), rope(k), v))   on rms_norm(x)
                     x = x + down(silu(gate(x)) * up(x))                 on rms_norm(x)
    logits = lm_head(rms_norm(x))

Grouped-query attention (fewer KV heads than query heads), SwiGLU, RMSNorm, tied or untied
embeddings, q/k/v bias (Qwen2), a sliding window (Mistral, Qwen2). Each rank holds 1/world_size of
the heads and of the MLP; the row-parallel projections all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.distributed import Dist
from pytgi_shard.kv_cache import KVCache
from pytgi_shard.layers.embedding import VocabParallelEmbedding
from pytgi_shard.layers.layernorm import RMSNorm, triton_kernels_on
from pytgi_shard.layers.linear import RowParallelLinear, kv_head_partition, load_qkv
from pytgi_shard.layers.lm_head import ParallelLMHead
from pytgi_shard.layers.mlp import GatedMLP
from pytgi_shard.layers.rotary import RotaryEmbedding, apply_rotary, rotation_tables
from pytgi_shard.models.llama_config import LlamaConfig
from pytgi_shard.models.model import Model
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.weights import Weights


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        weights: Weights,
        prefix: str,
        layer_idx: int,
        backend: AttentionBackend,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        world = weights.dist.world_size
        kv_heads = config.num_key_value_heads
        self.qkv = load_qkv(weights, prefix, config.num_attention_heads, kv_heads, config.qkv_bias)
        self.o_proj = RowParallelLinear.load(weights, f"{prefix}.o_proj", config.o_bias)
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // world
        self.num_kv_heads = kv_heads // kv_head_partition(kv_heads, weights.dist)[1]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.backend = backend
        self.sliding_window = sliding_window
        # One Triton kernel for both rotations (GPU): it takes cos/sin as RotaryEmbedding.cos_sin
        # gives them; the eager path takes rotation_tables' factors (Llama.rotation builds either).
        half = self.head_dim // 2
        self.fused_rotary = triton_kernels_on(weights.dist.device) and half & (half - 1) == 0

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.fused_rotary:
            from pytgi_shard.layers.triton_rotary import rotate_qk

            q, k = rotate_qk(q, k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(
            q, k, v,
            kv_cache.keys[self.layer_idx], kv_cache.values[self.layer_idx],
            meta, self.scale, self.sliding_window,
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        weights: Weights,
        layer_idx: int,
        backend: AttentionBackend,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm.load(weights, f"{prefix}.input_layernorm", eps)
        self.self_attn = LlamaAttention(
            config, weights, f"{prefix}.self_attn", layer_idx, backend, sliding_window
        )
        self.post_attention_layernorm = RMSNorm.load(
            weights, f"{prefix}.post_attention_layernorm", eps
        )
        self.mlp = GatedMLP.load(weights, f"{prefix}.mlp", config.hidden_act, config.mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the add that completes the
        residual is left to the next norm, which fuses it (the same sums, in the same order)."""
        normed, residual = self.input_layernorm.add_forward(hidden, residual)
        attn = self.self_attn(normed, cos, sin, kv_cache, meta)
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp(normed), residual


class Llama(nn.Module, Model):
    def __init__(
        self, config: LlamaConfig, weights: Weights, backend: AttentionBackend
    ) -> None:
        super().__init__()
        dist = weights.dist
        windows = config.layer_windows
        self.embed_tokens = VocabParallelEmbedding.load(weights, "model.embed_tokens.weight")
        layers = [
            LlamaDecoderLayer(config, weights, i, backend, windows[i])
            for i in range(config.num_hidden_layers)
        ]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm.load(weights, "model.norm", config.rms_norm_eps)
        # Every layer makes the same choice; the forward builds the factors that choice takes.
        self.fused_rotary = all(layer.self_attn.fused_rotary for layer in layers)
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = ParallelLMHead.load(weights, head)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.max_position_embeddings,
            config.rope_scaling,
            dist.device,
        )
        kv_heads = config.num_key_value_heads
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = kv_heads // kv_head_partition(kv_heads, dist)[1]
        self.head_dim = config.head_dim
        self.vocab_size = weights.shape(head)[0]
        self.dtype = weights.dtype
        self.device = dist.device
        self.model_type = config.model_type
        self.max_position_embeddings = config.max_position_embeddings
        # Only a window every layer shares lets the engine treat the model as windowed.
        self.sliding_window = windows[0] if len(set(windows)) == 1 else None

    @classmethod
    def load(
        cls, config: ModelConfig, dtype: torch.dtype, dist: Dist, backend: AttentionBackend
    ) -> Llama:
        weights = Weights(config.path, dtype, dist)
        try:
            return cls(LlamaConfig.from_dict(config.raw), weights, backend)
        finally:
            weights.close()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        if not self.fused_rotary:
            cos, sin = rotation_tables(cos, sin, hidden.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        if lm_head_indices is not None:
            # The final norm is per token: norm only the tokens whose logits are wanted.
            hidden = hidden[lm_head_indices]
            residual = residual[lm_head_indices] if residual is not None else None
        return self.lm_head(self.norm.add_forward(hidden, residual)[0])
