"""ImagePreparer: a request's images made into what the prompt and the shard need, for a model
the router can prepare images for (vision_model.py): decoded (intake.py), processed by the
checkpoint's image processor (in the worker pool: resizing is the cost), the prompt's image
placeholders repeated once per image token (so the tokens count in the request's budget), and,
after tokenization, each image's wire message with the span of its tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pytgi_proto import generate_pb2
from pytgi_router.http.media.decode import DecodedImage
from pytgi_router.http.media.intake import ImageIntake
from pytgi_router.http.media.markdown import markdown_images
from pytgi_router.http.media.qwen2_vl import ProcessedImage
from pytgi_router.http.media.source import ImageRef
from pytgi_router.http.media.vision_model import VisionModel


@dataclass(frozen=True, slots=True)
class PreparedImages:
    """The prompt text with its image tokens in place, and each image processed."""

    text: str
    decoded: list[DecodedImage]
    processed: list[ProcessedImage]

    def wire(self, vision: VisionModel, input_ids: Sequence[int]) -> tuple[generate_pb2.Image, ...]:
        """Each image's wire message, its token span found in the tokenized prompt."""
        where = [d.where for d in self.decoded]
        counts = [p.tokens for p in self.processed]
        spans = vision.spans(where, input_ids, counts)
        return tuple(
            generate_pb2.Image(
                pixel_values=p.pixel_values.astype("<f4", copy=False).tobytes(),
                shape=list(p.pixel_values.shape), dtype="float32", grid=list(p.grid),
                token_offset=offset, token_count=count, content_hash=d.content_hash)
            for d, p, (offset, count) in zip(self.decoded, self.processed, spans, strict=True))


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
        self.intake.check_count(refs)
        decoded = await self.intake.load(refs)
        processed = await self.intake.offload(self._process, decoded)
        counts = [p.tokens for p in processed]
        text = (self.vision.markdown_text(found, counts) if found is not None
                else self.vision.chat_text(inputs, refs, counts))
        return PreparedImages(text, decoded, processed)

    def _process(self, decoded: list[DecodedImage]) -> list[ProcessedImage]:
        return [self.vision.processor.process(d) for d in decoded]
