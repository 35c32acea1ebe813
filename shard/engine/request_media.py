"""A request's images as the shard runs them (a vision-language model's; issue 28): their token
spans and grids, checked against the prompt, its M-RoPE rope delta, and each prefill step's
StepMedia (3-D positions of the chunk's tokens, the image rows it computes).

The router sends every image's grid and token span with each chunk of the request, and the
pixel values only with the chunks that compute some of its tokens (router/core/batch_wire.py):
so a chunk starting mid-prompt, after a prefix-cache hit, or a resumed request, still has every
position, computed from the whole prompt (mrope_positions over its spans).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.models.media_inputs import ImageRows, StepMedia
from pytgi_shard.models.qwen2_vl.mrope import ImageSpan, merged_grid, mrope_positions, rope_delta


@dataclass(frozen=True, slots=True)
class RequestMedia:
    images: tuple[generate_pb2.Image, ...]
    spans: tuple[ImageSpan, ...]
    # Decode position = sequence index + rope_delta (M-RoPE's text after the last image).
    rope_delta: int


def request_media(pb: generate_pb2.Request, merge: int) -> RequestMedia | None:
    """`pb`'s images, checked (InvalidRequest); None without images. `merge`: the model's
    spatial merge size, 0 when it takes no images."""
    if not pb.images:
        return None
    who = f"request {pb.id}"
    if not merge:
        raise InvalidRequest(f"{who}: {len(pb.images)} images, and this model has no vision "
                             "tower: this shard serves text only")
    images = tuple(sorted(pb.images, key=lambda i: i.token_offset))
    spans = []
    end = 0
    for k, image in enumerate(images):
        spans.append(_span(who, k, image, merge, len(pb.input_ids)))
        if image.token_offset < end:
            raise InvalidRequest(f"{who}: image {k}'s tokens overlap the previous image's")
        end = image.token_offset + image.token_count
    return RequestMedia(images, tuple(spans), rope_delta(spans, len(pb.input_ids)))


def _span(who: str, k: int, image: generate_pb2.Image, merge: int, prompt: int) -> ImageSpan:
    if len(image.grid) != 3 or min(image.grid) <= 0:
        raise InvalidRequest(f"{who}: image {k} has grid {list(image.grid)}, not (t, h, w)")
    t, h, w = image.grid
    if h % merge or w % merge:
        raise InvalidRequest(f"{who}: image {k}'s grid {list(image.grid)} does not merge by "
                             f"{merge}")
    grid = merged_grid(image.grid, merge)
    if t != 1:
        raise InvalidRequest(f"{who}: image {k} has {t} frames: videos are not served")
    if grid[0] * grid[1] * grid[2] != image.token_count:
        raise InvalidRequest(f"{who}: image {k}'s grid {list(image.grid)} gives "
                             f"{grid[0] * grid[1] * grid[2]} tokens, not {image.token_count}")
    if image.token_offset + image.token_count > prompt:
        raise InvalidRequest(f"{who}: image {k}'s tokens end past the prompt ({prompt} tokens)")
    if image.pixel_values:
        patches = t * h * w
        if image.dtype != "float32" or len(image.shape) != 2 or image.shape[0] != patches or (
            len(image.pixel_values) != 4 * image.shape[0] * image.shape[1]
        ):
            raise InvalidRequest(
                f"{who}: image {k}'s pixel values ({image.dtype}, shape {list(image.shape)}, "
                f"{len(image.pixel_values)} bytes) are not float32 [{patches}, patch values]")
    return ImageSpan(image.token_offset, image.token_count, grid)


def _pixels(image: generate_pb2.Image) -> torch.Tensor | None:
    if not image.pixel_values:
        return None
    flat = torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32)
    return flat.view(*image.shape)


class MediaRow(Protocol):
    """What step_media reads of one request (RequestState)."""

    @property
    def id(self) -> int: ...
    @property
    def cache_len(self) -> int: ...
    @property
    def chunk_end(self) -> int: ...
    @property
    def media(self) -> RequestMedia | None: ...


def step_media(requests: Sequence[MediaRow], positions: torch.Tensor, n_decode: int
               ) -> StepMedia | None:
    """The StepMedia of a forward whose flat tokens are `n_decode` decode rows (their 1-D
    positions already include their rope delta), then each request's chunk; None when no
    request has images (every position is then 1-D)."""
    if not any(r.media is not None for r in requests):
        return None
    parts = [positions[:n_decode].cpu().unsqueeze(0).expand(3, -1)]
    images: list[ImageRows] = []
    row = n_decode
    for r in requests:
        start, end = r.cache_len, r.chunk_end
        media = r.media
        if media is None:
            parts.append(torch.arange(start, end).unsqueeze(0).expand(3, -1))
        else:
            parts.append(mrope_positions(media.spans, start, end))
            for image in media.images:
                lo = max(start, image.token_offset)
                hi = min(end, image.token_offset + image.token_count)
                if lo < hi:
                    images.append(ImageRows(
                        r.id, image.token_offset, image.token_count,
                        (image.grid[0], image.grid[1], image.grid[2]), _pixels(image),
                        lo - image.token_offset, hi - image.token_offset,
                        row + lo - start))
        row += end - start
    return StepMedia(torch.cat(parts, dim=1).contiguous(), images)
