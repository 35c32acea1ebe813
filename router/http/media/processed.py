"""What an image processor makes of one decoded image, whatever the model family: the
`ImageProcessor` protocol every family's processor port (qwen2_vl.py, llava_next.py, …)
implements, and its `ProcessedImage`, which prepare.py turns into the wire's `Image` message
without knowing the family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pytgi_router.http.media.decode import DecodedImage


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """What the vision tower takes for one image and how many prompt tokens stand for it.

    pixel_values: float32, in the family's own layout (Qwen2-VL: [patches, C*T*P*P]; LLaVA-NeXT:
    [1 + tiles, C, H, W]); sent as is, its shape with it.
    grid: the tower's other per-image input, family-specific integers the shard's family reads
    (Qwen2-VL: image_grid_thw (t, h, w) in patches; LLaVA-NeXT: the original (height, width) it
    unpads by; () when the family needs none). Sent with every chunk of the request, pixels or not.
    tokens: the image's tokens in the prompt (the shard checks its tower gives as many).
    where / content_hash: the image's place in the body and its decoded pixels' hash (decode.py).
    text: the family's prompt text for this image when it depends on the image itself (Idefics3:
    its tile grid, the `<image>` tokens inside); "" = the image token repeated `tokens` times.
    runs: when the image's tokens are several runs separated by text (Idefics3: one per tile),
    each run's token count; pixel_values then has one row per run, and each run goes to the
    shard as its own wire image. () = one run of `tokens`, pixel_values sent whole.
    """

    pixel_values: np.ndarray
    grid: tuple[int, ...]
    tokens: int
    where: str = ""
    content_hash: bytes = b""
    text: str = ""
    runs: tuple[int, ...] = ()


class ImageProcessor(Protocol):
    """A family's image processor, ported from transformers onto numpy + Pillow (the router
    imports neither torch nor transformers); built from the checkpoint's preprocessor_config.json
    (and config.json where the family reads the tower's geometry there)."""

    def process(self, image: DecodedImage) -> ProcessedImage:
        """The image as the tower takes it; runs in the worker pool (resizing costs)."""
        ...
