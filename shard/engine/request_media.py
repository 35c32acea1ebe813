"""A request's images as the shard runs them (a vision-language model's; issue 28): their token
spans, checked against the prompt and the model's ImageLayout, and each prefill step's
StepMedia (the image rows it computes; for M-RoPE models also the 3-D positions of the chunk's
tokens and the request's rope delta).

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
from pytgi_shard.attention.metadata import noncausal_spans
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.models.media_inputs import BidirectionalLayout, ImageLayout, ImageRows, StepMedia
from pytgi_shard.models.qwen2_vl.mrope import ImageSpan, merged_grid, mrope_positions, rope_delta


@dataclass(frozen=True, slots=True)
class RequestMedia:
    images: tuple[generate_pb2.Image, ...]
    # M-RoPE's image spans (empty for 1-D position models).
    spans: tuple[ImageSpan, ...]
    # Decode position = sequence index + rope_delta (M-RoPE's text after the last image; 0
    # for 1-D position models).
    rope_delta: int
    mrope: bool = False
    # Prompt spans [lo, hi) attended bidirectionally (BidirectionalLayout); () when causal.
    noncausal: tuple[tuple[int, int], ...] = ()


def request_media(pb: generate_pb2.Request, layout: ImageLayout | None) -> RequestMedia | None:
    """`pb`'s images, checked (InvalidRequest); None without images. `layout`: the model's
    (Model.image_layout), None when it takes no images. A text-only request to a model whose
    prompt is bidirectional (PaliGemma's prefix) gets a RequestMedia with no images."""
    if not pb.images:
        prefix = _noncausal(layout, (), len(pb.input_ids))
        return RequestMedia((), (), 0, noncausal=prefix) if prefix else None
    who = f"request {pb.id}"
    if layout is None:
        raise InvalidRequest(f"{who}: {len(pb.images)} images, and this model has no vision "
                             "tower: this shard serves text only")
    images = tuple(sorted(pb.images, key=lambda i: i.token_offset))
    prompt = len(pb.input_ids)
    end = 0
    for k, image in enumerate(images):
        _check(who, k, image, layout, prompt)
        if image.token_offset < end:
            raise InvalidRequest(f"{who}: image {k}'s tokens overlap the previous image's")
        end = image.token_offset + image.token_count
    merge = layout.mrope_merge
    noncausal = _noncausal(layout, tuple((i.token_offset, i.token_count) for i in images), prompt)
    if not merge:
        return RequestMedia(images, (), 0, noncausal=noncausal)
    spans = tuple(ImageSpan(i.token_offset, i.token_count, merged_grid(i.grid, merge))
                  for i in images)
    return RequestMedia(images, spans, rope_delta(spans, prompt), mrope=True,
                        noncausal=noncausal)


def _noncausal(layout: ImageLayout | None, images: tuple[tuple[int, int], ...], prompt: int
               ) -> tuple[tuple[int, int], ...]:
    if isinstance(layout, BidirectionalLayout):
        return layout.noncausal_spans(images, prompt)
    return ()


def _check(who: str, k: int, image: generate_pb2.Image, layout: ImageLayout, prompt: int
           ) -> None:
    if image.token_count <= 0:
        raise InvalidRequest(f"{who}: image {k} has no tokens")
    if image.token_offset + image.token_count > prompt:
        raise InvalidRequest(f"{who}: image {k}'s tokens end past the prompt ({prompt} tokens)")
    shape = None
    if image.pixel_values:
        count = 1
        for d in image.shape:
            count *= d
        if image.dtype != "float32" or not image.shape or len(image.pixel_values) != 4 * count:
            raise InvalidRequest(
                f"{who}: image {k}'s pixel values ({image.dtype}, shape {list(image.shape)}, "
                f"{len(image.pixel_values)} bytes) are not float32 of that shape")
        shape = tuple(image.shape)
    why = layout.refusal(tuple(image.grid), shape, image.token_count)
    if why is not None:
        raise InvalidRequest(f"{who}: image {k}: {why}")


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
    request has images (or bidirectional spans). Its 3-D positions only when the model is
    M-RoPE; its token spans only when some chunk computes a bidirectional span."""
    if not any(r.media is not None for r in requests):
        return None
    mrope = any(r.media is not None and r.media.mrope for r in requests)
    parts = [positions[:n_decode].cpu().unsqueeze(0).expand(3, -1)]
    images: list[ImageRows] = []
    row = n_decode
    for r in requests:
        start, end = r.cache_len, r.chunk_end
        media = r.media
        if media is None:
            parts.append(torch.arange(start, end).unsqueeze(0).expand(3, -1))
        else:
            if mrope:
                parts.append(mrope_positions(media.spans, start, end))
            for image in media.images:
                lo = max(start, image.token_offset)
                hi = min(end, image.token_offset + image.token_count)
                if lo < hi:
                    images.append(ImageRows(
                        r.id, image.token_offset, image.token_count,
                        tuple(image.grid), _pixels(image),
                        lo - image.token_offset, hi - image.token_offset,
                        row + lo - start))
        row += end - start
    return StepMedia(torch.cat(parts, dim=1).contiguous() if mrope else None, images,
                     _step_spans(requests, n_decode, positions.device))


def _step_spans(requests: Sequence[MediaRow], n_decode: int, device: torch.device
                ) -> torch.Tensor | None:
    """AttentionMetadata.spans of the forward: decode rows in none, each chunk's tokens in
    their request's spans (a span the chunk splits is refused: InvalidRequest)."""
    if not any(r.media is not None and r.media.noncausal for r in requests):
        return None
    new = [1] * n_decode + [r.chunk_end - r.cache_len for r in requests]
    cached = [0] * n_decode + [r.cache_len for r in requests]
    spans = [()] * n_decode + [r.media.noncausal if r.media is not None else ()
                                for r in requests]
    try:
        return noncausal_spans(new, cached, spans, device)
    except ValueError as err:
        raise InvalidRequest(f"a chunk splits a bidirectional span: {err}") from None
