"""RequestStream: ordered delivery, End closes, errors after pending events, idempotent cancel."""

from __future__ import annotations

import asyncio

import pytest

from pytgi_router.core.errors import GenerationError, IncompleteGenerationError
from pytgi_router.core.request_stream import End, RequestStream, Token, TokenInfo


def token(i: int) -> Token:
    return Token(TokenInfo(i, f"t{i}", -0.5, False))


def end(i: int) -> End:
    return End(TokenInfo(i, f"t{i}", -0.5, False), generated_text="done")


async def collect(stream: RequestStream) -> list[int]:
    return [event.token.id async for event in stream]  # type: ignore[union-attr]


def test_events_arrive_in_order_and_end_closes() -> None:
    async def main() -> None:
        stream = RequestStream()
        reader = asyncio.create_task(collect(stream))
        await asyncio.sleep(0)
        stream.push(token(1))
        stream.push(token(2))
        await asyncio.sleep(0)
        stream.push(end(3))
        stream.push(token(4))  # after End: ignored
        assert await reader == [1, 2, 3]
        assert stream.closed

    asyncio.run(main())


def test_failure_is_raised_after_pending_events() -> None:
    async def main() -> None:
        stream = RequestStream()
        stream.push(token(1))
        stream.fail(GenerationError("boom"))
        stream.fail(GenerationError("second"))
        assert (await stream.__anext__()).token.id == 1  # type: ignore[union-attr]
        with pytest.raises(GenerationError, match="boom"):
            await stream.__anext__()

    asyncio.run(main())


def test_close_incomplete_raises_incomplete_generation() -> None:
    async def main() -> None:
        stream = RequestStream()
        stream.close_incomplete()
        with pytest.raises(IncompleteGenerationError):
            await collect(stream)

    asyncio.run(main())


def test_cancel_is_idempotent_wakes_the_reader_and_calls_back_once() -> None:
    calls: list[RequestStream] = []

    async def main() -> None:
        stream = RequestStream(calls.append)
        reader = asyncio.create_task(collect(stream))
        await asyncio.sleep(0)
        stream.cancel()
        stream.cancel()
        assert await asyncio.wait_for(reader, 1) == []
        assert stream.cancelled
        assert calls == [stream]

    asyncio.run(main())


def test_detached_stream_does_not_call_back() -> None:
    calls: list[RequestStream] = []
    stream = RequestStream(calls.append)
    stream.detach()
    stream.cancel()
    assert calls == [] and stream.cancelled


def test_a_reader_that_falls_too_far_behind_cancels_its_request() -> None:
    """Unread events are bounded: past the bound they are dropped, the request is cancelled
    (the batching task frees its slot) and the reader gets a clear error when it comes back."""
    async def main() -> None:
        cancelled: list[RequestStream] = []
        stream = RequestStream(cancelled.append, max_pending=8)
        for i in range(8):
            stream.push(token(i))
        assert not cancelled and len(stream._events) == 8
        stream.push(token(8))
        assert cancelled == [stream] and stream.cancelled and stream.closed
        assert not stream._events  # the pending events' memory is given back
        for i in range(100):
            stream.push(token(9 + i))  # later steps of the same batch: ignored
        assert not stream._events and cancelled == [stream]
        with pytest.raises(GenerationError, match="fell 8 events behind"):
            await collect(stream)

    asyncio.run(main())


def test_a_reader_that_keeps_up_is_never_cut_off() -> None:
    async def main() -> None:
        stream = RequestStream(max_pending=2)
        reader = asyncio.create_task(collect(stream))
        for i in range(50):
            stream.push(token(i))
            await asyncio.sleep(0)
        stream.push(end(50))
        assert await reader == list(range(51))

    asyncio.run(main())
