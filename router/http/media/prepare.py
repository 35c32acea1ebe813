"""ImagePreparer: a request's images made into what the prompt and the shard need, for a model
the router can prepare images for (vision_model.py): each decoded (intake.py) and processed by
the checkpoint's image processor in one worker-pool call (resizing is the cost; only the
processed pixels are kept, not the decoded ones), the prompt's image placeholders repeated once
per image token (so the tokens count in the request's budget), and, after tokenization, each
image's wire message with the span of its tokens."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pytgi_proto import generate_pb2
from pytgi_router.http.media.intake import ImageIntake
from pytgi_router.http.media.markdown import markdown_images
from pytgi_router.http.media.processed import ProcessedImage
from pytgi_router.http.media.source import ImageRef
from pytgi_router.http.media.vision_model import VisionModel


@dataclass(frozen=True, slots=True)
class PreparedImages:
    """The prompt text with its image tokens in place, and each image processed."""

    text: str
    processed: list[ProcessedImage]

    def wire(self, vision: VisionModel, input_ids: Sequence[int]) -> tuple[generate_pb2.Image, ...]:
        """Each image's wire message, its token span found in the tokenized prompt; an image of
        several runs (ProcessedImage.runs) is one message per run, with its row of pixels."""
        where = [p.where for p in self.processed]
        counts = [p.tokens for p in self.processed]
        spans = iter(vision.spans(where, input_ids, counts, [p.runs for p in self.processed]))
        out = []
        for p in self.processed:
            if not p.runs:
                out.append(_message(p.pixel_values, p.grid, next(spans), p.content_hash))
                continue
            for k, pixels in enumerate(p.pixel_values):
                out.append(_message(pixels, p.grid, next(spans), run_hash(p.content_hash, k)))
        return tuple(out)


def _message(pixels: np.ndarray, grid: tuple[int, ...], span: tuple[int, int],
             content_hash: bytes) -> generate_pb2.Image:
    offset, count = span
    return generate_pb2.Image(
        pixel_values=pixels.astype("<f4", copy=False).tobytes(), shape=list(pixels.shape),
        dtype="float32", grid=list(grid), token_offset=offset, token_count=count,
        content_hash=content_hash)


def run_hash(content_hash: bytes, run: int) -> bytes:
    """Run `run`'s own hash (the prefix cache keys a wire image's tokens by it, so two tiles of
    one image must differ), as long as the image's."""
    digest = hashlib.blake2b(content_hash + run.to_bytes(4, "little"),
                             digest_size=min(max(len(content_hash), 1), 64)).digest()
    return digest if content_hash else b""


class ImagePreparer:
    def __init__(self, vision: VisionModel, intake: ImageIntake) -> None:
        self.vision = vision
        self.intake = intake

    async def prepare(self, inputs: str, refs: Sequence[ImageRef]) -> PreparedImages | None:
        """A chat prompt's images (`refs`, placed by the template) or, without refs, the
        markdown images of `/generate` inputs; None when there are none."""
        found = None
        if not refs:
            found = markdown_images(inputs)
            refs = found.images
            if not refs:
                return None
        processed = await self.intake.load(refs, self.vision.processor.process)
        counts = [p.tokens for p in processed]
        bodies = [p.text for p in processed]
        text = (self.vision.markdown_text(found, counts, bodies) if found is not None
                else self.vision.chat_text(inputs, refs, counts, bodies))
        return PreparedImages(text, processed)
