"""What a prefill forward of a vision-language model takes beside its tokens, whatever the
family: per image whose tokens the step computes, where its embeddings go (`ImageRows`), and, for
M-RoPE models only (Qwen2-VL), the 3-D positions of every flat token. Built by the engine
(shard/engine/request_media.py) from the requests' images, checked there against the model's
`ImageLayout`; read by the model (shard/models/vision_language.py and each family's model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


class ImageLayout(Protocol):
    """How a vision-language model reads one wire image (`Model.image_layout`; None: the model
    takes no images and the shard refuses them)."""

    # M-RoPE's spatial merge size: positions are 3-D, computed from each image's grid (Qwen2-VL);
    # 0: plain 1-D positions (every other family).
    @property
    def mrope_merge(self) -> int: ...

    def refusal(self, grid: tuple[int, ...], shape: tuple[int, ...] | None, tokens: int
                ) -> str | None:
        """Why an image of this `grid` (the family's per-image integers), pixel `shape` (None
        when the chunk carries no pixels) cannot be `tokens` prompt tokens of this model, in a
        few words; None when it can."""
        ...


@runtime_checkable
class BidirectionalLayout(Protocol):
    """An ImageLayout whose model attends bidirectionally within spans of the prompt (PaliGemma:
    the whole prompt, its prefix; Gemma 3: each image's tokens); the other families are causal
    and do not implement it."""

    def noncausal_spans(self, images: tuple[tuple[int, int], ...], prompt: int
                        ) -> tuple[tuple[int, int], ...]:
        """The request's spans [lo, hi), disjoint and in order, from its images' (offset,
        count) and its prompt length: AttentionMetadata.spans' source (the router plans its
        chunks so that none is split: router/core/step_plan.py)."""
        ...


@dataclass(frozen=True, slots=True)
class ImageRows:
    """Tokens [lo, hi) of one image (of `count` tokens, at input_ids[offset:]) computed by this
    forward, at flat rows [row, row + hi - lo)."""

    request_id: int
    offset: int
    count: int
    # The tower's input: the family's grid (Qwen2-VL: (t, h, w) patches; LLaVA-NeXT: the
    # original (height, width)) and pixel values in the family's layout (None when the wire
    # left them out: then the model must hold the image's embeddings).
    grid: tuple[int, ...]
    pixel_values: torch.Tensor | None
    lo: int
    hi: int
    row: int


@dataclass(slots=True)
class StepMedia:
    # [3, flat tokens] int64: each token's (temporal, height, width) position; None for 1-D
    # position models (the forward's own positions apply).
    positions: torch.Tensor | None
    images: list[ImageRows]
    # [flat tokens, 2] int32: each token's bidirectional span (AttentionMetadata.spans, which
    # the model sets from it), None when no token is in one.
    spans: torch.Tensor | None = None
