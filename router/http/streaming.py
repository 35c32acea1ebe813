"""Turning one admitted submission into SSE bytes with a route's encoder, and merging several
submissions' bytes.

Hot path: one loop iteration per generated token; the encoders splice pre-rendered strings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from pytgi_router.core.errors import InferError
from pytgi_router.core.request_stream import End, Prefill, Token
from pytgi_router.http.generate_flow import StreamGroup, Submission
from pytgi_router.http.state import AppState

log = logging.getLogger("pytgi.router")


class Encoder(Protocol):
    def token(self, index: int, ev: Token) -> bytes: ...

    def end(self, index: int, ev: End) -> bytes: ...

    def error(self, err: InferError) -> bytes: ...


async def encode_generation(
    state: AppState, submission: Submission, group: StreamGroup, enc: Encoder
) -> AsyncIterator[bytes]:
    """Events of `generation` as SSE bytes; failures after the start become the encoder's error
    event."""
    state.enter()
    index = 0
    try:
        async for ev in submission.stream:
            kind = type(ev)
            if kind is Prefill:
                continue
            index += 1
            if kind is End:
                submission.succeed(ev)  # type: ignore[arg-type]
                yield enc.end(index, ev)  # type: ignore[arg-type]
                return
            yield enc.token(index, ev)  # type: ignore[arg-type]
        err = submission.incomplete(group, streaming=True)
        if isinstance(err, InferError):
            yield enc.error(err)
    except InferError as err:
        submission.fail(err)
        yield enc.error(err)
    finally:
        if not submission.done:
            submission.stream.cancel()
            submission.dropped()
        state.leave()


async def merge(streams: list[AsyncIterator[bytes]], trailer: bytes = b"") -> AsyncIterator[bytes]:
    """Interleaves several event streams as their events come (completions with many prompts)."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield chunk
        if trailer:
            yield trailer
        return
    # Bounded: a client that does not read must leave the events in the requests' own bounded
    # streams (core/request_stream.py), not pile them up here.
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=len(streams))

    async def pump(it: AsyncIterator[bytes]) -> None:
        try:
            async for chunk in it:
                await queue.put(chunk)
        except Exception:
            log.exception("an event stream failed while merged")
        # Not on cancellation (the merge is over): a full queue would block the cancelled pump.
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield item
        if trailer:
            yield trailer
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
