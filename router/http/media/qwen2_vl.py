"""Qwen2-VL's (and Qwen2.5-VL's) image processor, as transformers' PIL backend computes it
(Qwen2VLImageProcessorPil: smart_resize, bicubic resize, rescale, normalize, patches in the
merger's order), from the checkpoint's preprocessor_config.json. Written on numpy and Pillow
because the router imports no transformers or torch; tests/unit/router/http/media checks it
equals transformers' processor on the same images."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from pytgi_router.http.media.decode import DecodedImage
from pytgi_router.http.media.errors import ImageError
from pytgi_router.http.media.pixels import CLIP_MEAN, CLIP_STD, normalized
from pytgi_router.http.media.processed import ProcessedImage

MAX_ASPECT_RATIO = 200


@dataclass(frozen=True, slots=True)
class Qwen2VLImageProcessor:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Qwen2VLImageProcessor:
        """preprocessor_config.json's fields; `size` ({shortest_edge, longest_edge} or
        {min_pixels, max_pixels}) and the top-level min/max_pixels, as transformers reads them
        (the top-level ones win)."""
        size = config.get("size") or {}
        default = cls()
        low = size.get("shortest_edge", size.get("min_pixels", default.min_pixels))
        high = size.get("longest_edge", size.get("max_pixels", default.max_pixels))
        return cls(
            min_pixels=int(config.get("min_pixels") or low),
            max_pixels=int(config.get("max_pixels") or high),
            patch_size=int(config.get("patch_size", default.patch_size)),
            temporal_patch_size=int(config.get("temporal_patch_size",
                                               default.temporal_patch_size)),
            merge_size=int(config.get("merge_size", default.merge_size)),
            image_mean=tuple(config.get("image_mean") or CLIP_MEAN),
            image_std=tuple(config.get("image_std") or CLIP_STD),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, where: str, height: int, width: int) -> tuple[int, int]:
        """transformers' smart_resize: both sides multiples of patch x merge, the area inside
        [min_pixels, max_pixels], the aspect ratio kept as well as those allow."""
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ImageError(where, f"{width} x {height} pixels: the aspect ratio must be under "
                                    f"{MAX_ASPECT_RATIO} for this model")
        f = self.factor
        h_bar, w_bar = round(height / f) * f, round(width / f) * f
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar, w_bar = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h_bar, w_bar

    def tokens(self, where: str, width: int, height: int) -> int:
        """The image's tokens in the prompt, from its size alone (no pixel touched)."""
        h, w = self.resized(where, height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size ** 2

    def process(self, image: DecodedImage) -> ProcessedImage:
        """Resize (bicubic, on the uint8 image as transformers' PIL backend does), rescale,
        normalize, then the patches in the order the vision tower's merger reads them."""
        width, height = image.size
        h, w = self.resized(image.where, height, width)
        resized = image.image.resize((w, h), resample=Image.Resampling.BICUBIC)
        pixels = normalized(resized, self.rescale_factor, self.image_mean, self.image_std)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        patches = pixels.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        flat = np.ascontiguousarray(patches.reshape(gh * gw, 3 * t * p * p), dtype=np.float32)
        return ProcessedImage(flat, (1, gh, gw), gh * gw // m ** 2, image.where,
                              image.content_hash)
