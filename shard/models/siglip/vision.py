"""SigLIP's vision tower (the image encoder of PaliGemma and Gemma 3), on pytgi's own code:

    x = patch_embed(patches) + position_embedding      # conv2d with stride = kernel: a linear
    for each layer:  x = x + out_proj(attention(q, k, v))   on layer_norm1(x)
                     x = x + fc2(gelu_tanh(fc1(x)))         on layer_norm2(x)
    tokens = post_layernorm(x)                          # one row per patch; no pooling head

Takes one image at the checkpoint's fixed size (vision_config.image_size: the processors of
PaliGemma and Gemma 3 resize every image to it, so the position table is used as trained, never
interpolated), as its patches [patches, channels * patch * patch] in (channel, row, column) order
(the conv weight's), and attends over all of them (full attention within an image).

Its layers (models/vit_layer.py) are split over the tensor-parallel ranks as the decoder's: each
rank holds its share of the heads and of the MLP (SigLIP-So400m's 16 heads and 4304 MLP features
split over 2, 4, 8 or 16 ranks), two all-reduces per layer; a head count the ranks do not divide
replicates the tower (models/vision_sharding.py). The patch embedding, position table and norms
are small and replicated; the output is whole on every rank.

The pooling head (`head.*`, SiglipMultiheadAttentionPoolingHead) is not loaded: PaliGemma and
Gemma 3 read the last hidden state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.layers.layernorm import LayerNorm
from pytgi_shard.models.vision_sharding import tower_weights
from pytgi_shard.models.vit_layer import ViTLayer
from pytgi_shard.weights.reader import Weights


@dataclass(frozen=True, slots=True)
class SiglipConfig:
    """vision_config's fields the tower reads, with transformers' SiglipVisionConfig defaults."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SiglipConfig:
        d = cls()
        config = cls(**{name: type(getattr(d, name))(raw.get(name, getattr(d, name)))
                        for name in cls.__dataclass_fields__})
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"vision hidden_size {config.hidden_size} is not a multiple of "
                             f"num_attention_heads {config.num_attention_heads}")
        if config.image_size % config.patch_size:
            raise ValueError(f"vision image_size {config.image_size} is not a multiple of "
                             f"patch_size {config.patch_size}")
        return config

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size ** 2


def siglip_prefix(weights: Weights, owner: str) -> str:
    """Where the tower's tensors sit under `owner` (e.g. "vision_tower"): Hub checkpoints keep
    transformers 4's `vision_model.` level, transformers 5 saves without it."""
    for prefix in (f"{owner}.vision_model", owner, f"model.{owner}.vision_model",
                   f"model.{owner}"):
        if f"{prefix}.post_layernorm.weight" in weights:
            return prefix
    raise ValueError(f"no SigLIP vision tower under {owner!r} in the checkpoint at "
                     f"{weights.model_path}")


class SiglipVisionTower(nn.Module):
    """Patches of one image [patches, patch_dim] -> its last hidden state [patches, hidden]."""

    def __init__(self, weights: Weights, prefix: str, config: SiglipConfig) -> None:
        super().__init__()
        self.config = config
        conv = weights.get_tensor(f"{prefix}.embeddings.patch_embedding.weight")
        # Stride equal to the kernel: the conv2d is one linear over each flattened patch.
        self.patch_weight = nn.Parameter(conv.reshape(conv.shape[0], -1), requires_grad=False)
        self.patch_bias = nn.Parameter(
            weights.get_tensor(f"{prefix}.embeddings.patch_embedding.bias"), requires_grad=False)
        self.position_embedding = nn.Parameter(
            weights.get_tensor(f"{prefix}.embeddings.position_embedding.weight"),
            requires_grad=False)
        if self.patch_weight.shape[1] != config.patch_dim or (
            self.position_embedding.shape[0] != config.num_patches
        ):
            raise ValueError(
                f"the SigLIP tower's patch embedding {list(conv.shape)} and position table "
                f"{list(self.position_embedding.shape)} do not match vision_config "
                f"(patch_size {config.patch_size}, image_size {config.image_size})")
        split = tower_weights(weights, "SigLIP", config.num_attention_heads,
                              [config.intermediate_size])
        self.layers = nn.ModuleList(
            ViTLayer(split, f"{prefix}.encoder.layers.{i}", config.hidden_size,
                     config.num_attention_heads, config.hidden_act, config.layer_norm_eps)
            for i in range(config.num_hidden_layers))
        self.post_layernorm = LayerNorm.load(weights, f"{prefix}.post_layernorm",
                                             config.layer_norm_eps)
        self.dtype = conv.dtype
        self.patch_dim = config.patch_dim

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        if patches.shape != (self.config.num_patches, self.patch_dim):
            raise ValueError(f"pixel values of shape {list(patches.shape)}: this SigLIP tower "
                             f"takes [{self.config.num_patches}, {self.patch_dim}] (an image "
                             f"of {self.config.image_size} pixels a side)")
        x = F.linear(patches.to(self.dtype), self.patch_weight, self.patch_bias)
        x = x + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


def image_patches(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[C, H, W] -> [(H/p) * (W/p), C * p * p]: row-major patches, each flattened in the conv
    weight's (channel, row, column) order (what the router sends; tests build it from
    transformers' pixel_values)."""
    c, h, w = pixels.shape
    grid = pixels.reshape(c, h // patch, patch, w // patch, patch)
    return grid.permute(1, 3, 0, 2, 4).reshape((h // patch) * (w // patch), c * patch * patch)
