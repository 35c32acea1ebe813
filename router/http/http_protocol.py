"""Uvicorn's httptools protocol with bounds on a request's head (request line and headers).

httptools itself has no size limit, so without one a client could make the router buffer an
endless header. Past MAX_HEAD_BYTES the request gets a 431 in the error shape and the connection
closes; other connections are unaffected. (Bodies are bounded by --payload-limit in the app.)
Nor does uvicorn time a head out: a client trickling a header byte by byte (or connecting and
sending nothing) would hold its connection forever. A head must arrive whole within
`head_timeout_s` of the connection or of its first byte (hyper, under TGI, allows 30 s too);
idle keep-alive connections between requests are uvicorn's to close. Likewise a body must
arrive whole within `body_timeout_s` of its head (else a 408 in the error shape), and past
`max_connections` open connections a new one gets a 503 in the error shape at once: together they
keep slow clients from holding the router's sockets and request slots for ever.

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



def _error_response(status: bytes, message: str, error_type: str) -> bytes:
    """A complete HTTP/1.1 answer in TGI's error shape that closes the connection."""
    body = json.dumps({"error": message, "error_type": error_type}).encode()
    return (
        b"HTTP/1.1 " + status + b"\r\n"
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"connection: close\r\n\r\n" + body
    )


_HEAD_TOO_LARGE = _error_response(
    b"431 Request Header Fields Too Large",
    f"Request headers too large (limit {MAX_HEAD_BYTES} bytes)",
    "request_header_fields_too_large",
)
_BODY_TIMEOUT = _error_response(
    b"408 Request Timeout", "Request body not received in time", "request_timeout"
)
_TOO_MANY_CONNECTIONS = _error_response(
    b"503 Service Unavailable", "Too many open connections", "overloaded"
)


def bounded_protocol(max_connections: int | None) -> type[BoundedHttpToolsProtocol]:
    """The protocol class for a server allowing `max_connections` open connections (None: any)."""
    return type("BoundedHttpTools", (BoundedHttpToolsProtocol,), {"max_connections": max_connections})


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    head_timeout_s = 30.0
    body_timeout_s = 60.0
    max_connections: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        # Heads completed on this connection: a chunk during which one completed is not all head.
        self._heads = 0
        self._rejected = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self.max_connections
        if limit is not None and len(self.connections) > limit:
            self._reject(_TOO_MANY_CONNECTIONS)
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return  # lingering: dropped
        if self._in_head and self._head_timer is None:
            self._arm_head_timer()  # the first byte of a request after a keep-alive wait
        was_in_head, heads = self._in_head, self._heads
        super().data_received(data)
        # Counted only when the whole chunk was head: a chunk that completes the headers may
        # carry any amount of body behind them (a whole request, even: in the head again after).
        if was_in_head and self._heads == heads and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._reject(_HEAD_TOO_LARGE)

    def _reject(self, response: bytes) -> None:
        self._rejected = True
        self._cancel_head_timer()
        self._cancel_body_timer()
        transport = self.transport
        transport.write(response)
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self._rejected:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A pipelined head behind a response still streaming: its clock starts afterwards.
            self._arm_head_timer()
            return
        self.transport.close()

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        """The app waits in `receive()` for the rest of the body: answer for it when it has
        not started answering, then close (the app then reads a disconnect)."""
        self._body_timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self._reject(_BODY_TIMEOUT)
        else:
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._heads += 1
        self._cancel_head_timer()
        self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._cancel_body_timer()
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0
