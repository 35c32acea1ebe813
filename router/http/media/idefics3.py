"""Idefics3's (`idefics3`) image processor and prompt, as transformers' PIL backend
(Idefics3ImageProcessorPil) and Idefics3Processor compute them, on numpy and Pillow:

- the image resized so its longest edge is `size.longest_edge` (aspect ratio kept, the other
  edge rounded up to even), then to multiples of the tile size (`max_image_size.longest_edge`,
  the tower's image_size); an image larger than one tile is cut into rows x cols tiles
  (row-major) followed by the whole image resized to one tile (the "global image"); one that
  fits is its own single tile. All resizes are Pillow's on the uint8 image (LANCZOS by default),
  then rescale and normalize (mean = std = 0.5).
- the prompt: each tile is `<fake_token_around_image><row_r_col_c>` + image_seq_len `<image>`,
  a "\\n" after each row of tiles, then "\\n<fake_token_around_image><global-img>" + the global
  image's `<image>`s + `<fake_token_around_image>` (a single-tile image: only the global part).

Every tile is the tower's size, so transformers' padding (to the batch's largest image, with a
pixel mask) never pads a tile of one request: the mask is all ones. The image's tokens are
several runs of `<image>` separated by that text, so `ProcessedImage.runs` lists them and each
tile goes to the shard as its own wire image of image_seq_len tokens (the model encodes tiles
independently). tests/unit/router/http/media/test_idefics3.py checks pixels and prompt ids
against transformers' processor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytgi_router.http.media.decode import DecodedImage
from pytgi_router.http.media.pixels import normalized
from pytgi_router.http.media.processed import ProcessedImage
from pytgi_router.http.media.siglip import RESAMPLE, STANDARD_MEAN, STANDARD_STD

# transformers' Idefics3 defaults: LANCZOS, longest edge 4 x 364, tiles of 364.
LANCZOS = 1
DEFAULT_LONGEST_EDGE = 4 * 364
DEFAULT_TILE = 364
# transformers' MAX_IMAGE_SIZE: no resized edge beyond 4k.
MAX_IMAGE_SIZE = 4096

FAKE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_TAG = "<global-img>"


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest edge `longest`, the other scaled (truncated, then rounded
    up to even), then scaled below MAX_IMAGE_SIZE (transformers' two resize-size helpers)."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tiled_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both edges rounded up to multiples of `tile`, the short one from the aspect ratio first
    (transformers' resize_for_vision_encoder)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def image_prompt(rows: int, cols: int, seq_len: int) -> str:
    """Idefics3Processor's text for one image of rows x cols tiles (0 x 0: a single tile)."""
    image = IMAGE_TOKEN * seq_len
    glob = f"{FAKE_TOKEN}{GLOBAL_TAG}{image}{FAKE_TOKEN}"
    if rows == 0 and cols == 0:
        return glob
    grid = "".join(
        "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
        for r in range(rows))
    return f"{grid}\n{glob}"


@dataclass(frozen=True, slots=True)
class Idefics3ImageProcessor:
    """Resize, split into tiles + global image, rescale, normalize; `seq_len` tokens a tile."""

    tile: int
    seq_len: int
    longest_edge: int = DEFAULT_LONGEST_EDGE
    do_resize: bool = True
    do_image_splitting: bool = True
    resample: int = LANCZOS
    image_mean: tuple[float, ...] = STANDARD_MEAN
    image_std: tuple[float, ...] = STANDARD_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_checkpoint(cls, config: Mapping[str, Any], preprocessor: Mapping[str, Any]
                        ) -> Idefics3ImageProcessor:
        """preprocessor_config.json's fields; the tokens per tile from config.json's tower
        ((image_size / patch_size)^2 / scale_factor^2, as Idefics3Model computes it). Tiles
        of another size than the tower's are refused (transformers would pad or bucket them)."""
        vision = config.get("vision_config") or {}
        image_size = int(vision.get("image_size", 224))
        patch = int(vision.get("patch_size", 32))
        scale = int(config.get("scale_factor", 2))
        side = image_size // patch
        if image_size % patch or side % scale:
            raise ValueError(f"a tower of {image_size} pixels in patches of {patch} does not "
                             f"pixel-shuffle by {scale}")
        size = preprocessor.get("size") or {"longest_edge": DEFAULT_LONGEST_EDGE}
        tile = int((preprocessor.get("max_image_size") or {}).get("longest_edge", DEFAULT_TILE))
        if "longest_edge" not in size:
            raise ValueError(f"preprocessor_config.json size {dict(size)}: a longest_edge is "
                             "expected")
        if tile != image_size:
            raise ValueError(f"max_image_size {tile}: tiles of the tower's image_size "
                             f"{image_size} are served")
        resample = int(preprocessor.get("resample", LANCZOS))
        if resample not in RESAMPLE:
            raise ValueError(f"preprocessor_config.json resample {resample} is not a PIL filter")
        return cls(
            tile=tile, seq_len=(side // scale) ** 2, longest_edge=int(size["longest_edge"]),
            do_resize=preprocessor.get("do_resize") is not False,
            do_image_splitting=preprocessor.get("do_image_splitting") is not False,
            resample=resample,
            image_mean=tuple(preprocessor.get("image_mean") or STANDARD_MEAN),
            image_std=tuple(preprocessor.get("image_std") or STANDARD_STD),
            rescale_factor=float(preprocessor.get("rescale_factor", 1 / 255)),
            do_rescale=preprocessor.get("do_rescale") is not False,
            do_normalize=preprocessor.get("do_normalize") is not False,
        )

    def tiles(self, image: Any) -> tuple[list[Any], int, int]:
        """The image's tiles (PIL, each tile x tile; the global image last) and its (rows,
        cols) of split tiles, (0, 0) for a single tile."""
        filt = RESAMPLE[self.resample]
        if self.do_resize:
            height, width = longest_edge_size(image.height, image.width, self.longest_edge)
            image = image.resize((width, height), resample=filt)
        t = self.tile
        if not self.do_image_splitting:
            return [image.resize((t, t), resample=filt)], 0, 0
        height, width = tiled_size(image.height, image.width, t)
        image = image.resize((width, height), resample=filt)
        if height <= t and width <= t:
            return [image], 0, 0
        rows, cols = height // t, width // t
        crops = [image.crop((c * t, r * t, (c + 1) * t, (r + 1) * t))
                 for r in range(rows) for c in range(cols)]
        return crops + [image.resize((t, t), resample=filt)], rows, cols

    def _pixels(self, tile: Any) -> np.ndarray:
        if self.do_normalize:
            return normalized(tile, self.rescale_factor if self.do_rescale else 1.0,
                              self.image_mean, self.image_std)
        pixels = np.asarray(tile, dtype=np.float32).transpose(2, 0, 1)
        return pixels * np.float32(self.rescale_factor) if self.do_rescale else pixels

    def process(self, image: DecodedImage) -> ProcessedImage:
        """pixel_values [tiles, 3, tile, tile] float32 (the global image last), no grid; the
        image's prompt text and its runs of seq_len `<image>` tokens, one per tile."""
        tiles, rows, cols = self.tiles(image.image)
        pixels = np.stack([self._pixels(t) for t in tiles]).astype(np.float32, copy=False)
        return ProcessedImage(
            np.ascontiguousarray(pixels), (), self.seq_len * len(tiles), image.where,
            image.content_hash, text=image_prompt(rows, cols, self.seq_len),
            runs=(self.seq_len,) * len(tiles))
