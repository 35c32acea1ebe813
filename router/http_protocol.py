"""Uvicorn's httptools protocol with a bound on a request's head (request line and headers).

httptools itself has no such limit, so without one a client could make the router buffer an
endless header. Past MAX_HEAD_BYTES the request gets a 431 in the error shape and the connection
closes; other connections are unaffected. (Bodies are bounded by --payload-limit in the app.)

The close lingers: the answer is followed by a FIN and what the client still sends is read and
dropped for a moment, because closing a socket with unread input sends a reset, and a reset can
destroy the answer before the client reads it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# nginx's default allowance is 32 KiB, hyper's buffer (TGI) about 400 KiB.
MAX_HEAD_BYTES = 64 * 1024
LINGER_S = 2.0

_BODY = json.dumps({
    "error": f"Request headers too large (limit {MAX_HEAD_BYTES} bytes)",
    "error_type": "request_header_fields_too_large",
}).encode()
_RESPONSE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: application/json\r\n"
    b"content-length: " + str(len(_BODY)).encode() + b"\r\n"
    b"connection: close\r\n\r\n" + _BODY
)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._rejected = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head, self._head_bytes = True, 0

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return  # lingering: dropped
        was_in_head = self._in_head
        super().data_received(data)
        # Counted only when the whole chunk was head: a chunk that completes the headers may
        # carry any amount of body behind them.
        if was_in_head and self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._reject()

    def _reject(self) -> None:
        self._rejected = True
        transport = self.transport
        transport.write(_RESPONSE)
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0
