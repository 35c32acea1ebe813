"""The lean HTTP/1.1 streaming client, against raw responses written byte by byte on a socket."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from pytgi_bench.transport import RawTransport, TransportError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


async def _with_server(handler: Handler, body: Callable[[RawTransport], Awaitable[None]]) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = RawTransport(f"http://127.0.0.1:{port}/base/")
    try:
        await body(transport)
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


def test_chunked_stream_with_extensions_and_trailers_then_keep_alive_reuse() -> None:
    requests: list[bytes] = []
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        for _ in range(2):
            requests.append(await _read_request(reader))
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                b"Content-Type: text/event-stream\r\n\r\n"
                b"7;ext=1\r\ndata:1\n\r\n9\r\ndata:22\n\n\r\n0\r\nX-Trailer: t\r\n\r\n"
            )
            await writer.drain()
        writer.close()

    async def body(transport: RawTransport) -> None:
        for _ in range(2):
            async with transport.post("/generate_stream", b'{"a":1}', {"x-k": "v"}) as r:
                assert r.status == 200
                assert [c async for c in r.chunks()] == [b"data:1\n", b"data:22\n\n"]

    asyncio.run(_with_server(handler, body))
    assert connections == 1
    assert requests[0].startswith(b"POST /base/generate_stream HTTP/1.1\r\n")
    assert b"\r\nx-k: v\r\n" in requests[0] and requests[0].endswith(b'\r\n\r\n{"a":1}')


def test_error_body_by_content_length_and_by_close() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b'HTTP/1.1 422 Unprocessable\r\ncontent-length: 13\r\n\r\n{"error":"x"}')
        await _read_request(reader)
        writer.write(b"HTTP/1.1 503 Unavailable\r\nconnection: close\r\n\r\ndown")
        writer.close()

    async def body(transport: RawTransport) -> None:
        async with transport.post("/g", b"{}", {}) as r:
            assert (r.status, await r.body()) == (422, b'{"error":"x"}')
        async with transport.post("/g", b"{}", {}) as r:
            assert (r.status, await r.body()) == (503, b"down")

    asyncio.run(_with_server(handler, body))


def test_a_stream_cut_mid_chunk_and_a_refused_connection_raise_transport_errors() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\ndata:")
        writer.close()

    async def body(transport: RawTransport) -> None:
        with pytest.raises(TransportError, match="closed the stream mid-response"):
            async with transport.post("/g", b"{}", {}) as r:
                async for _ in r.chunks():
                    pass

    asyncio.run(_with_server(handler, body))

    async def refused() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(TransportError, match="ConnectError"):
            async with RawTransport(f"http://127.0.0.1:{port}").post("/g", b"{}", {}):
                pass

    asyncio.run(refused())
    with pytest.raises(ValueError, match="http://"):
        RawTransport("https://example.com")


def test_a_kept_alive_connection_the_server_closed_is_retried_on_a_fresh_one() -> None:
    """llama.cpp's server (cpp-httplib) closes an idle kept-alive connection without a word:
    the request it never answered goes again on a new connection (a fresh one that closes
    unanswered still fails)."""
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        if connections == 1:
            # Kept alive as far as the client knows; closed as soon as the next request comes.
            await reader.readuntil(b"\r\n\r\n")
        writer.close()

    async def body(transport: RawTransport) -> None:
        for _ in range(2):
            async with transport.post("/g", b"{}", {}) as r:
                assert (r.status, await r.body()) == (200, b"ok")

    asyncio.run(_with_server(handler, body))
    assert connections == 2

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.close()

    async def fails(transport: RawTransport) -> None:
        with pytest.raises(TransportError, match="closed the connection"):
            async with transport.post("/g", b"{}", {}):
                pass

    asyncio.run(_with_server(silent, fails))
