"""Decoding: the formats served, the first frame of an animation, and the refusals (bombs from
the header alone, truncated files, SVG), each naming the image."""

from __future__ import annotations

import time

import pytest

from pytgi_router.http.media.decode import decode_image
from pytgi_router.http.media.errors import ImageError
from pytgi_router.http.media.source import ImageRef, data_uri_bytes
from tests.unit.router.http.media.images import SVG, data_uri, encoded, png_bomb, two_frame_gif

MAX = 1 << 25


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_served_format_decodes_to_rgb(fmt: str) -> None:
    image = decode_image(encoded(fmt, (32, 24)), "messages[0].content[0]", MAX)
    assert image.image.mode == "RGB" and image.size == (32, 24)
    assert image.format == fmt
    r, g, b = image.image.getpixel((5, 5))  # type: ignore[misc]
    assert abs(r - 200) < 12 and abs(g - 30) < 12 and abs(b - 60) < 12


def test_a_gif_is_its_first_frame() -> None:
    image = decode_image(two_frame_gif(), "x", MAX)
    assert image.image.getpixel((3, 3)) == (255, 0, 0)


def test_the_hash_is_the_pixels_not_the_encoding() -> None:
    png = decode_image(encoded("PNG"), "a", MAX)
    webp = decode_image(encoded("WEBP", lossless=True), "b", MAX)
    other = decode_image(encoded("PNG", color=(0, 0, 0)), "c", MAX)
    assert png.content_hash == webp.content_hash != other.content_hash
    assert len(png.content_hash) == 16


def test_transparency_is_composited_on_white() -> None:
    from io import BytesIO

    from PIL import Image
    out = BytesIO()
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(out, "PNG")
    assert decode_image(out.getvalue(), "x", MAX).image.getpixel((0, 0)) == (255, 255, 255)


def test_a_bomb_is_refused_from_its_header_before_decoding() -> None:
    bomb = png_bomb()
    assert len(bomb) < 100_000
    start = time.perf_counter()
    with pytest.raises(ImageError, match=r"image `inputs image 0`: 400000000 pixels, over the "
                                         r"limit of 33554432 \(--max-image-pixels\)"):
        decode_image(bomb, "inputs image 0", MAX)
    assert time.perf_counter() - start < 1.0
    # Under Pillow's own guard, ours refuses from the header: decoding would take 192 MB.
    with pytest.raises(ImageError, match=r"8000 x 8000 = 64000000 pixels, over the limit"):
        decode_image(png_bomb(8000, 8000), "x", MAX)


def test_the_pixel_limit_is_ours_below_pillows() -> None:
    with pytest.raises(ImageError, match=r"100 x 60 = 6000 pixels, over the limit of 5000"):
        decode_image(encoded("PNG", (100, 60)), "x", 5000)
    assert decode_image(encoded("PNG", (100, 50)), "x", 5000).size == (100, 50)


def test_truncated_and_foreign_files_are_refused() -> None:
    png = encoded("PNG", (64, 64), color=(1, 2, 3))
    with pytest.raises(ImageError, match="truncated or corrupt"):
        decode_image(png[: len(png) // 2], "x", MAX)
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF image"):
        decode_image(SVG, "messages[1].content[2]", MAX)
    with pytest.raises(ImageError, match="not a PNG"):
        decode_image(encoded("BMP"), "x", MAX)
    with pytest.raises(ImageError, match="not a PNG"):
        decode_image(b"", "x", MAX)


def test_data_uris() -> None:
    png = encoded("PNG")
    assert data_uri_bytes(ImageRef("x", data_uri(png)), 10**6) == png
    assert data_uri_bytes(ImageRef("x", data_uri(png, "")), 10**6) == png
    with pytest.raises(ImageError, match="'image/svg\\+xml' is not an image format"):
        data_uri_bytes(ImageRef("x", data_uri(SVG, "image/svg+xml")), 10**6)
    with pytest.raises(ImageError, match="must be base64"):
        data_uri_bytes(ImageRef("x", "data:image/png,abc"), 10**6)
    with pytest.raises(ImageError, match="not valid base64"):
        data_uri_bytes(ImageRef("x", "data:image/png;base64,@@@@"), 10**6)
    with pytest.raises(ImageError, match=r"image `m`: about \d+ bytes, over the limit of 100"):
        data_uri_bytes(ImageRef("m", data_uri(b"x" * 1000)), 100)
