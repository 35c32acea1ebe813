"""LLaVA-NeXT (`llava_next`): the registry's Llama/Mistral decoder (shard/models/llama/) fed, in
place of each image's tokens, its CLIP tower's features (shard/models/clip/vision.py) at
`vision_feature_layer` with the class token dropped ("default" strategy), through the
multimodal projector (Linear-GELU-Linear), packed "anyres" (anyres.py: base tile, then the
unpadded tile grid with image_newline after each row).

Positions are plain 1-D: a forward without images (text-only requests, every decode step) is
the decoder's own, CUDA graphs included; a prefill chunk covering image tokens comes with a
StepMedia whose image rows replace those tokens' embeddings (shard/models/vision_language.py's
LlamaVLM forward; it keeps an image's rows between the chunks of a prefill, so the tower runs
once per image). The
tower is split over the ranks as the decoder (clip/vision.py, models/vision_sharding.py); the
projector (21M parameters for a 7B) is replicated: not worth two more collectives per image.

LLaVA 1.5 (`llava`) is the same model without anyres: one tile per image, its features (class
token dropped, projected) the image's rows; no image_newline.
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
from pytgi_shard.models.clip.vision import ClipVisionConfig, ClipVisionTower, clip_prefix
from pytgi_shard.models.config_layout import legacy_layout
from pytgi_shard.models.fused_qkv_decoder import with_weights
from pytgi_shard.models.llama.config import LlamaConfig
from pytgi_shard.models.llava_next.anyres import AnyRes
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.models.vision_language import ImageEmbeddings, LlamaVLM
from pytgi_shard.weights.reader import Weights

# transformers' LlavaNextConfig defaults.
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


@dataclass(frozen=True, slots=True)
class LlavaNextImages:
    """LLaVA-NeXT's wire images: grid = the original (height, width); pixels [1 + tiles, C, S,
    S] (the base tile first); the token count anyres gives for that size. LLaVA 1.5 (`anyres`
    None): one tile of S, grid * grid tokens."""

    anyres: AnyRes | None
    channels: int
    image_size: int
    grid: int
    mrope_merge: int = 0

    def refusal(self, grid: tuple[int, ...], shape: tuple[int, ...] | None, tokens: int
                ) -> str | None:
        if len(grid) != 2 or min(grid) <= 0:
            return f"grid {list(grid)} is not the image's (height, width)"
        height, width = grid
        tiles = 1
        expected = self.grid ** 2
        if self.anyres is not None:
            expected = self.anyres.tokens(height, width)
            rows, cols = self.anyres.tiles(height, width)
            tiles += rows * cols
        if expected != tokens:
            return f"an image of {height} x {width} takes {expected} tokens, not {tokens}"
        side = self.image_size
        want = (tiles, self.channels, side, side)
        if shape is not None and shape != want:
            return f"pixel values of shape {list(shape)} are not float32 {list(want)}"
        return None


def text_config(raw: Mapping[str, Any]) -> LlamaConfig:
    """The decoder's configuration: config.json's text_config (a Llama or Mistral; transformers
    4's or 5's layout), with that family's defaults for the keys it lacks."""
    text = legacy_layout(dict(raw.get("text_config") or {}))
    text.setdefault("model_type", "llama")
    return LlamaConfig.from_dict(text)


def text_names(weights: Weights) -> dict[str, str]:
    """The decoder's names (`model.*`, `lm_head.weight`) for a checkpoint that keeps them under
    `language_model.` (transformers 4 and the Hub's llava-hf checkpoints) or
    `model.language_model.` (newer saves)."""
    out = {}
    for name in weights.names():
        if name.startswith("language_model."):
            out[name.removeprefix("language_model.")] = name
        elif name.startswith("model.language_model."):
            out["model." + name.removeprefix("model.language_model.")] = name
    return out


def _first(weights: Weights, *names: str) -> str:
    for name in names:
        if name in weights:
            return name
    raise ValueError(f"none of {', '.join(names)} in the checkpoint at {weights.model_path}")


class Projector(nn.Module):
    """linear_2(gelu(linear_1(features))), replicated."""

    def __init__(self, weights: Weights, prefix: str, act: str) -> None:
        super().__init__()
        self.params = nn.ParameterDict({
            n.replace(".", "_"): nn.Parameter(weights.get_tensor(f"{prefix}.{n}"),
                                              requires_grad=False)
            for n in ("linear_1.weight", "linear_2.weight")})
        for n in ("linear_1.bias", "linear_2.bias"):
            if f"{prefix}.{n}" in weights:
                self.params[n.replace(".", "_")] = nn.Parameter(
                    weights.get_tensor(f"{prefix}.{n}"), requires_grad=False)
        if act != "gelu":
            raise ValueError(f"llava_next projector_hidden_act {act!r}: only 'gelu' is served")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.params
        x = F.gelu(F.linear(x, p["linear_1_weight"], p.get("linear_1_bias")))
        return F.linear(x, p["linear_2_weight"], p.get("linear_2_bias"))


class LlavaNext(LlamaVLM):
    def __init__(self, config: LlamaConfig, raw: Mapping[str, Any], weights: Weights,
                 backend: AttentionBackend) -> None:
        super().__init__(config, weights.with_names(text_names(weights)), backend)
        strategy = raw.get("vision_feature_select_strategy", "default")
        layer = raw.get("vision_feature_layer", -2)
        if strategy != "default" or not isinstance(layer, int):
            raise ValueError(f"llava_next with vision_feature_select_strategy {strategy!r} and "
                             f"vision_feature_layer {layer!r}: only 'default' and one layer "
                             "are served")
        vision = ClipVisionConfig.from_dict(raw.get("vision_config") or {})
        self.visual = ClipVisionTower(weights, clip_prefix(weights, "vision_tower"), vision,
                                      vision.layers_for(layer))
        projector = _first(weights, "multi_modal_projector.linear_1.weight",
                           "model.multi_modal_projector.linear_1.weight")
        self.projector = Projector(weights, projector.removesuffix(".linear_1.weight"),
                                   str(raw.get("projector_hidden_act", "gelu")))
        self.model_type = str(raw.get("model_type", "llava_next"))
        self.anyres: AnyRes | None = None
        if self.model_type == "llava_next":
            self.image_newline = nn.Parameter(
                weights.get_tensor(_first(weights, "image_newline", "model.image_newline")),
                requires_grad=False)
            pinpoints = raw.get("image_grid_pinpoints") or DEFAULT_PINPOINTS
            self.anyres = AnyRes(tuple((int(h), int(w)) for h, w in pinpoints),
                                 vision.image_size, vision.grid)
        self.image_layout = LlavaNextImages(self.anyres, vision.num_channels, vision.image_size,
                                            vision.grid)
        self.images = ImageEmbeddings()

    @classmethod
    def load(cls, config: ModelConfig, dtype: torch.dtype, dist: Dist,
             backend: AttentionBackend) -> LlavaNext:
        decoder = text_config(config.raw)
        return with_weights(config, dtype, dist,
                            lambda weights: cls(decoder, config.raw, weights, backend))

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        """One image's rows [tokens, hidden]: tower (class token dropped), projector, anyres
        packing by its original (height, width) (LLaVA 1.5: its one tile's rows)."""
        height, width = grid
        features = self.visual(pixel_values.to(self.device))[:, 1:]
        projected = self.projector(features)
        if self.anyres is None:
            return projected[0].to(self.dtype)
        return self.anyres.pack(projected, height, width, self.image_newline).to(self.dtype)

    def warmup_images(self) -> None:
        """The tower on the most tiles any pinpoint gives (its whole resolution as the image;
        LLaVA 1.5: one tile)."""
        side = self.visual.config.image_size
        height, width, tiles = side, side, 1
        if self.anyres is not None:
            height, width = max(self.anyres.pinpoints, key=lambda hw: hw[0] * hw[1])
            rows, cols = self.anyres.tiles(height, width)
            tiles += rows * cols
        pixels = torch.zeros(tiles, self.visual.config.num_channels, side, side,
                             device=self.device)
        self.encode(pixels, (height, width))
