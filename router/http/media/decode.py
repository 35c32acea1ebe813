"""Image bytes → an RGB picture, bounded before decoding: the format must be one served here and
the header's size inside --max-image-pixels before a single pixel is decoded (a 20,000 x 20,000
PNG of a few kilobytes would otherwise take 1.2 GB). Runs in a worker thread (intake.py)."""

from __future__ import annotations

import hashlib
import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from pytgi_router.http.media.errors import ImageError
from pytgi_router.http.media.source import SUPPORTED

# Pillow's names of the formats opened; any other (SVG is none of Pillow's) is refused.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True, slots=True)
class DecodedImage:
    """One decoded image: its RGB pixels, its original format, and the hash of what the model
    will see (size and RGB pixels): the prefix cache's key for it (same pixels, same KV)."""

    where: str
    image: Image.Image
    format: str
    content_hash: bytes

    @property
    def size(self) -> tuple[int, int]:
        """(width, height)."""
        w, h = self.image.size
        return w, h


def decode_image(data: bytes, where: str, max_pixels: int) -> DecodedImage:
    """Opens the header only, checks the format and the pixel count, then decodes the first
    frame (an animated GIF or WebP is its first frame) and converts it to RGB (transparency on
    white, as transformers' convert_rgb does)."""
    image = _open_bounded(data, where, max_pixels)
    width, height = image.size
    fmt = image.format or "?"
    try:
        image.seek(0)
        image.load()
        rgb = _to_rgb(image)
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as err:
        raise ImageError(where, f"the {fmt} data is truncated or corrupt ({err})") from None
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{width}x{height}".encode())
    digest.update(rgb.tobytes())
    return DecodedImage(where, rgb, fmt, digest.digest())


def _open_bounded(data: bytes, where: str, max_pixels: int) -> Image.Image:
    """The image with only its header read, refused unless its format is served and its
    width x height is inside `max_pixels`: nothing is decoded before the size is known."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as err:
        # Pillow's own guard (twice its MAX_IMAGE_PIXELS) fires while reading the header, before
        # ours can; its message holds the pixel count.
        found = re.search(r"\((\d+) pixels\)", str(err))
        count = found.group(1) if found else "too many"
        raise ImageError(where, f"{count} pixels, over the limit of {max_pixels} "
                                "(--max-image-pixels)") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ImageError(where, f"not a {SUPPORTED} image (or its header is corrupt)") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageError(where, f"an image of {width} x {height} pixels has nothing to show")
    if width * height > max_pixels:
        raise ImageError(where, f"{width} x {height} = {width * height} pixels, over the limit "
                                f"of {max_pixels} (--max-image-pixels)")
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' convert_rgb makes it: transparent pixels on white, not black, so
    the model sees what the processor it was trained with would give it."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
