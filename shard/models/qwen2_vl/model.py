"""Qwen2-VL (`qwen2_vl`) and Qwen2.5-VL (`qwen2_5_vl`, its tower windowed): the registry's Qwen2
decoder (shard/models/llama/) with M-RoPE positions (mrope.py), fed image embeddings from its
vision tower (vision.py) in place of the image tokens' own.

A forward without images (text-only requests, every decode step) is the Qwen2 decoder's, at
the 1-D positions the engine gives (a request's index + its rope delta): M-RoPE with three equal
axes is plain RoPE, so decode CUDA graphs capture and replay it unchanged. A prefill chunk that
covers image tokens comes with a StepMedia (shard/models/media_inputs.py): the 3-D positions
of its tokens and which rows take which slice of which image's embeddings (the forward is
LlamaVLM's, shard/models/vision_language.py, at this family's `_image_rotations`). The tower's
output for an image is kept (ImageEmbeddings) until a chunk has computed its last token, so a
chunked prefill that splits an image runs the tower once.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.device.distributed import Dist
from pytgi_shard.layers.rotary import interleaved_rotation_tables, rotation_tables
from pytgi_shard.models.config_layout import legacy_layout
from pytgi_shard.models.fused_qkv_decoder import with_weights
from pytgi_shard.models.llama.config import LlamaConfig
from pytgi_shard.models.media_inputs import StepMedia
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.models.qwen2_vl.mrope import mrope_cos_sin
from pytgi_shard.models.qwen2_vl.vision import VisionConfig, VisionTower
from pytgi_shard.models.vision_language import ImageEmbeddings, LlamaVLM
from pytgi_shard.weights.reader import Weights

log = logging.getLogger(__name__)

# transformers' Qwen2VLImageProcessor default max_pixels.
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


def processor_max_pixels(path: Path) -> int:
    """The image processor's max_pixels, as transformers reads preprocessor_config.json (the
    top-level key, else size.longest_edge or size.max_pixels); Qwen2-VL's default without it."""
    if not path.is_file():
        return DEFAULT_MAX_PIXELS
    config = json.loads(path.read_text())
    size = config.get("size") or {}
    return int(config.get("max_pixels") or size.get("longest_edge")
               or size.get("max_pixels") or DEFAULT_MAX_PIXELS)


def text_config(raw: Mapping[str, Any]) -> tuple[LlamaConfig, tuple[int, ...]]:
    """The decoder's configuration and M-RoPE's frequency sections, from a Qwen2-VL config.json
    in either layout: transformers 4's (text fields at the top, `rope_scaling` {type: mrope})
    or 5's (`text_config` with `rope_parameters`)."""
    top = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    text = legacy_layout({**top, **(raw.get("text_config") or {})})
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    section = tuple(int(s) for s in rope.get("mrope_section") or ())
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"qwen2_vl with rope type {kind!r}: only M-RoPE is served")
    decoder = LlamaConfig.from_dict({**text, "model_type": "qwen2", "rope_scaling": None})
    head_dim = decoder.head_dim
    if sum(section) != head_dim // 2:
        raise ValueError(f"qwen2_vl mrope_section {list(section)} does not add up to half the "
                         f"head dimension ({head_dim // 2})")
    return decoder, section


@dataclass(frozen=True, slots=True)
class Qwen2VLImages:
    """Qwen2-VL's wire images: grid (t, h, w) in patches, t = 1 (no video), h and w whole
    multiples of the merge; t*h*w / merge^2 tokens; pixels [t*h*w, patch values]."""

    mrope_merge: int
    patch_dim: int

    def refusal(self, grid: tuple[int, ...], shape: tuple[int, ...] | None, tokens: int
                ) -> str | None:
        merge = self.mrope_merge
        if len(grid) != 3 or min(grid) <= 0:
            return f"grid {list(grid)} is not (t, h, w)"
        t, h, w = grid
        if h % merge or w % merge:
            return f"grid {list(grid)} does not merge by {merge}"
        if t != 1:
            return f"{t} frames: videos are not served"
        if t * h * w // merge**2 != tokens:
            return f"grid {list(grid)} gives {t * h * w // merge**2} tokens, not {tokens}"
        if shape is not None and shape != (t * h * w, self.patch_dim):
            return (f"pixel values of shape {list(shape)} are not float32 "
                    f"[{t * h * w}, {self.patch_dim}]")
        return None


class Qwen2VL(LlamaVLM):

    def __init__(self, config: LlamaConfig, section: tuple[int, ...], vision: VisionConfig,
                 weights: Weights, backend: AttentionBackend) -> None:
        super().__init__(config, weights, backend)
        self.mrope_section = section
        self.visual = VisionTower(weights, "visual", vision)
        self.image_layout = Qwen2VLImages(vision.spatial_merge_size, self.visual.patch_dim)
        self.spatial_merge = vision.spatial_merge_size
        self.model_type = "qwen2_5_vl" if vision.windowed else "qwen2_vl"
        self.images = ImageEmbeddings()
        # The processor's largest image (preprocessor_config.json): what Warmup encodes.
        self.max_pixels = DEFAULT_MAX_PIXELS

    @classmethod
    def load(cls, config: ModelConfig, dtype: torch.dtype, dist: Dist,
             backend: AttentionBackend) -> Qwen2VL:
        decoder, section = text_config(config.raw)
        vision = VisionConfig(config.raw.get("vision_config") or {},
                              windowed=config.model_type == "qwen2_5_vl")
        model = with_weights(config, dtype, dist,
                             lambda weights: cls(decoder, section, vision, weights, backend))
        model.max_pixels = processor_max_pixels(config.path / "preprocessor_config.json")
        return model

    def largest_grid(self) -> tuple[int, int, int]:
        """The patch grid of the largest image the processor gives: a square of max_pixels."""
        patch = self.visual.config.patch_size * self.spatial_merge
        side = max(int(math.isqrt(self.max_pixels)) // patch, 1) * self.spatial_merge
        return 1, side, side

    def warmup_images(self) -> None:
        grid = self.largest_grid()
        pixels = torch.zeros(grid[1] * grid[2], self.visual.patch_dim, device=self.device)
        self.encode(pixels, grid)

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        """One image's token embeddings [t*h*w / merge^2, hidden] in the model's dtype."""
        t, h, w = grid
        return self.visual(pixel_values.to(self.device), (t, h, w)).to(self.dtype)

    def _image_rotations(self, positions: torch.Tensor, media: StepMedia, dtype: torch.dtype
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (cos, sin) at the StepMedia's 3-D positions, in the form its rotation
        takes."""
        assert media.positions is not None  # an M-RoPE model's StepMedia carries them
        positions3 = media.positions.to(positions.device)
        cos, sin = mrope_cos_sin(self.rotary.cos_sin(positions3), self.mrope_section)
        if not self.fused_rotary:
            cos, sin = (interleaved_rotation_tables if self.config.rope_interleaved
                        else rotation_tables)(cos, sin, dtype)
        return [(cos, sin)] * len(self.layers)
