"""Noticing that a client went away, so that its requests leave the batch within one step."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

Receive = Callable[[], Any]


async def wait_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    """Reads ASGI messages (the body is already consumed) until `http.disconnect`."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


@contextlib.asynccontextmanager
async def watching_disconnect(
    receive: Receive, on_disconnect: Callable[[], None]
) -> AsyncIterator[None]:
    """While the block runs (a non-streaming generation), a disconnect calls `on_disconnect`."""
    watcher = asyncio.ensure_future(wait_disconnect(receive, on_disconnect))
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
