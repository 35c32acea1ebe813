"""Idefics3 (`idefics3`): the registry's Llama decoder (config.json's text_config) fed, in place of
each tile's `<image>` tokens, the tile through Idefics3's vision transformer and connector:

    x = tower(tile)                      # SigLIP layers (siglip/vision.py), post_layernorm
    x = pixel_shuffle(x, scale_factor)   # s x s neighbouring patches -> one row of s^2 * hidden
    rows = modality_projection(x)        # Linear, no bias -> text hidden size

The router sends each tile (the split tiles row-major, then the global image) as its own wire
image over its run of image_seq_len tokens (router/http/media/idefics3.py), so one `encode` is
one tile, as transformers encodes them (tile by tile, no attention across tiles).

Every tile is the tower's image_size (the router refuses checkpoints whose tiles are not), so
transformers' patch attention mask is all ones; its position ids come from bucketing each
patch's fractional coordinate (NaViT's variable resolution), which for a full tile is nearly,
but in float32 not always, the plain row-major index: `bucketed_positions` computes them as
transformers does, once.

Attention in the decoder is causal (no bidirectional spans) and positions are plain 1-D: a
forward without images (text, decode steps) is the Llama's own (the forward is LlamaVLM's,
shard/models/vision_language.py; the warmup FixedSizeVLM's, every tile being the tower's size).
The tower is split over the ranks as SigLIP's (siglip/vision.py); the connector is replicated,
as the projectors are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.device.distributed import Dist
from pytgi_shard.models.config_layout import legacy_layout
from pytgi_shard.models.fused_qkv_decoder import with_weights
from pytgi_shard.models.llama.config import LlamaConfig
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.models.siglip.vision import (
    SiglipConfig,
    SiglipVisionTower,
    image_patches,
    siglip_prefix,
)
from pytgi_shard.models.vision_language import FixedSizeVLM, ImageEmbeddings
from pytgi_shard.weights.reader import Weights

# transformers' Idefics3VisionConfig defaults (a config.json may leave them out).
VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_attention_heads": 16, "image_size": 224, "patch_size": 32,
                   "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}
DEFAULT_SCALE = 2


def bucketed_positions(side: int, patches: int | None = None) -> torch.Tensor:
    """The position ids of a tile of `patches` x `patches` patches whose mask is all ones, for a
    table of side x side positions (Idefics3VisionEmbeddings: each patch's fractional
    coordinate i / patches bucketed by the boundaries 1/side, 2/side, ... in float32)."""
    patches = patches or side
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    index = torch.arange(patches, dtype=torch.float32)
    coords = torch.clamp(index * (1.0 / torch.tensor(patches)), max=1.0 - 1e-6)
    bucket = torch.bucketize(coords, boundaries, right=True)
    return (bucket[:, None] * side + bucket[None, :]).reshape(-1)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[side*side, d] -> [(side/s)^2, d*s*s]: each s x s block of patches into one row, in
    transformers' Idefics3Connector order (columns grouped first, then rows)."""
    seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.view(side, side // scale, dim * scale).transpose(0, 1)
    x = x.reshape(side // scale, side // scale, dim * scale * scale).transpose(0, 1)
    return x.reshape(seq // scale ** 2, dim * scale * scale)


class Idefics3Tower(SiglipVisionTower):
    """SigLIP's layers and post_layernorm at the bucketed position ids."""

    positions: torch.Tensor

    def __init__(self, weights: Weights, prefix: str, config: SiglipConfig) -> None:
        super().__init__(weights, prefix, config)
        self.register_buffer("positions", bucketed_positions(config.patches_per_side),
                             persistent=False)

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        if patches.shape != (self.config.num_patches, self.patch_dim):
            raise ValueError(f"pixel values of shape {list(patches.shape)}: this tower takes "
                             f"[{self.config.num_patches}, {self.patch_dim}] (a tile of "
                             f"{self.config.image_size} pixels a side)")
        x = F.linear(patches.to(self.dtype), self.patch_weight, self.patch_bias)
        x = x + self.position_embedding[self.positions]
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


@dataclass(frozen=True, slots=True)
class Idefics3Tiles:
    """Idefics3's wire images: one tile each, no grid, pixels [C, S, S] at the tower's size,
    `tokens` (image_seq_len) tokens."""

    channels: int
    image_size: int
    tokens: int
    mrope_merge: int = 0

    def refusal(self, grid: tuple[int, ...], shape: tuple[int, ...] | None, tokens: int
                ) -> str | None:
        if grid:
            return f"grid {list(grid)}: this model's tiles carry none"
        if tokens != self.tokens:
            return f"{tokens} tokens: this model's tiles take {self.tokens}"
        want = (self.channels, self.image_size, self.image_size)
        if shape is not None and shape != want:
            return f"pixel values of shape {list(shape)} are not float32 {list(want)}"
        return None


def text_config(raw: Mapping[str, Any]) -> LlamaConfig:
    """The Llama decoder of config.json's text_config (transformers 4's or 5's layout); the
    top-level tie_word_embeddings where the text_config names none."""
    text = legacy_layout(dict(raw.get("text_config") or {}))
    text.setdefault("model_type", "llama")
    if text["model_type"] != "llama":
        raise ValueError(f"idefics3 with a {text['model_type']!r} text model: only llama is "
                         "served")
    text.setdefault("tie_word_embeddings", bool(raw.get("tie_word_embeddings", False)))
    return LlamaConfig.from_dict(text)


def text_names(weights: Weights) -> dict[str, str]:
    """The decoder's names (`model.*`) for the text half kept under `model.text_model.`."""
    return {"model." + name.removeprefix("model.text_model."): name
            for name in weights.names() if name.startswith("model.text_model.")}


class Idefics3(FixedSizeVLM):
    def __init__(self, config: LlamaConfig, raw: Mapping[str, Any], weights: Weights,
                 backend: AttentionBackend) -> None:
        super().__init__(config, weights.with_names(text_names(weights)), backend)
        vision = SiglipConfig.from_dict({**VISION_DEFAULTS, **(raw.get("vision_config") or {})})
        self.scale = int(raw.get("scale_factor", DEFAULT_SCALE))
        if vision.patches_per_side % self.scale:
            raise ValueError(f"idefics3 scale_factor {self.scale} does not divide the tower's "
                             f"{vision.patches_per_side} patches a side")
        self.visual = Idefics3Tower(weights, siglip_prefix(weights, "vision_model"), vision)
        projection = "model.connector.modality_projection.proj.weight"
        self.projection = nn.Parameter(weights.get_tensor(projection), requires_grad=False)
        want = (config.hidden_size, vision.hidden_size * self.scale ** 2)
        if tuple(self.projection.shape) != want:
            raise ValueError(f"{projection} {list(self.projection.shape)} is not {list(want)}")
        tokens = (vision.patches_per_side // self.scale) ** 2
        self.image_layout = Idefics3Tiles(vision.num_channels, vision.image_size, tokens)
        self.pixel_shape = (vision.num_channels, vision.image_size, vision.image_size)
        self.images = ImageEmbeddings()

    @classmethod
    def load(cls, config: ModelConfig, dtype: torch.dtype, dist: Dist,
             backend: AttentionBackend) -> Idefics3:
        decoder = text_config(config.raw)
        return with_weights(config, dtype, dist,
                            lambda weights: cls(decoder, config.raw, weights, backend))

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        """One tile's rows [image_seq_len, hidden]: tower, pixel shuffle, projection."""
        patches = image_patches(pixel_values.to(self.device), self.visual.config.patch_size)
        shuffled = pixel_shuffle(self.visual(patches), self.scale)
        return F.linear(shuffled.to(self.projection.dtype), self.projection).to(self.dtype)
