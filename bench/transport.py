"""How the load generator POSTs a request and reads its streamed response.

Two transports with one interface. `RawTransport` (the default for http:// URLs) speaks just
enough HTTP/1.1 over asyncio streams for a streamed POST — status line, headers, chunked or
sized body, keep-alive — because the load generator shares the machine with the server under
test: every cycle it spends per SSE event is taken from the server, and a general-purpose client
(httpx: httpcore, h11, anyio, a pool scanned per call) costs several times more per event.
`HttpxTransport` covers everything else (https, proxies) with httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Protocol
from urllib.parse import urlsplit

import httpx

_READ_LIMIT = 1 << 20


class TransportError(Exception):
    """The connection failed or broke; the message names how."""


class StreamResponse(Protocol):
    status: int

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def body(self) -> bytes: ...


class StreamContext(Protocol):
    async def __aenter__(self) -> StreamResponse: ...

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class Transport(Protocol):
    def post(self, path: str, body: bytes, headers: dict[str, str]) -> StreamContext: ...

    async def aclose(self) -> None: ...


# -- httpx ---------------------------------------------------------------------------------------


class _HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code

    def chunks(self) -> AsyncIterator[bytes]:
        return self._response.aiter_bytes()

    async def body(self) -> bytes:
        return await self._response.aread()


class _HttpxStream:
    def __init__(self, http: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str]):
        self._context = http.stream("POST", url, content=body, headers=headers)

    async def __aenter__(self) -> StreamResponse:
        try:
            return _HttpxResponse(await self._context.__aenter__())
        except httpx.HTTPError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._context.__aexit__(kind, exc, tb)


class HttpxTransport:
    def __init__(self, http: httpx.AsyncClient, base_url: str) -> None:
        self._http = http
        self._base = base_url

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> StreamContext:
        return _HttpxStream(self._http, self._base + path, body, headers)

    async def aclose(self) -> None:
        return None


# -- raw HTTP/1.1 ---------------------------------------------------------------------------------

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class _RawResponse:
    def __init__(self, reader: asyncio.StreamReader, status: int, headers: dict[str, str]):
        self._reader = reader
        self.status = status
        self._chunked = "chunked" in headers.get("transfer-encoding", "")
        length = headers.get("content-length")
        self._length = int(length) if length is not None else None
        self.keep_alive = headers.get("connection", "").lower() != "close" and (
            self._chunked or self._length is not None
        )
        self.complete = False

    async def chunks(self) -> AsyncIterator[bytes]:
        reader = self._reader
        if self._chunked:
            while True:
                size = int((await reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                chunk = await reader.readexactly(size + 2)
                yield chunk[:-2]
        elif self._length is not None:
            left = self._length
            while left > 0:
                chunk = await reader.read(min(left, 65536))
                if not chunk:
                    raise asyncio.IncompleteReadError(b"", left)
                left -= len(chunk)
                yield chunk
        else:
            while chunk := await reader.read(65536):
                yield chunk
        self.complete = True

    async def body(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])


class _RawStream:
    def __init__(self, transport: RawTransport, path: str, body: bytes, headers: dict[str, str]):
        self._transport = transport
        self._request = transport.request_bytes(path, body, headers)
        self._connection: Connection | None = None
        self._response: _RawResponse | None = None

    async def __aenter__(self) -> StreamResponse:
        try:
            reader, reused, status_line = await self._send(fresh=False)
            if not status_line and reused:
                # A kept-alive connection the server closed while idle (cpp-httplib, llama.cpp's
                # server, after 5 s): nothing was processed, so the request goes again on a
                # fresh connection, as HTTP clients do.
                self._discard()
                reader, _, status_line = await self._send(fresh=True)
            if not status_line:
                raise TransportError("RemoteProtocolError: server closed the connection")
            status = int(status_line.split(None, 2)[1])
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            self._discard()
            raise TransportError(_describe(exc)) from exc
        self._response = _RawResponse(reader, status, headers)
        return self._response

    async def _send(self, fresh: bool) -> tuple[asyncio.StreamReader, bool, bytes]:
        """Writes the request on a pooled connection (a new one when `fresh` or none is idle):
        (its reader, whether it was pooled, the status line: empty when the server closed the
        connection instead of answering)."""
        (reader, writer), reused = await self._transport.connection(fresh)
        self._connection = reader, writer
        writer.write(self._request)
        return reader, reused, await reader.readline()

    def _discard(self) -> None:
        if self._connection is not None:
            self._connection[1].close()
            self._connection = None

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        response, connection = self._response, self._connection
        if connection is None:
            return
        if exc is None and response is not None and response.complete and response.keep_alive:
            self._transport.release(connection)
        else:
            self._discard()
        if isinstance(exc, (OSError, asyncio.IncompleteReadError)):
            raise TransportError(_describe(exc)) from exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "RemoteProtocolError: the server closed the stream mid-response"
    if isinstance(exc, ConnectionRefusedError):
        return f"ConnectError: {exc}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class RawTransport:
    """Plain-http HTTP/1.1 client for streamed POSTs, with a pool of kept-alive connections."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"RawTransport needs an http:// URL, got {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc
        self._idle: deque[Connection] = deque()

    def request_bytes(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [
            f"POST {self._prefix}{path} HTTP/1.1",
            f"host: {self._host_header}",
            f"content-length: {len(body)}",
            "accept: text/event-stream, application/json",
            *(f"{name}: {value}" for name, value in headers.items()),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def connection(self, fresh: bool = False) -> tuple[Connection, bool]:
        """A kept-alive connection from the pool (unless `fresh`) or a new one; and whether it
        was pooled."""
        while self._idle and not fresh:
            reader, writer = self._idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return (reader, writer), True
            writer.close()
        return await asyncio.open_connection(self._host, self._port, limit=_READ_LIMIT), False

    def release(self, connection: Connection) -> None:
        self._idle.append(connection)

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> StreamContext:
        return _RawStream(self, path, body, headers)

    async def aclose(self) -> None:
        while self._idle:
            _, writer = self._idle.pop()
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
