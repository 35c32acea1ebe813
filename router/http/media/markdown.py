"""TGI's images inside `/generate` text: markdown `![](url)` (TGI's validation finds them with
the same pattern, `!\\[\\]\\([^\\)]*\\)`). For a vision-language model each one is an image; a
text model reads them as the text they are, as TGI does."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pytgi_router.http.media.source import ImageRef

MARKDOWN_IMAGE = re.compile(r"!\[\]\(([^\)]*)\)")


@dataclass(frozen=True, slots=True)
class MarkdownImages:
    """`inputs` cut at its images: len(texts) == len(images) + 1, text, image, text, …"""

    texts: list[str]
    images: list[ImageRef]


def markdown_images(inputs: str, field: str = "inputs") -> MarkdownImages:
    """The text pieces and the images of `inputs`, each image named `inputs image <i>`."""
    texts, images, start = [], [], 0
    for i, match in enumerate(MARKDOWN_IMAGE.finditer(inputs)):
        texts.append(inputs[start:match.start()])
        images.append(ImageRef(f"{field} image {i}", match.group(1).strip()))
        start = match.end()
    texts.append(inputs[start:])
    return MarkdownImages(texts, images)


def has_markdown_image(inputs: str) -> bool:
    return MARKDOWN_IMAGE.search(inputs) is not None
