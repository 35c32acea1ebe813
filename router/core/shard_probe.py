"""ShardProbe: `/health`'s Health RPC, single-flight and cached.

A Health RPC is a forward on the shard's engine thread, queued ahead of real work. Unauthenticated
`/health` floods used to make one RPC each (and a timed-out one marked the scheduler unhealthy,
so the watchdog reconnected). Here every caller in a burst shares one RPC in flight, and its
answer is reused for `ttl_s`: a flood costs the shards at most one RPC per `ttl_s`. The answer
only colours `/health`; it never marks the scheduler unhealthy (the watchdog's own check does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

Check = Callable[[], Awaitable[None]]


class ShardProbe:
    def __init__(
        self, check: Check, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._check = check
        self.ttl_s = ttl_s
        self._clock = clock
        self._answer: bool | None = None
        self._answered_at = 0.0
        self._in_flight: asyncio.Future[bool] | None = None

    async def healthy(self, not_before: float = 0.0) -> bool:
        """The cached answer while fresh and given at or after `not_before` (a batch that failed
        since makes an earlier "healthy" stale), else the answer of the one RPC in flight
        (started here if none is). Shielded: a /health client that goes away does not cancel
        the RPC the others wait on."""
        fresh = self._clock() - self._answered_at < self.ttl_s
        if self._answer is not None and fresh and self._answered_at >= not_before:
            return self._answer
        if self._in_flight is None:
            self._in_flight = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._in_flight)

    def forget(self) -> None:
        """Drops the cached answer (the shards were reconnected: it was about the old ones)."""
        self._answer = None

    async def _ask(self) -> bool:
        try:
            await self._check()
            answer = True
        except Exception as err:  # ShardCallError or timeout: either way not healthy now
            logger.warning("shard health check failed: %s", err)
            answer = False
        finally:
            self._in_flight = None
        self._answer, self._answered_at = answer, self._clock()
        return answer
