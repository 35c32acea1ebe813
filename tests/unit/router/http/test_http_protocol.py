"""The router's HTTP protocol (uvicorn's httptools protocol with bounded heads), served by a real
uvicorn server on a real socket in this process, with short head and body timeouts."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from pytgi_router.http.http_protocol import (
    MAX_HEAD_BYTES,
    BoundedHttpToolsProtocol,
    bounded_protocol,
)

HEAD_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5
MAX_CONNECTIONS = 3


async def _app(scope: Any, receive: Any, send: Any) -> None:
    message = await receive()
    while message["type"] == "http.request" and message.get("more_body"):
        message = await receive()
    if message["type"] == "http.disconnect":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(BoundedHttpToolsProtocol, "head_timeout_s", HEAD_TIMEOUT_S)
    monkeypatch.setattr(BoundedHttpToolsProtocol, "body_timeout_s", BODY_TIMEOUT_S)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    config = uvicorn.Config(_app, http=bounded_protocol(MAX_CONNECTIONS), lifespan="off",
                            log_config=None, access_log=False)
    server = uvicorn.Server(config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server._serve([sock]),))
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)
    loop.close()


def _read_all(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_a_whole_request_is_served(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_all(conn).startswith(b"HTTP/1.1 200 OK\r\n")


@pytest.mark.parametrize("sent", [b"", b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: a"])
def test_a_head_that_never_completes_is_closed_after_the_timeout(port: int, sent: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        started = time.monotonic()
        conn.sendall(sent)
        assert _read_all(conn) == b""  # closed without an answer
        assert HEAD_TIMEOUT_S * 0.8 <= time.monotonic() - started < HEAD_TIMEOUT_S + 3


def test_a_trickled_head_cannot_extend_its_deadline(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\n")
        started = time.monotonic()
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while time.monotonic() - started < HEAD_TIMEOUT_S + 3:
                conn.sendall(b"X-A: b\r\n")
                time.sleep(0.05)


def test_a_second_request_after_keep_alive_gets_its_own_deadline(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b"0\r\n\r\n"):  # the chunked body's end
            first += conn.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 OK\r\n")
        time.sleep(HEAD_TIMEOUT_S * 1.5)  # idle keep-alive: not a head yet
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_all(conn).startswith(b"HTTP/1.1 200 OK\r\n")


def test_an_oversized_head_gets_431(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (2 * MAX_HEAD_BYTES))
        assert _read_all(conn).startswith(b"HTTP/1.1 431 ")


def test_a_whole_body_is_served(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                     b"Connection: close\r\n\r\nbody")
        assert _read_all(conn).startswith(b"HTTP/1.1 200 OK\r\n")


def test_a_body_that_never_completes_gets_408_after_the_timeout(port: int) -> None:
    """Headers on time, then a trickle: the body's deadline runs from the end of the head."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        started = time.monotonic()
        # One byte every 50 ms until the answer is there: trickling does not extend the deadline.
        while not select.select([conn], [], [], 0.05)[0]:
            assert time.monotonic() - started < BODY_TIMEOUT_S + 3
            conn.sendall(b"x")
        assert BODY_TIMEOUT_S * 0.8 <= time.monotonic() - started < BODY_TIMEOUT_S + 3
        answer = _read_all(conn)
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"error_type": "request_timeout"' in answer


def test_connections_past_the_limit_get_503_at_once(port: int) -> None:
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.05)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            answer = _read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503 ") and b'"error_type": "overloaded"' in answer
    finally:
        for conn in held:
            conn.close()
    _served_again(port)


def _served_again(port: int, timeout: float = 10.0) -> None:
    """A new connection is served once the server has seen the closes; when that is, is the
    server thread's business (a fixed 0.1 s wait failed on a loaded machine), so until then a
    503 is the only other answer allowed."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = _read_all(conn)
        if answer.startswith(b"HTTP/1.1 200 OK\r\n"):
            return
        assert answer.startswith(b"HTTP/1.1 503 ") and time.monotonic() < deadline, answer
        time.sleep(0.05)


def test_a_large_body_arriving_with_its_head_in_one_chunk_is_not_head(port: int) -> None:
    """A whole request in one read (head + 100 KB body) leaves the protocol in the head state
    again: its bytes must not count against the head limit (it got 431 depending on chunking)."""
    body = b"x" * 100_000
    request = (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
               % len(body)) + body
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(request)
            assert _read_all(conn).startswith(b"HTTP/1.1 200 OK\r\n")
