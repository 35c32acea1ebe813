"""Image bytes for the media tests, made with Pillow (and one PNG header written by hand: a
20,000 x 20,000 bomb of a few dozen bytes that must be refused before decoding)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image


def encoded(fmt: str, size: tuple[int, int] = (32, 24), color: tuple[int, int, int] = (200, 30, 60),
            **save: object) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, fmt, **save)
    return out.getvalue()


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def two_frame_gif() -> bytes:
    """A GIF whose first frame is red and second blue."""
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return out.getvalue()


def png_bomb(width: int = 20_000, height: int = 20_000) -> bytes:
    """A PNG whose header claims width x height pixels, with one compressed row of data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\x00" + b"\x00" * 3 * width)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows)
            + chunk(b"IEND", b""))


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect/></svg>'
