"""Rescale and normalize, as transformers' image processors do after resizing: one place for
every family's processor port (the float32 arithmetic is what the equality tests pin down)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

# OpenAI CLIP's mean and std (transformers' OPENAI_CLIP_MEAN / _STD): Qwen2-VL's and
# LLaVA-NeXT's defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def normalized(image: Image.Image | np.ndarray, rescale: float, mean: Sequence[float],
               std: Sequence[float]) -> np.ndarray:
    """[C, H, W] float32 of an RGB image (PIL, or uint8 [H, W, C]): times `rescale`, then
    (x - mean) / std per channel."""
    pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1)
    pixels = pixels * np.float32(rescale)
    m = np.asarray(mean, dtype=np.float32)[:, None, None]
    s = np.asarray(std, dtype=np.float32)[:, None, None]
    return (pixels - m) / s
