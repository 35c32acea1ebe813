"""Server-sent events: an ASGI response writing ready-made `data: ...\\n\\n` chunks.

Hot path: one ASGI send per event, flushed at once (no buffering: `X-Accel-Buffering: no` asks
proxies to do the same). The body chunks skip the middleware chain: `RawSend` (outermost) puts the
server's own send in the scope, and once the response has started through the chain (CORS adds its
headers there), body chunks go straight to it; the middlewares only act on the start message.
A companion task watches the connection: a client disconnect calls `on_disconnect` (which cancels
the requests, ending the event iterator), and 15 s without an event sends a keep-alive comment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.responses import Response

log = logging.getLogger("pytgi.router")

KEEP_ALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"
RAW_SEND = "pytgi.raw_send"


class RawSend:
    """Outermost ASGI wrapper: keeps the server's send in the scope for EventStreamResponse."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        scope[RAW_SEND] = send
        await self.app(scope, receive, send)


class EventStreamResponse(Response):
    """A Starlette Response in type only: it writes itself (see __call__)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: Mapping[str, str] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        keep_alive_s: float = 15.0,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.events = events
        self.on_disconnect = on_disconnect
        self.keep_alive_s = keep_alive_s
        raw = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self.raw_headers = raw
        self._last_sent = 0.0
        # Held while a keep-alive is written (rare); the pump only waits on it when it is held,
        # and the watcher writes none while an event's send is in progress.
        self._lock = asyncio.Lock()
        self._in_send = False
        self.disconnected = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        send = scope.get(RAW_SEND, send)
        self._last_sent = loop.time()
        watcher = asyncio.ensure_future(self._watch(receive, send))
        try:
            await self._pump(send, loop)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _pump(self, send: Any, loop: asyncio.AbstractEventLoop) -> None:
        lock = self._lock
        try:
            async for chunk in self.events:
                if self.disconnected:
                    continue  # drain silently: the requests are being cancelled
                if lock.locked():
                    async with lock:
                        pass  # a keep-alive is being written: wait for it to finish
                self._in_send = True
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._in_send = False
                self._last_sent = loop.time()
        except Exception:
            # The response has started: the only thing left to do is to close it.
            log.exception("event stream failed after it started")
        if not self.disconnected:
            async with lock:
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch(self, receive: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()
        while True:
            idle = loop.time() - self._last_sent
            try:
                message = await asyncio.wait_for(receive(), max(self.keep_alive_s - idle, 0.01))
            except asyncio.TimeoutError:
                if not self._in_send and loop.time() - self._last_sent >= self.keep_alive_s:
                    async with self._lock:
                        await send(
                            {"type": "http.response.body", "body": KEEP_ALIVE, "more_body": True}
                        )
                    self._last_sent = loop.time()
                continue
            if message["type"] == "http.disconnect":
                self.disconnected = True
                if self.on_disconnect is not None:
                    self.on_disconnect()
                return
