"""A Generation with `error` (the shard failed that request: its grammar's matcher failed) ends
the request with a generation error (TGI's 424, the shard's reason), none of that step's tokens
sent; its blocks go back and the other requests of the batch go on."""

from __future__ import annotations

import asyncio

from pytgi_router.core.errors import GenerationError
from pytgi_router.core.request_stream import End, Event, RequestStream, Token
from tests.unit.router.core.test_running_batch import cached, drain, generation, make_running

REASON = "the grammar's matcher failed: lexer error: too many expressions constructed"


def read_until_error(stream: RequestStream) -> tuple[list[Event], BaseException | None]:
    events: list[Event] = []

    async def read() -> None:
        async for event in stream:
            events.append(event)

    try:
        asyncio.run(read())
    except Exception as error:  # noqa: BLE001 - returned to the test
        return events, error
    return events, None


def test_a_failed_constrained_request_ends_with_the_shards_error() -> None:
    running, entries, released = make_running(3)
    entries[1].request.sampling.grammar_type = 1
    kept = running.apply_step([generation(0, 1), generation(1, 2), generation(2, 3)],
                              cached(0, 1, 2))  # fmt: skip
    assert kept is None
    failing = generation(1, 1)  # the EOS an error state's mask forces
    failing.error = REASON
    kept = running.apply_step([generation(0, 4), failing, generation(2, 5, final="done")],
                              cached(0))  # fmt: skip
    assert kept is None and released == [1, 2]  # the shard dropped both itself
    assert 1 not in running.cache and running.cache.used_count == 1
    events, error = read_until_error(entries[1].stream)
    assert [type(e) for e in events] == [Token]
    assert isinstance(error, GenerationError)
    assert (error.status_code, error.error_type) == (424, "generation")
    assert error.message == f"Request failed during generation: {REASON}"
    assert entries[1].tokens[-1] == 2  # the failing step's token was not appended
    assert isinstance(drain(entries[2].stream)[-1], End)
