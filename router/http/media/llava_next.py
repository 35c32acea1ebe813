"""LLaVA-NeXT's (`llava_next`) image processor, as transformers' PIL backend computes it
(LlavaNextImageProcessorPil, "anyres"): the resolution of `image_grid_pinpoints` that keeps the
most of the image (select_best_resolution), the image resized into it keeping its aspect ratio
and padded (centered, zeros) to it, cut into crop-size tiles, after a base tile of the whole image
resized to a square; each tile resized/center-cropped to the tower's size, rescaled, normalized
(CLIP). And the image's token count as LlavaNextProcessor computes it: the base tile's patches,
plus the tiles' patch grid with the padding rows/columns removed ("unpad") and one newline token
per remaining row. Written on numpy and Pillow (the router imports no transformers or torch);
tests/unit/router/http/media checks it equals transformers' processor and processor counts.

LLaVA 1.5 (`llava`) is the same without anyres (`anyres=False`, transformers' LlavaImageProcessor
without padding): the image as one tile, resized by its shortest edge and center-cropped, taking
(crop / patch)^2 tokens."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image

from pytgi_router.http.media.decode import DecodedImage
from pytgi_router.http.media.pixels import CLIP_MEAN, CLIP_STD, normalized
from pytgi_router.http.media.processed import ProcessedImage

# transformers' LlavaNextImageProcessor defaults.
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def select_best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]
                           ) -> tuple[int, int]:
    """The (height, width) that keeps the most of the image's pixels when it is scaled into it,
    the least wasted area on ties (transformers' select_best_resolution)."""
    best, most, waste = pinpoints[0], 0, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < waste):
            best, most, waste = (h, w), effective, wasted
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """The image's size scaled into `target` keeping its aspect ratio (get_patch_output_size)."""
    th, tw = target
    scale_w, scale_h = tw / width, th / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), th), tw
    return th, min(math.ceil(width * scale_h), tw)


def unpadded_grid(height: int, width: int, grid_h: int, grid_w: int) -> tuple[int, int]:
    """The tiles' feature grid (grid_h x grid_w patches) without the rows or columns that only
    the padding covers (transformers' unpad_image / _get_unpadded_features)."""
    if width / height > grid_w / grid_h:
        new_height = int(round(height * (grid_w / width), 7))
        return grid_h - (grid_h - new_height) // 2 * 2, grid_w
    new_width = int(round(width * (grid_h / height), 7))
    return grid_h, grid_w - (grid_w - new_width) // 2 * 2


def _side(size: Mapping[str, Any], key: str) -> int | None:
    value = size.get(key)
    return int(value) if value else None


@dataclass(frozen=True, slots=True)
class LlavaNextImageProcessor:
    pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS
    # The base tile's square side (size.shortest_edge, or size height x width).
    size: tuple[int, int] = (336, 336)
    shortest_edge: int | None = 336
    crop: tuple[int, int] = (336, 336)
    do_center_crop: bool = True
    # The vision tower's patch side (config.json vision_config.patch_size).
    patch_size: int = 14
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC
    # False: LLaVA 1.5, the image as one center-cropped tile (no pinpoints, no newlines).
    anyres: bool = True

    @classmethod
    def llava(cls, config: Mapping[str, Any], pre: Mapping[str, Any]) -> LlavaNextImageProcessor:
        """LLaVA 1.5's processor (transformers' LlavaImageProcessor / CLIPImageProcessor); its
        `do_pad` (a pad to square first) is not served."""
        if pre.get("do_pad"):
            raise ValueError("do_pad (pad to square) in preprocessor_config.json")
        return replace(cls.from_checkpoint(config, pre), anyres=False)

    @classmethod
    def from_checkpoint(cls, config: Mapping[str, Any], pre: Mapping[str, Any]
                        ) -> LlavaNextImageProcessor:
        """preprocessor_config.json's fields (transformers' defaults for those it lacks) and the
        tower's patch size from config.json. Only `vision_feature_select_strategy` "default"
        (the class token dropped, as every LLaVA checkpoint ships) is served."""
        strategy = config.get("vision_feature_select_strategy", "default")
        if strategy != "default":
            raise ValueError(f"vision_feature_select_strategy {strategy!r} (only 'default')")
        vision = config.get("vision_config") or {}
        size = pre.get("size") or {"shortest_edge": 336}
        shortest = _side(size, "shortest_edge")
        square = (shortest, shortest) if shortest else (int(size["height"]), int(size["width"]))
        crop = pre.get("crop_size") or {"height": 336, "width": 336}
        do_crop = bool(pre.get("do_center_crop", True))
        crop_hw = (int(crop["height"]), int(crop["width"])) if do_crop else square
        pinpoints = (pre.get("image_grid_pinpoints") or config.get("image_grid_pinpoints")
                     or DEFAULT_PINPOINTS)
        return cls(
            pinpoints=tuple((int(h), int(w)) for h, w in pinpoints),
            size=square, shortest_edge=shortest, crop=crop_hw, do_center_crop=do_crop,
            patch_size=int(vision.get("patch_size", 14)),
            image_mean=tuple(pre.get("image_mean") or CLIP_MEAN),
            image_std=tuple(pre.get("image_std") or CLIP_STD),
            rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
            resample=int(pre.get("resample", Image.Resampling.BICUBIC)),
        )

    def tokens(self, height: int, width: int) -> int:
        """The image's tokens in the prompt (LlavaNextProcessor._get_number_of_features, the
        class token dropped): base tile patches + unpadded tile grid + one newline per row."""
        if not self.anyres:
            return (self.crop[0] // self.patch_size) * (self.crop[1] // self.patch_size)
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        tile_h, tile_w = self.crop
        ph, pw = tile_h // self.patch_size, tile_w // self.patch_size
        rows, cols = unpadded_grid(height, width, ph * (best_h // tile_h), pw * (best_w // tile_w))
        return ph * pw + rows * cols + rows

    def _resized(self, image: Image.Image, height: int, width: int) -> Image.Image:
        if image.size == (width, height):
            return image
        return image.resize((width, height), resample=Image.Resampling(self.resample))

    def _tile(self, tile: Image.Image) -> np.ndarray:
        """One tile as the tower takes it: resized to `size` (shortest edge kept in ratio),
        center-cropped, rescaled and normalized: [C, crop_h, crop_w]."""
        w, h = tile.size
        if self.shortest_edge:
            short, long = sorted((w, h))
            new_long = int(self.shortest_edge * long / short)
            h, w = (self.shortest_edge, new_long) if h <= w else (new_long, self.shortest_edge)
        else:
            h, w = self.size
        tile = self._resized(tile, h, w)
        if self.do_center_crop:
            ch, cw = self.crop
            top, left = (h - ch) // 2, (w - cw) // 2
            tile = tile.crop((left, top, left + cw, top + ch))
        return normalized(tile, self.rescale_factor, self.image_mean, self.image_std)

    def process(self, image: DecodedImage) -> ProcessedImage:
        """pixel_values [1 + tiles, C, crop_h, crop_w] (the base tile first); grid = the
        original (height, width), which the tower's packing unpads by."""
        width, height = image.size
        if not self.anyres:
            pixels = self._tile(image.image)[None]
            return ProcessedImage(pixels, (height, width), self.tokens(height, width),
                                  image.where, image.content_hash)
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        new_h, new_w = fitted_size(height, width, (best_h, best_w))
        fitted = np.asarray(self._resized(image.image, new_h, new_w))
        padded = np.zeros((best_h, best_w, 3), dtype=np.uint8)
        top, left = (best_h - new_h) // 2, (best_w - new_w) // 2
        padded[top : top + new_h, left : left + new_w] = fitted
        tile_h, tile_w = self.crop
        tiles = [Image.fromarray(padded[i : i + tile_h, j : j + tile_w])
                 for i in range(0, best_h, tile_h) for j in range(0, best_w, tile_w)]
        base = self._resized(image.image, *self.size)
        pixels = np.stack([self._tile(t) for t in [base, *tiles]]).astype(np.float32)
        return ProcessedImage(pixels, (height, width), self.tokens(height, width), image.where,
                              image.content_hash)
