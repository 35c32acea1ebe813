"""The image processors of SigLIP-tower models, PaliGemma's (transformers' SiglipImageProcessor)
and Gemma 3's (Gemma3ImageProcessor): every image resized to the tower's one fixed size
(preprocessor_config.json `size` {height, width}; PaliGemma resamples bicubic, Gemma 3
bilinear, as each file's `resample` says), rescaled and normalized (mean = std = 0.5 by
default). Written on numpy and Pillow, as transformers' PIL backend computes it (the uint8
image resized by Pillow, then float32 arithmetic); tests/unit/router/http/media checks it equals
transformers' processors. Each image takes a fixed number of tokens, whatever its size.

Gemma 3's pan-and-scan (extra crops of a long image, each its own 256 tokens) is off unless
preprocessor_config.json turns it on; a checkpoint that turns it on is refused at start-up
(images_refusal), not served differently from transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from pytgi_router.http.media.decode import DecodedImage
from pytgi_router.http.media.pixels import normalized
from pytgi_router.http.media.processed import ProcessedImage

# transformers' IMAGENET_STANDARD_MEAN / _STD: SigLIP's and Gemma 3's defaults.
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)
# PIL's resampling codes as preprocessor_config.json stores them (PILImageResampling).
RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS,
            2: Image.Resampling.BILINEAR, 3: Image.Resampling.BICUBIC,
            4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}
BICUBIC, BILINEAR = 3, 2


@dataclass(frozen=True, slots=True)
class FixedSizeImageProcessor:
    """Resize to (height, width), rescale, normalize; `tokens` per image (the model's)."""

    height: int
    width: int
    tokens: int
    resample: int = BICUBIC
    image_mean: tuple[float, ...] = STANDARD_MEAN
    image_std: tuple[float, ...] = STANDARD_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_config(cls, config: dict[str, Any], tokens: int,
                    default_resample: int) -> FixedSizeImageProcessor:
        """preprocessor_config.json's fields (`size` {height, width}, resample, mean/std,
        rescale); `default_resample` where the file names none (the family's class default)."""
        size = config.get("size") or {}
        if "height" not in size or "width" not in size:
            raise ValueError(f"preprocessor_config.json size {size}: a fixed height and width "
                             "are expected for this model")
        resample = int(config.get("resample", default_resample))
        if resample not in RESAMPLE:
            raise ValueError(f"preprocessor_config.json resample {resample} is not a PIL filter")
        if config.get("do_resize") is False:
            raise ValueError("preprocessor_config.json do_resize false: the tower takes one "
                             "fixed size, images of another are not served")
        return cls(
            height=int(size["height"]), width=int(size["width"]), tokens=tokens,
            resample=resample,
            image_mean=tuple(config.get("image_mean") or STANDARD_MEAN),
            image_std=tuple(config.get("image_std") or STANDARD_STD),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            do_rescale=config.get("do_rescale") is not False,
            do_normalize=config.get("do_normalize") is not False,
        )

    def process(self, image: DecodedImage) -> ProcessedImage:
        """pixel_values [3, height, width] float32 (transformers' layout), no grid: the tower
        cuts the patches itself."""
        resized = image.image.resize((self.width, self.height), resample=RESAMPLE[self.resample])
        if self.do_normalize:
            rescale = self.rescale_factor if self.do_rescale else 1.0
            pixels = normalized(resized, rescale, self.image_mean, self.image_std)
        else:
            pixels = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1)
            if self.do_rescale:
                pixels = pixels * np.float32(self.rescale_factor)
        return ProcessedImage(np.ascontiguousarray(pixels, dtype=np.float32), (), self.tokens,
                              image.where, image.content_hash)


def _vision_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    vision = config.get("vision_config") or {}
    return vision if isinstance(vision, Mapping) else {}


def paligemma_processor(config: Mapping[str, Any], preprocessor: Mapping[str, Any]
                        ) -> FixedSizeImageProcessor:
    """PaliGemma's SiglipImageProcessor (bicubic); each image takes the processor's
    image_seq_length tokens (text_config.num_image_tokens, one per patch, where absent)."""
    vision = _vision_config(config)
    text = config.get("text_config") or {}
    patches = (int(vision.get("image_size", 224)) // int(vision.get("patch_size", 14))) ** 2
    tokens = int(preprocessor.get("image_seq_length") or text.get("num_image_tokens") or patches)
    if tokens != patches:
        raise ValueError(f"{tokens} image tokens for a tower of {patches} patches")
    return FixedSizeImageProcessor.from_config(dict(preprocessor), tokens, BICUBIC)


def gemma3_processor(config: Mapping[str, Any], preprocessor: Mapping[str, Any]
                     ) -> FixedSizeImageProcessor:
    """Gemma 3's image processor (bilinear); each image takes mm_tokens_per_image tokens.
    Pan-and-scan (crops of long images, each its own tokens) is not served."""
    if preprocessor.get("do_pan_and_scan"):
        raise ValueError("do_pan_and_scan is on in preprocessor_config.json; pytgi serves "
                         "Gemma 3's images without pan-and-scan (turn it off there)")
    tokens = int(config.get("mm_tokens_per_image") or 256)
    return FixedSizeImageProcessor.from_config(dict(preprocessor), tokens, BILINEAR)
