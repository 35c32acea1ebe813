"""What one image costs the router, per size and format, on this machine's CPU (one thread):
decoding with its pixel hash (router/http/media/decode.py), a family's image processing at its
Hub checkpoints' defaults (Qwen2-VL's max_pixels, qwen2_vl.py; LLaVA-NeXT's 336-pixel tiles and
pinpoints, llava_next.py), the tokens it takes, and the bytes of its float32
pixel values on the wire (proto Image.pixel_values) beside its resized uint8 RGB. Behind two
decisions: both steps run in the router's worker pool, never on the event loop; and a Prefill
chunk carries only the images its tokens overlap (batch_wire.chunk_images).

    python -m pytgi_bench.experiments.image_intake [--repeats N] [--family llava_next]
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from PIL import Image

from pytgi_router.http.media.decode import DecodedImage, decode_image
from pytgi_router.http.media.llava_next import LlavaNextImageProcessor
from pytgi_router.http.media.processed import ImageProcessor
from pytgi_router.http.media.qwen2_vl import Qwen2VLImageProcessor

T = TypeVar("T")

CASES = [((640, 480), "JPEG"), ((1920, 1080), "JPEG"), ((1920, 1080), "PNG"),
         ((1920, 1080), "WEBP"), ((4000, 3000), "JPEG")]


def encoded(size: tuple[int, int], fmt: str, seed: int = 0) -> bytes:
    """A noise image (the worst case for every codec) of `size` in `fmt`."""
    w, h = size
    pixels = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def decode(data: bytes) -> DecodedImage:
    return decode_image(data, "x", 1 << 25)


def timed(fn: Callable[..., T], arg: object, repeats: int) -> tuple[T, float]:
    """(the last result of fn(arg), mean milliseconds per call)."""
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn(arg)
    return result, 1e3 * (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--family", choices=("qwen2_vl", "llava_next"), default="qwen2_vl")
    args = parser.parse_args()
    # Qwen2-VL's defaults: max_pixels = 28 * 28 * 1280; LLaVA-NeXT's: 336-pixel tiles of
    # 14-pixel patches, pinpoints up to 672 x 672 (llava-hf/llava-v1.6-*).
    processor: ImageProcessor = (LlavaNextImageProcessor() if args.family == "llava_next"
                                 else Qwen2VLImageProcessor())
    # Values per pixel the tower sees once (Qwen2-VL repeats each image over 2 temporal patches).
    repeats = 2 if args.family == "qwen2_vl" else 1
    print("| image | encoded MB | decode + hash ms | process ms | tokens | float32 MB | uint8 MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size, fmt in CASES:
        data = encoded(size, fmt)
        decoded, decode_ms = timed(decode, data, args.repeats)
        processed, process_ms = timed(processor.process, decoded, args.repeats)
        values = processed.pixel_values.size // repeats
        print(f"| {size[0]}x{size[1]} {fmt} | {len(data) / 1e6:.2f} | {decode_ms:.1f} | "
              f"{process_ms:.1f} | {processed.tokens} | {processed.pixel_values.nbytes / 1e6:.1f} "
              f"| {values / 1e6:.1f} |")


if __name__ == "__main__":
    main()
