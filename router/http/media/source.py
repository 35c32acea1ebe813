"""ImageRef (an image as a request names it) and the bytes of a `data:` URI."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from pytgi_router.http.media.errors import ImageError

# The formats decode.py opens; a data: URI may declare one of them (or image/jpg, or nothing).
IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
SUPPORTED = "PNG, JPEG, WebP or GIF"


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image of a request: where the body put it (for error messages) and its URL as sent
    (a `data:` URI or an http(s) URL)."""

    where: str
    url: str

    @property
    def scheme(self) -> str:
        return self.url.split(":", 1)[0].strip().lower() if ":" in self.url else ""


def data_uri_bytes(ref: ImageRef, max_bytes: int) -> bytes:
    """The image bytes of a base64 `data:` URI; the size is checked from the text's length
    before anything is decoded, so a huge URI costs no second copy."""
    head, sep, payload = ref.url.partition(",")
    if not sep:
        raise ImageError(ref.where, "a data: URI needs a comma before its data")
    params = [p.strip().lower() for p in head[len("data:"):].split(";")]
    media, encoding = params[0], params[1:]
    if "base64" not in encoding:
        raise ImageError(ref.where, "a data: URI image must be base64 (data:image/png;base64,…)")
    if media and media not in IMAGE_MEDIA_TYPES:
        raise ImageError(ref.where, f"media type {media!r} is not an image format served here "
                                    f"({SUPPORTED})")
    payload = "".join(payload.split())  # MIME line breaks
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise ImageError(ref.where, f"about {len(payload) // 4 * 3} bytes, over the limit of "
                                    f"{max_bytes} bytes per image (--max-image-bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(ref.where, "the data: URI's data is not valid base64") from None
    if len(data) > max_bytes:
        raise ImageError(ref.where, f"{len(data)} bytes, over the limit of {max_bytes} bytes "
                                    "per image (--max-image-bytes)")
    if not data:
        raise ImageError(ref.where, "the data: URI holds no data")
    return data
