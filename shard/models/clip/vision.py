"""CLIP's vision tower (LLaVA-NeXT's image encoder, transformers' CLIPVisionModel), on pytgi's
own code:

    x = [class_embedding, patch_embed(patches)] + position_embedding   # conv2d stride = kernel
    x = pre_layrnorm(x)                                                # (transformers' spelling)
    for each layer:  x = x + out_proj(attention(q, k, v))   on layer_norm1(x)
                     x = x + fc2(quick_gelu(fc1(x)))        on layer_norm2(x)

and returns the hidden state after `layers` layers: a VLM reads an inner layer
(`vision_feature_layer`, -2 for LLaVA-NeXT: the second-to-last layer's output, so the last layer
and post_layernorm are never run nor loaded). Takes a batch of tiles [N, C, S, S] at the
checkpoint's image_size (the processor resizes every tile to it, so the position table is used
as trained); attention is full within each tile.

Its layers (models/vit_layer.py) are split over the tensor-parallel ranks as the decoder's: each
rank holds its share of the heads and of the MLP (CLIP ViT-L/14-336's 16 heads and 4096 MLP
features), two all-reduces per layer; a head count the ranks do not divide replicates the tower
(models/vision_sharding.py). The embeddings and pre_layrnorm are replicated; the output is
whole on every rank.
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
class ClipVisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    image_size: int = 224
    patch_size: int = 32
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ClipVisionConfig:
        """vision_config with CLIPVisionConfig's defaults for the keys it lacks."""
        d = cls()
        return cls(**{f: type(getattr(d, f))(raw.get(f, getattr(d, f)))
                      for f in cls.__dataclass_fields__})

    @property
    def grid(self) -> int:
        """Patches per side of a tile."""
        return self.image_size // self.patch_size

    def layers_for(self, feature_layer: int) -> int:
        """How many layers produce transformers' hidden_states[feature_layer] (index 0 is the
        embeddings after pre_layrnorm; -1 the last layer's output)."""
        count = feature_layer if feature_layer >= 0 else self.num_hidden_layers + 1 + feature_layer
        if not 0 <= count <= self.num_hidden_layers:
            raise ValueError(f"vision_feature_layer {feature_layer} is not a layer of a "
                             f"{self.num_hidden_layers}-layer CLIP tower")
        return count


def clip_prefix(weights: Weights, owner: str) -> str:
    """Where the tower's tensors sit under `owner`: Hub checkpoints keep transformers 4's
    `vision_model.` level (and newer saves a leading `model.`), transformers 5 saves without."""
    for prefix in (f"{owner}.vision_model", owner, f"model.{owner}.vision_model",
                   f"model.{owner}"):
        if f"{prefix}.embeddings.class_embedding" in weights:
            return prefix
    raise ValueError(f"no CLIP vision tower under {owner!r} in the checkpoint at "
                     f"{weights.model_path}")


def _param(weights: Weights, name: str) -> nn.Parameter:
    return nn.Parameter(weights.get_tensor(name), requires_grad=False)


class ClipVisionTower(nn.Module):
    """Tiles [N, C, S, S] -> hidden states [N, 1 + (S/p)^2, hidden] after `layers` layers (the
    class token first)."""

    def __init__(self, weights: Weights, prefix: str, config: ClipVisionConfig,
                 layers: int) -> None:
        super().__init__()
        self.config = config
        conv = weights.get_tensor(f"{prefix}.embeddings.patch_embedding.weight")
        # Stride equal to the kernel (and no bias in CLIP): one linear over each flat patch.
        self.patch_weight = nn.Parameter(conv.reshape(conv.shape[0], -1), requires_grad=False)
        self.class_embedding = _param(weights, f"{prefix}.embeddings.class_embedding")
        self.position_embedding = _param(weights,
                                         f"{prefix}.embeddings.position_embedding.weight")
        tokens = config.grid ** 2 + 1
        if self.position_embedding.shape[0] != tokens or conv.shape[-1] != config.patch_size:
            raise ValueError(
                f"the CLIP tower's patch embedding {list(conv.shape)} and position table "
                f"{list(self.position_embedding.shape)} do not match vision_config "
                f"(patch_size {config.patch_size}, image_size {config.image_size})")
        self.pre_layrnorm = LayerNorm.load(weights, f"{prefix}.pre_layrnorm",
                                           config.layer_norm_eps)
        split = tower_weights(weights, "CLIP", config.num_attention_heads,
                              [config.intermediate_size])
        self.layers = nn.ModuleList(
            ViTLayer(split, f"{prefix}.encoder.layers.{i}", config.hidden_size,
                     config.num_attention_heads, config.hidden_act, config.layer_norm_eps)
            for i in range(layers))
        self.dtype = conv.dtype

    @torch.inference_mode()
    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        c, s, p = self.config.num_channels, self.config.image_size, self.config.patch_size
        if tiles.dim() != 4 or tuple(tiles.shape[1:]) != (c, s, s):
            raise ValueError(f"pixel values of shape {list(tiles.shape)}: this CLIP tower takes "
                             f"[tiles, {c}, {s}, {s}]")
        n, g = tiles.shape[0], s // p
        # [N, C, g, p, g, p] -> [N, g*g, C*p*p], each patch flattened in the conv's order.
        patches = tiles.to(self.dtype).reshape(n, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        x = F.linear(patches.reshape(n, g * g, c * p * p), self.patch_weight)
        cls = self.class_embedding.view(1, 1, -1).expand(n, 1, -1)
        x = torch.cat([cls, x], dim=1) + self.position_embedding
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x)
        return x
