"""What a prefill forward of a vision-language model takes beside its tokens: the M-RoPE
positions of every flat token and, per image whose tokens the step computes, where its
embeddings go. Built by the engine (shard/engine/request_media.py) from the requests' images;
read by the model (shard/models/qwen2_vl/model.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ImageRows:
    """Tokens [lo, hi) of one image (of `count` tokens, at input_ids[offset:]) computed by this
    forward, at flat rows [row, row + hi - lo)."""

    request_id: int
    offset: int
    count: int
    # The tower's input: the processor's patch grid (t, h, w) and pixel values [patches, dim]
    # (None when the wire left them out: then the model must hold the image's embeddings).
    grid: tuple[int, int, int]
    pixel_values: torch.Tensor | None
    lo: int
    hi: int
    row: int


@dataclass(slots=True)
class StepMedia:
    # [3, flat tokens] int64: each token's (temporal, height, width) position.
    positions: torch.Tensor
    images: list[ImageRows]
