"""Qwen2-VL's multimodal rotary positions (M-RoPE): every token has a (temporal, height, width)
position, and the rotary frequencies are split into three sections, each rotated by one axis.

Text tokens have the same position on the three axes, so a text-only sequence rotates exactly
as plain RoPE does: only image tokens (and the text after them) need the 3-D form. An image of
(t, h, w) merged tokens starting at position p takes positions (p + i, p + j, p + k) over its
grid; the text after it continues at max(those) + 1. Hence a request's positions are its token
indices plus a shift that changes only at images, and its decode position is
index + `rope_delta` (the shift after the last image), the same on the three axes: the engine
adds that delta to the 1-D positions it already builds, and only a prefill chunk that covers
image tokens carries the 3-D positions (transformers' Qwen2VLModel.get_rope_index, per chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image's tokens in a prompt: input_ids[offset : offset + count], laid out over the
    merged grid (t, h, w) row-major (t * h * w == count)."""

    offset: int
    count: int
    grid: tuple[int, int, int]


def merged_grid(grid_thw: Sequence[int], merge: int) -> tuple[int, int, int]:
    """The image processor's patch grid (t, h, w) as the language model sees it: the patch merger
    joins merge x merge patches into one token."""
    t, h, w = (int(v) for v in grid_thw)
    return t, h // merge, w // merge


def rope_delta(spans: Sequence[ImageSpan], prompt_length: int) -> int:
    """What a position past the last image adds to its index (negative: an image of n tokens
    spans only max(h, w) positions)."""
    return _shifts(spans)[-1] if spans else 0


def _shifts(spans: Sequence[ImageSpan]) -> list[int]:
    """The shift (position - index) of the text after each image, in order: an image starting
    at position p advances the text to p + max(h, w) (its largest position + 1; images have
    t == 1, as transformers counts them)."""
    shifts, shift = [], 0
    for span in spans:
        _, h, w = span.grid
        after = span.offset + shift + max(h, w)
        shift = after - (span.offset + span.count)
        shifts.append(shift)
    return shifts


def mrope_positions(spans: Sequence[ImageSpan], start: int, end: int) -> torch.Tensor:
    """[3, end - start] int64: the M-RoPE positions of tokens [start, end) of a sequence whose
    images are `spans` (sorted by offset; any token past the prompt is text)."""
    index = torch.arange(start, end, dtype=torch.long)
    if not spans:
        return index.unsqueeze(0).repeat(3, 1)
    after = _shifts(spans)
    ends = torch.tensor([s.offset + s.count for s in spans], dtype=torch.long)
    # A text token's shift is that after the images ending at or before it.
    shift = torch.tensor([0, *after], dtype=torch.long)[torch.searchsorted(ends, index, right=True)]
    out = (index + shift).unsqueeze(0).repeat(3, 1)
    for span, before in zip(spans, [0, *after[:-1]], strict=True):
        lo, hi = max(span.offset, start), min(span.offset + span.count, end)
        if lo >= hi:
            continue
        _, h, w = span.grid
        local = torch.arange(lo, hi, dtype=torch.long) - span.offset
        first = span.offset + before
        cols = slice(lo - start, hi - start)
        out[0, cols] = first
        out[1, cols] = first + (local // w) % h
        out[2, cols] = first + local % w
    return out


def mrope_cos_sin(
    cos_sin: tuple[torch.Tensor, torch.Tensor], section: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [3, tokens, dim / 2] of the three axes' positions into the [tokens, dim / 2]
    M-RoPE takes: frequency block i (of `section`'s sizes) rotated by axis i % 3."""

    def pick(table: torch.Tensor) -> torch.Tensor:
        parts = table.split(list(section), dim=-1)
        return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)

    return pick(cos_sin[0]), pick(cos_sin[1])
