"""ImageIntake: a request's images, from their references to decoded pictures — the count limit
first, then each image's bytes (a data: URI decoded, a URL fetched under the address policy,
concurrently) and its decoding, off the event loop in the router's worker pool."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

from pytgi_router.http.media.decode import DecodedImage, decode_image
from pytgi_router.http.media.errors import ImageError
from pytgi_router.http.media.fetch import ImageFetcher
from pytgi_router.http.media.limits import MediaLimits
from pytgi_router.http.media.source import ImageRef, data_uri_bytes

T = TypeVar("T")


class ImageIntake:
    def __init__(self, limits: MediaLimits, executor: Executor | None = None,
                 fetcher: ImageFetcher | None = None) -> None:
        self.limits = limits
        self.executor = executor
        self.fetcher = fetcher or ImageFetcher(limits)

    async def aclose(self) -> None:
        """Closes the fetcher's HTTP client (the router's shutdown)."""
        await self.fetcher.aclose()

    def check_count(self, refs: Sequence[ImageRef]) -> None:
        """Too many images are refused before any is read."""
        most = self.limits.max_images
        if len(refs) > most:
            raise ImageError(refs[most].where, f"a request carries at most {most} images "
                                               f"(--max-images-per-request); this one has "
                                               f"{len(refs)}")

    async def load(self, refs: Sequence[ImageRef], finish: Callable[[DecodedImage], T]
                   ) -> list[T]:
        """Every image read, then decoded and handed to `finish` in one worker call, in order;
        the first refusal cancels the others' work. Only `finish`'s result is kept: a decoded
        image is up to --max-image-pixels x 3 bytes (96 MiB by default), so a request's images
        are not all held decoded at once."""
        self.check_count(refs)
        return await _all([self._one(ref, finish) for ref in refs])

    async def _one(self, ref: ImageRef, finish: Callable[[DecodedImage], T]) -> T:
        data = await self.read(ref)
        return await self.offload(_decode_then, data, ref.where, self.limits.max_image_pixels,
                                  finish)

    async def read(self, ref: ImageRef) -> bytes:
        """The encoded image: a data: URI's bytes, or an http(s) URL fetched (when allowed)."""
        if ref.scheme == "data":
            return await self.offload(data_uri_bytes, ref, self.limits.max_image_bytes)
        if ref.scheme in ("http", "https"):
            return await self.fetcher.fetch(ref.where, ref.url)
        raise ImageError(ref.where, "an image is a data: URI or an http(s) URL, got "
                                    f"{_shown(ref.url)!r}")

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn` in the worker pool (decoding, processing: never on the event loop)."""
        if self.executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


def _decode_then(data: bytes, where: str, max_pixels: int,
                 finish: Callable[[DecodedImage], T]) -> T:
    return finish(decode_image(data, where, max_pixels))


async def _all(work: list[Awaitable[T]]) -> list[T]:
    """gather, cancelling the rest when one fails (gather alone would leave them running)."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _shown(url: str) -> str:
    return url if len(url) <= 64 else url[:61] + "..."
