"""merge(): several event streams interleaved, with bounded buffering between them and the
client (a client that does not read must not let the merged events pile up in the router)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pytgi_router.http.streaming import merge


def test_merge_reads_ahead_only_a_bounded_number_of_events() -> None:
    async def main() -> None:
        produced = [0, 0]

        async def endless(i: int) -> AsyncIterator[bytes]:
            while True:
                produced[i] += 1
                yield b"%d" % i
                await asyncio.sleep(0)

        merged = merge([endless(0), endless(1)])
        for _ in range(3):
            await anext(merged)
        for _ in range(100):
            await asyncio.sleep(0)  # the client stops reading; the pumps may run freely
        # Read so far + the bounded queue + one event held by each blocked pump.
        assert sum(produced) <= 3 + 2 + 2, produced
        await merged.aclose()  # the blocked pumps are cancelled: the merge ends

    asyncio.run(asyncio.wait_for(main(), 10))


def test_merge_delivers_everything_and_the_trailer() -> None:
    async def main() -> None:
        async def finite(i: int) -> AsyncIterator[bytes]:
            for j in range(20):
                yield b"%d:%d" % (i, j)
                await asyncio.sleep(0)

        out = [chunk async for chunk in merge([finite(0), finite(1), finite(2)], b"END")]
        assert out[-1] == b"END" and len(out) == 61
        for i in range(3):
            assert [c for c in out if c.startswith(b"%d:" % i)] == [b"%d:%d" % (i, j) for j in range(20)]

    asyncio.run(asyncio.wait_for(main(), 10))
