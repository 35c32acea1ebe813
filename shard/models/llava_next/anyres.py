"""LLaVA-NeXT's "anyres" geometry, shard side: which grid of tiles an image of a given original
size was cut into (the pinpoint that keeps most of it), which rows/columns of the tiles' feature
grid are padding ("unpad"), and so how many tokens the image takes: the base tile's patches, the
unpadded grid, one image_newline per grid row (transformers' modeling_llava_next /
LlavaNextProcessor; the router's port is router/http/media/llava_next.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def select_best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]
                           ) -> tuple[int, int]:
    """The (height, width) that keeps the most of the image's pixels when it is scaled into it,
    the least wasted area on ties."""
    best, most, waste = pinpoints[0], 0, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < waste):
            best, most, waste = (h, w), effective, wasted
    return best


def unpadded_window(height: int, width: int, rows: int, cols: int
                    ) -> tuple[slice, slice]:
    """The rows and columns of a rows x cols feature grid that the image (not the padding)
    covers (transformers' unpad_image)."""
    if width / height > cols / rows:
        new_height = int(round(height * (cols / width), 7))
        pad = (rows - new_height) // 2
        return slice(pad, rows - pad), slice(0, cols)
    new_width = int(round(width * (rows / height), 7))
    pad = (cols - new_width) // 2
    return slice(0, rows), slice(pad, cols - pad)


@dataclass(frozen=True, slots=True)
class AnyRes:
    pinpoints: tuple[tuple[int, int], ...]
    # The tower's tile side in pixels and patches per tile side.
    image_size: int
    grid: int

    def tiles(self, height: int, width: int) -> tuple[int, int]:
        """The tile grid (rows, columns) an image of this original size is cut into."""
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        return best_h // self.image_size, best_w // self.image_size

    def tokens(self, height: int, width: int) -> int:
        rows, cols = self.tiles(height, width)
        r, c = unpadded_window(height, width, rows * self.grid, cols * self.grid)
        kept_rows, kept_cols = r.stop - r.start, c.stop - c.start
        return self.grid ** 2 + kept_rows * (kept_cols + 1)

    def pack(self, features: torch.Tensor, height: int, width: int, newline: torch.Tensor
             ) -> torch.Tensor:
        """features [1 + tiles, grid*grid, hidden] (the base tile first) -> the image's rows in
        prompt order: the base tile's, then the tiles' grid unpadded, row by row, each row
        followed by `newline`."""
        rows, cols = self.tiles(height, width)
        g, hidden = self.grid, features.shape[-1]
        base, tiles = features[0], features[1:]
        grid = tiles.view(rows, cols, g, g, hidden).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(rows * g, cols * g, hidden)
        r, c = unpadded_window(height, width, rows * g, cols * g)
        grid = grid[r, c]
        ends = newline.to(grid.dtype).view(1, 1, -1).expand(grid.shape[0], 1, hidden)
        return torch.cat([base, torch.cat([grid, ends], dim=1).reshape(-1, hidden)])
