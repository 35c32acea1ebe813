"""ImagePreparer: a request's images made into what the prompt and the shard need, for a model
the router can prepare images for (vision_model.py): each decoded (intake.py) and processed by
the checkpoint's image processor in one worker-pool call (resizing is the cost; only the
processed pixels are kept, not the decoded ones), the prompt's image placeholders repeated once
per image token (so the tokens count in the request's budget), and, after tokenization, each
image's wire message with the span of its tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
        """Each image's wire message, its token span found in the tokenized prompt."""
        where = [p.where for p in self.processed]
        counts = [p.tokens for p in self.processed]
        spans = vision.spans(where, input_ids, counts)
        return tuple(
            generate_pb2.Image(
                pixel_values=p.pixel_values.astype("<f4", copy=False).tobytes(),
                shape=list(p.pixel_values.shape), dtype="float32", grid=list(p.grid),
                token_offset=offset, token_count=count, content_hash=p.content_hash)
            for p, (offset, count) in zip(self.processed, spans, strict=True))


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
        text = (self.vision.markdown_text(found, counts) if found is not None
                else self.vision.chat_text(inputs, refs, counts))
        return PreparedImages(text, processed)
