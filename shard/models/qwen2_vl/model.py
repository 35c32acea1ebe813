"""Qwen2-VL (`qwen2_vl`) and Qwen2.5-VL (`qwen2_5_vl`, its tower windowed): the registry's Qwen2
decoder (shard/models/llama/) with M-RoPE positions (mrope.py), fed image embeddings from its
vision tower (vision.py) in place of the image tokens' own.

A forward without images (text-only requests, every decode step) is the Qwen2 decoder's, at
the 1-D positions the engine gives (a request's index + its rope delta): M-RoPE with three equal
axes is plain RoPE, so decode CUDA graphs capture and replay it unchanged. A prefill chunk that
covers image tokens comes with a StepMedia (shard/models/media_inputs.py): the 3-D positions
of its tokens and which rows take which slice of which image's embeddings. The tower's output
for an image is kept (ImageEmbeddings) until a chunk has computed its last token, so a chunked
prefill that splits an image runs the tower once.
"""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.device.distributed import Dist
from pytgi_shard.layers.rotary import interleaved_rotation_tables, rotation_tables
from pytgi_shard.models.config_layout import legacy_layout
from pytgi_shard.models.fused_qkv_decoder import with_weights
from pytgi_shard.models.llama.config import LlamaConfig
from pytgi_shard.models.llama.model import Llama
from pytgi_shard.models.media_inputs import ImageRows, StepMedia
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.models.qwen2_vl.mrope import mrope_cos_sin
from pytgi_shard.models.qwen2_vl.vision import VisionConfig, VisionTower
from pytgi_shard.weights.reader import Weights

log = logging.getLogger(__name__)

# Images whose embeddings are kept between the chunks of a prefill at most (oldest dropped
# first: an evicted image is encoded again if a later chunk needs it, so this bounds memory
# only; a request cancelled between two chunks of one image leaves its entry until then).
KEPT_IMAGES = 32
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


class ImageEmbeddings:
    """The tower's output per (request, image offset), kept while chunks still need it."""

    def __init__(self, limit: int = KEPT_IMAGES) -> None:
        self.limit = limit
        self._kept: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()

    def get(self, key: tuple[int, int]) -> torch.Tensor | None:
        return self._kept.get(key)

    def keep(self, key: tuple[int, int], embeddings: torch.Tensor) -> None:
        self._kept[key] = embeddings
        while len(self._kept) > self.limit:
            self._kept.popitem(last=False)

    def drop(self, key: tuple[int, int]) -> None:
        self._kept.pop(key, None)

    def __len__(self) -> int:
        return len(self._kept)


class Qwen2VL(Llama):
    accepts_images = True

    def __init__(self, config: LlamaConfig, section: tuple[int, ...], vision: VisionConfig,
                 weights: Weights, backend: AttentionBackend) -> None:
        super().__init__(config, weights, backend)
        self.mrope_section = section
        self.visual = VisionTower(weights, "visual", vision)
        self.image_merge = vision.spatial_merge_size
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
        patch = self.visual.config.patch_size * self.image_merge
        side = max(int(math.isqrt(self.max_pixels)) // patch, 1) * self.image_merge
        return 1, side, side

    def warmup_images(self) -> None:
        grid = self.largest_grid()
        pixels = torch.zeros(grid[1] * grid[2], self.visual.patch_dim, device=self.device)
        self.encode(pixels, grid)

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's token embeddings [t*h*w / merge^2, hidden] in the model's dtype."""
        return self.visual(pixel_values.to(self.device), grid).to(self.dtype)

    def _image_rows(self, image: ImageRows) -> torch.Tensor:
        """The rows [lo, hi) of an image's embeddings, encoding it first unless kept; dropped
        once its last token is computed."""
        key = (image.request_id, image.offset)
        embeddings = self.images.get(key)
        if embeddings is None:
            if image.pixel_values is None:
                raise ValueError(f"request {image.request_id}: the image at token "
                                 f"{image.offset} has no pixel values and none are kept")
            embeddings = self.encode(image.pixel_values, image.grid)
            if embeddings.shape[0] != image.count:
                raise ValueError(
                    f"request {image.request_id}: the image at token {image.offset} has "
                    f"{image.count} tokens, its grid {list(image.grid)} gives "
                    f"{embeddings.shape[0]}")
        if image.hi < image.count:
            self.images.keep(key, embeddings)
        else:
            self.images.drop(key)
        return embeddings[image.lo : image.hi]

    def _mrope_rotations(self, positions3: torch.Tensor, dtype: torch.dtype
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (cos, sin) at 3-D positions, in the form its rotation takes."""
        cos, sin = mrope_cos_sin(self.rotary.cos_sin(positions3), self.mrope_section)
        if not self.fused_rotary:
            cos, sin = (interleaved_rotation_tables if self.config.rope_interleaved
                        else rotation_tables)(cos, sin, dtype)
        return [(cos, sin)] * len(self.layers)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor | None = None,
        media: StepMedia | None = None,
    ) -> torch.Tensor:
        if media is None:
            return super().forward(input_ids, positions, kv_cache, meta, lm_head_indices)
        hidden = self.embed_tokens(input_ids)
        for image in media.images:
            hidden[image.row : image.row + image.hi - image.lo] = self._image_rows(image)
        rotations = self._mrope_rotations(media.positions.to(positions.device), hidden.dtype)
        return self._layers_to_logits(hidden, rotations, kv_cache, meta, lm_head_indices)
