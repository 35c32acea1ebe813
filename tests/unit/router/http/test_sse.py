"""EventStreamResponse over the ASGI protocol: one flushed send per event, keep-alive comments
when idle, and a client disconnect that cancels the producer and stops the writes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from pytgi_router.http.sse import KEEP_ALIVE, RAW_SEND, EventStreamResponse, RawSend


class Client:
    """The server side of one HTTP connection, as the ASGI app sees it."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def disconnect(self) -> None:
        self.inbox.put_nowait({"type": "http.disconnect"})

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def test_headers_and_one_send_per_event() -> None:
    async def events() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    async def main() -> Client:
        client = Client()
        response = EventStreamResponse(events(), {"x-compute-type": "cpu"})
        await response({"type": "http"}, client.receive, client.send)
        return client

    client = asyncio.run(main())
    start = client.sent[0]
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream"
    assert headers[b"x-accel-buffering"] == b"no" and headers[b"x-compute-type"] == b"cpu"
    assert client.bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert client.sent[-1]["more_body"] is False


def test_keep_alive_comment_when_idle() -> None:
    """An idle producer gets a keep-alive comment every keep_alive_s, none sooner. The producer
    waits for three comments rather than sleeping a fixed time, so timers that a loaded machine
    wakes late change when they come, not whether."""

    async def main() -> tuple[list[bytes], list[float]]:
        loop = asyncio.get_running_loop()
        client = Client()
        sent_at: list[float] = []
        three = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            await client.send(message)
            sent_at.append(loop.time())
            if client.bodies.count(KEEP_ALIVE) == 3:
                three.set()

        async def slow() -> AsyncIterator[bytes]:
            yield b"data: a\n\n"
            await asyncio.wait_for(three.wait(), 30)
            yield b"data: b\n\n"

        await EventStreamResponse(slow(), keep_alive_s=0.1)({}, client.receive, send)
        return client.bodies, sent_at

    bodies, sent_at = asyncio.run(main())
    assert bodies == [b"data: a\n\n", KEEP_ALIVE, KEEP_ALIVE, KEEP_ALIVE, b"data: b\n\n", b""]
    # sent_at[0] is the start message, [1] "a", [2:5] the comments: each a full period after
    # the write before it (the loop's clock: its timers never fire early on it).
    gaps = [later - earlier for earlier, later in zip(sent_at[1:4], sent_at[2:5], strict=True)]
    assert all(gap >= 0.1 - 1e-3 for gap in gaps), gaps


def test_disconnect_cancels_the_producer_and_stops_writing() -> None:
    async def main() -> tuple[Client, bool, int]:
        stop = asyncio.Event()
        produced = 0

        async def endless() -> AsyncIterator[bytes]:
            nonlocal produced
            while not stop.is_set():
                produced += 1
                yield b"data: x\n\n"
                await asyncio.sleep(0.01)

        client = Client()
        response = EventStreamResponse(endless(), on_disconnect=stop.set)
        task = asyncio.ensure_future(response({}, client.receive, client.send))
        await asyncio.sleep(0.05)
        client.disconnect()
        await asyncio.wait_for(task, 2)
        return client, response.disconnected, produced

    client, disconnected, produced = asyncio.run(main())
    assert disconnected
    # Nothing is written after the disconnect, not even the closing empty body.
    assert client.bodies and all(b == b"data: x\n\n" for b in client.bodies)
    assert len(client.bodies) <= produced


def test_a_failing_producer_still_closes_the_response() -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        raise RuntimeError("bug")

    async def main() -> Client:
        client = Client()
        await EventStreamResponse(broken())({}, client.receive, client.send)
        return client

    client = asyncio.run(main())
    assert client.bodies == [b"data: 1\n\n", b""]


def test_body_chunks_skip_the_middleware_chain_once_started() -> None:
    """The start message goes through the chain (CORS adds headers there); the body goes to the
    server's own send that RawSend keeps in the scope."""

    async def events() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    async def main() -> tuple[Client, list[str]]:
        server = Client()
        chain: list[str] = []

        async def middleware_send(message: dict[str, Any]) -> None:
            chain.append(message["type"])
            await server.send(message)

        async def app(scope: Any, receive: Any, send: Any) -> None:
            assert scope[RAW_SEND] == server.send
            await EventStreamResponse(events())(scope, receive, middleware_send)

        await RawSend(app)({"type": "http"}, server.receive, server.send)
        return server, chain

    server, chain = asyncio.run(main())
    assert chain == ["http.response.start"]
    assert server.bodies == [b"data: 1\n\n", b""]


def test_no_keep_alive_lands_inside_a_blocked_send() -> None:
    """A send held up by a slow reader is activity, not idleness: no comment is written
    concurrently with it."""

    async def two() -> AsyncIterator[bytes]:
        yield b"data: a\n\n"
        yield b"data: b\n\n"

    async def main() -> list[bytes]:
        client = Client()
        concurrent: list[bytes] = []
        busy = False

        async def slow_send(message: dict[str, Any]) -> None:
            nonlocal busy
            if busy:
                concurrent.append(message.get("body", b""))
            busy = True
            if message.get("body") == b"data: a\n\n":
                await asyncio.sleep(0.35)  # flow control: the client reads slowly
            busy = False
            await client.send(message)

        await EventStreamResponse(two(), keep_alive_s=0.1)({}, client.receive, slow_send)
        return concurrent

    assert asyncio.run(main()) == []
