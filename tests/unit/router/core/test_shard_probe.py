"""ShardProbe's cache: shared within its time to live, never past a failure seen since."""

from __future__ import annotations

import asyncio

from pytgi_router.core.shard_probe import ShardProbe


class _Shard:
    def __init__(self) -> None:
        self.calls = 0
        self.up = True

    async def check(self) -> None:
        self.calls += 1
        if not self.up:
            raise RuntimeError("shard gone")


def test_a_cached_answer_is_reused_until_a_later_failure_makes_it_stale() -> None:
    now = [100.0]
    shard = _Shard()
    probe = ShardProbe(shard.check, ttl_s=1.0, clock=lambda: now[0])

    async def main() -> None:
        assert await probe.healthy() and shard.calls == 1
        now[0] = 100.5
        assert await probe.healthy(not_before=99.0) and shard.calls == 1  # fresh, from after
        # A batch failed at 100.2, after the cached answer: ask the shard again.
        shard.up = False
        assert not await probe.healthy(not_before=100.2) and shard.calls == 2
        now[0] = 102.0
        shard.up = True
        assert await probe.healthy(not_before=100.2) and shard.calls == 3  # expired anyway

    asyncio.run(main())
