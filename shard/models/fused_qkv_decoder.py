"""The skeleton pytgi's own fused-QKV decoders share (GPT-2, GPT-BigCode, GPT-NeoX, Falcon, OPT,
BLOOM, MPT), so each model file holds only what differs: its config, its layer and its
embeddings and head.

    hidden = embed(ids, positions)
    rotation = rotary(positions)                 when the model has one (NeoX, Falcon)
    for each layer:  hidden = layer(hidden, rotation, kv_cache, meta)
    logits = head(hidden[lm_head_indices])       the final norm included

A subclass builds its modules in __init__(config, weights, backend), stores its layers as
`layers` and calls `set_shapes`; `load` reads its config.json and weights. The Llama-style decoder
(llama.py) carries a residual between its layers and so keeps its own forward; it shares
`with_weights`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, Generic, Self, TypeVar

import torch
from torch import nn

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.device.distributed import Dist
from pytgi_shard.layers.fused_qkv import HeadShape
from pytgi_shard.layers.linear import kv_head_partition
from pytgi_shard.layers.rotary import RotaryEmbedding, rotation_tables
from pytgi_shard.layers.self_attention import Rotation
from pytgi_shard.models.model import Model
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.quantization.kernel_table import linear_format
from pytgi_shard.weights.reader import Weights

ConfigT = TypeVar("ConfigT")
ModelT = TypeVar("ModelT")


def with_weights(
    config: ModelConfig, dtype: torch.dtype, dist: Dist, build: Callable[[Weights], ModelT]
) -> ModelT:
    """`build` given the checkpoint's weights at config.path, closed once the model holds its
    tensors (the files stay mapped only while loading); their linears are read as
    config.quantization says."""
    weights = Weights(config.path, dtype, dist, linear_format(config.quantization))
    try:
        return build(weights)
    finally:
        weights.close()


class DecoderModel(nn.Module, Model, Generic[ConfigT]):
    layers: nn.ModuleList

    def __init__(self, config: ConfigT, weights: Weights, backend: AttentionBackend) -> None:
        super().__init__()
        # Set by a model with rotary positions (the whole head or its first rotary_dim dims).
        self.rotary: RotaryEmbedding | None = None

    @classmethod
    @abstractmethod
    def read_config(cls, raw: Mapping[str, Any]) -> ConfigT:
        """config.json, read with transformers' defaults for the family."""

    @abstractmethod
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The hidden states entering the first layer."""

    @abstractmethod
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the selected tokens' last hidden states (final norm, lm_head)."""

    @classmethod
    def load(
        cls, config: ModelConfig, dtype: torch.dtype, dist: Dist, backend: AttentionBackend
    ) -> Self:
        """The registry's loader."""
        return with_weights(
            config, dtype, dist, lambda w: cls(cls.read_config(config.raw), w, backend)
        )

    def set_shapes(
        self,
        model_type: str,
        heads: HeadShape,
        num_layers: int,
        weights: Weights,
        lm_head: str,
        max_position_embeddings: int,
    ) -> None:
        """The per-rank shapes the engine sizes the KV cache from (Model's attributes)."""
        dist = weights.dist
        self.model_type = model_type
        self.num_layers = num_layers
        self.num_kv_heads = heads.num_kv_heads // kv_head_partition(heads.num_kv_heads, dist)[1]
        self.head_dim = heads.head_dim
        self.vocab_size = weights.shape(lm_head)[0]
        self.dtype = weights.dtype
        self.device = dist.device
        self.max_position_embeddings = max_position_embeddings

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed(input_ids, positions)
        rotation: Rotation = None
        if self.rotary is not None:
            rotation = rotation_tables(*self.rotary.cos_sin(positions), hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, rotation, kv_cache, meta)
        if lm_head_indices is not None:
            # The final norm is per token: only the tokens whose logits are wanted.
            hidden = hidden[lm_head_indices]
        return self.head(hidden)
