"""The Llama-style decoder, tensor-parallel, over the paged cache: Llama 2/3, Code Llama, Mistral,
Qwen2/3, Gemma 1/2/3, Phi-3/4, StarCoder2, Cohere (Command-R), Granite, and the mixtures of
experts Mixtral, Qwen2-MoE and Qwen3-MoE (sparse MoE blocks in place of MLPs: layers/moe.py).

    x = embed(ids)
    for each layer:  x = x + o_proj(attention(rope(q), rope(k), v))   on norm(x)
                     x = x + down(act(gate(x)) * up(x))                on norm(x)
    logits = lm_head(norm(x))

Grouped-query attention (fewer KV heads than query heads), tied or untied embeddings, biases,
sliding windows per layer. The families' variations are fields of LlamaConfig (llama_config.py):
the norm kind, q/k norms, Gemma's sandwich norms and Cohere's parallel block, soft-capping,
embedding/residual/logit multipliers, fused checkpoint tensors, partial or interleaved rotary and
per-layer rope bases. Each rank holds 1/world_size of the heads and of the MLP; the row-parallel
projections all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import torch
from torch import nn

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.device.distributed import Dist
from pytgi_shard.layers.embedding import VocabParallelEmbedding
from pytgi_shard.layers.fused_qkv import HeadShape, load_stacked_qkv
from pytgi_shard.layers.layernorm import HeadLayerNorm, LayerNorm, RMSNorm
from pytgi_shard.layers.linear import (
    RowParallelLinear,
    kv_head_partition,
    load_qkv,
)
from pytgi_shard.layers.lm_head import ParallelLMHead
from pytgi_shard.layers.mlp import GatedMLP, PlainMLP
from pytgi_shard.layers.moe import SparseMoE
from pytgi_shard.layers.rotary import (
    RotaryEmbedding,
    apply_interleaved_rotary,
    apply_partial_rotary,
    apply_rotary,
    interleaved_rotation_tables,
    rotation_tables,
)
from pytgi_shard.models.fused_qkv_decoder import with_weights
from pytgi_shard.models.llama.config import LlamaConfig, NormKind
from pytgi_shard.models.model import Model
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.weights.reader import Weights

Norm: TypeAlias = RMSNorm | LayerNorm
# Reads a family's config.json (ModelConfig.raw) into the decoder's configuration.
ConfigReader = Callable[[Mapping[str, Any]], LlamaConfig]
ModelLoader = Callable[[ModelConfig, torch.dtype, Dist, AttentionBackend], Model]


def load_norm(weights: Weights, prefix: str, kind: NormKind, eps: float) -> Norm:
    if kind in ("layer", "layer_no_bias"):
        return LayerNorm.load(weights, prefix, eps, bias=kind == "layer")
    return RMSNorm.load(weights, prefix, eps, plus_one=kind == "rms_plus_one")


def load_qk_norms(
    config: LlamaConfig, weights: Weights, prefix: str
) -> tuple[nn.Module, nn.Module] | None:
    """The q and k norms of `prefix`, or None: shared over heads, or (Cohere) one per head, each
    rank then holding the rows of its own query heads and KV-head block."""
    kind, eps = config.qk_norm, config.rms_norm_eps
    if kind is None:
        return None
    if kind == "head_layer":
        dist = weights.dist
        index, parts = kv_head_partition(config.num_key_value_heads, dist)
        q = HeadLayerNorm.load(weights, f"{prefix}.q_norm.weight", eps, dist.rank, dist.world_size)
        return q, HeadLayerNorm.load(weights, f"{prefix}.k_norm.weight", eps, index, parts)
    return (
        load_norm(weights, f"{prefix}.q_norm", kind, eps),
        load_norm(weights, f"{prefix}.k_norm", kind, eps),
    )


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
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if config.fused_qkv:
            shape = HeadShape(heads, kv_heads, config.head_dim)
            self.qkv = load_stacked_qkv(weights, f"{prefix}.qkv_proj", shape, config.qkv_bias)
        else:
            self.qkv = load_qkv(weights, prefix, heads, kv_heads, config.qkv_bias)
        self.o_proj = RowParallelLinear.load(weights, f"{prefix}.o_proj", config.o_bias)
        self.qk_norms = load_qk_norms(config, weights, prefix)
        self.head_dim = config.head_dim
        self.num_heads = heads // world
        self.num_kv_heads = kv_heads // kv_head_partition(kv_heads, weights.dist)[1]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.softcap = config.attn_softcap
        self.layer_idx = layer_idx
        self.backend = backend
        self.sliding_window = sliding_window
        self.rotate = _rotation(config)
        # One Triton kernel for both rotations (GPU): it takes cos/sin as RotaryEmbedding.cos_sin
        # gives them; the eager path takes rotation_tables' factors (Llama.rotation builds either).
        half = self.head_dim // 2
        self.fused_rotary = (
            weights.dist.caps.triton_kernels and half & (half - 1) == 0
            and self.rotate is apply_rotary
        )

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
        if self.qk_norms is not None:
            q, k = self.qk_norms[0](q), self.qk_norms[1](k)
        if self.fused_rotary:
            from pytgi_shard.layers.triton_rotary import rotate_qk

            q, k = rotate_qk(q, k, cos, sin)
        else:
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(
            q, k, v,
            kv_cache.keys[self.layer_idx], kv_cache.values[self.layer_idx],
            meta, self.scale, self.sliding_window, softcap=self.softcap,
            kv_scales=kv_cache.scales_of(self.layer_idx),
        )
        return self.o_proj(out.reshape(-1, self.q_size))


def _rotation(config: LlamaConfig) -> Callable[..., torch.Tensor]:
    if config.rope_interleaved:
        return apply_interleaved_rotary
    if config.rotary_dim is not None and config.rotary_dim != config.head_dim:
        return apply_partial_rotary
    return apply_rotary


def _load_mlp(config: LlamaConfig, weights: Weights, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s feed-forward block: a sparse MoE block where the config marks one."""
    moe = config.moe
    if moe is not None and moe.sparse_layers[layer_idx]:
        prefix = f"model.layers.{layer_idx}.{moe.module}"
        return SparseMoE.load(weights, prefix, moe, config.hidden_act)
    prefix = f"model.layers.{layer_idx}.mlp"
    if config.mlp == "plain":
        return PlainMLP.load(
            weights, f"{prefix}.c_fc", f"{prefix}.c_proj", config.hidden_act, config.mlp_bias
        )
    fused = config.mlp == "fused_gated"
    return GatedMLP.load(weights, prefix, config.hidden_act, config.mlp_bias, fused=fused)


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
        kind, eps = config.norm, config.rms_norm_eps
        self.block = config.block
        self.residual_multiplier = config.residual_multiplier
        self.input_layernorm = load_norm(weights, f"{prefix}.input_layernorm", kind, eps)
        self.self_attn = LlamaAttention(
            config, weights, f"{prefix}.self_attn", layer_idx, backend, sliding_window
        )
        self.mlp = _load_mlp(config, weights, layer_idx)
        if self.block != "parallel":
            # Gemma 2/3 name it so too, but apply it to the attention's output (sandwich).
            self.post_attention_layernorm = load_norm(
                weights, f"{prefix}.post_attention_layernorm", kind, eps
            )
        if self.block == "sandwich":
            self.pre_feedforward_layernorm = load_norm(
                weights, f"{prefix}.pre_feedforward_layernorm", kind, eps
            )
            self.post_feedforward_layernorm = load_norm(
                weights, f"{prefix}.post_feedforward_layernorm", kind, eps
            )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's last branch output, the residual stream before it): the add that
        completes the residual is left to the next norm, which fuses it (the same sums, in the
        same order)."""
        normed, residual = self.input_layernorm.add_forward(hidden, residual)
        attn = self.self_attn(normed, cos, sin, kv_cache, meta)
        if self.block == "parallel":
            return attn + self.mlp(normed), residual
        if self.block == "sandwich":
            attn = self.post_attention_layernorm(attn)
            normed, residual = self.pre_feedforward_layernorm.add_forward(attn, residual)
            return self.post_feedforward_layernorm(self.mlp(normed)), residual
        if self.residual_multiplier != 1.0:
            attn = attn * self.residual_multiplier
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        out = self.mlp(normed)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return out, residual


class Llama(nn.Module, Model):
    def __init__(
        self, config: LlamaConfig, weights: Weights, backend: AttentionBackend
    ) -> None:
        super().__init__()
        dist = weights.dist
        windows = config.layer_windows
        self.config = config
        self.embed_tokens = VocabParallelEmbedding.load(weights, "model.embed_tokens.weight")
        normalizer = config.embedding_normalizer
        # Gemma rounds sqrt(hidden_size) to the model dtype before multiplying, as trained.
        self.embed_normalizer = (
            None if normalizer is None
            else torch.tensor(normalizer, dtype=weights.dtype, device=dist.device)
        )
        layers = [
            LlamaDecoderLayer(config, weights, i, backend, windows[i])
            for i in range(config.num_hidden_layers)
        ]
        self.layers = nn.ModuleList(layers)
        self.norm = load_norm(weights, "model.norm", config.norm, config.rms_norm_eps)
        # Every layer makes the same choice; the forward builds the factors that choice takes.
        self.fused_rotary = all(layer.self_attn.fused_rotary for layer in layers)
        # A MoE block on the grouped PyTorch path reads its group sizes on the host.
        self.graph_capturable = all(
            layer.mlp.capturable for layer in layers if isinstance(layer.mlp, SparseMoE)
        )
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = ParallelLMHead.load(weights, head)
        rotary_dim = config.rotary_dim or config.head_dim
        self.rotary = RotaryEmbedding(
            rotary_dim, config.rope_theta, config.max_position_embeddings, config.rope_scaling,
            dist.device,
        )
        # Gemma 3: the sliding layers rotate with their own base, unscaled.
        self.local_rotary = None if config.local_rope_theta is None else RotaryEmbedding(
            rotary_dim, config.local_rope_theta, config.max_position_embeddings, None, dist.device
        )
        self.layer_is_local = [
            self.local_rotary is not None and window is not None for window in windows
        ]
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
        """Llama, Mistral, Qwen2 or Qwen3 (LlamaConfig.from_dict reads them)."""
        return cls.load_with(LlamaConfig.from_dict(config.raw), config, dtype, dist, backend)

    @classmethod
    def loader(cls, read: ConfigReader) -> ModelLoader:
        """The registry's loader for a family whose config.json `read` turns into a decoder."""

        def load(
            config: ModelConfig, dtype: torch.dtype, dist: Dist, backend: AttentionBackend
        ) -> Model:
            return cls.load_with(read(config.raw), config, dtype, dist, backend)

        return load

    @classmethod
    def load_with(
        cls,
        decoder: LlamaConfig,
        config: ModelConfig,
        dtype: torch.dtype,
        dist: Dist,
        backend: AttentionBackend,
    ) -> Llama:
        """The decoder `decoder` describes, with the weights of the checkpoint at config.path."""
        return with_weights(config, dtype, dist, lambda weights: cls(decoder, weights, backend))

    def _rotations(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) in the form its rotation takes, built once per forward."""
        tables = [self._tables(self.rotary, positions, dtype)]
        if self.local_rotary is not None:
            tables.append(self._tables(self.local_rotary, positions, dtype))
        return [tables[int(local)] for local in self.layer_is_local]

    def _tables(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary.cos_sin(positions)
        if self.fused_rotary:
            return cos, sin
        if self.config.rope_interleaved:
            return interleaved_rotation_tables(cos, sin, dtype)
        return rotation_tables(cos, sin, dtype)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self._embed(input_ids)
        rotations = self._rotations(positions, hidden.dtype)
        return self._layers_to_logits(hidden, rotations, kv_cache, meta, lm_head_indices)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings as the first layer takes them: Gemma's normalizer, Granite's
        multiplier (a vision-language model places its image rows after them,
        shard/models/vision_language.py)."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_normalizer is not None:
            hidden = hidden * self.embed_normalizer
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * self.config.embedding_multiplier
        return hidden

    def _layers_to_logits(
        self,
        hidden: torch.Tensor,
        rotations: list[tuple[torch.Tensor, torch.Tensor]],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decoder layers over embedded rows, then the final norm and the logits: what
        every input path shares once its embeddings and rotations are made (Qwen2-VL's image
        rows with M-RoPE come in here too)."""
        residual: torch.Tensor | None = None
        for layer, (cos, sin) in zip(self.layers, rotations, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        if lm_head_indices is not None:
            # The final norm is per token: norm only the tokens whose logits are wanted.
            hidden = hidden[lm_head_indices]
            residual = residual[lm_head_indices] if residual is not None else None
        return self._logits(self.norm.add_forward(hidden, residual)[0])
