"""The shard watchdog: notices that the shards were lost and reconnects until they serve again.

The shards are lost when a rank's connection drops (its process died, or the launcher is
restarting the whole group) or when a batch failed and a Health RPC then fails too (a wedged
shard whose call hit its deadline). Requests in flight have failed by then (424); while the
shards are lost, /health and new requests answer 503. The watchdog retries `Infer.reconnect()`
with capped exponential backoff; it never gives up on its own, since whoever supervises the
shards (the launcher, Kubernetes) decides when they are gone for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pytgi_router.core.infer import Infer

logger = logging.getLogger(__name__)

POLL_S = 0.5
RETRY_MIN_S = 0.25
RETRY_MAX_S = 2.0


def retry_delay(attempt: int, low: float = RETRY_MIN_S, high: float = RETRY_MAX_S) -> float:
    """Seconds before reconnect attempt `attempt` + 1 (attempt 0 failed first)."""
    return float(min(high, low * 2 ** min(attempt, 16)))


class Watchdog:
    def __init__(self, infer: Infer, poll_s: float = POLL_S) -> None:
        self.infer = infer
        self.poll_s = poll_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pytgi-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                if await self.shards_lost():
                    await self.reconnect()
            except Exception:  # a bug here must not end the watching for good
                logger.exception("shard watchdog check failed")

    async def shards_lost(self) -> bool:
        verdict = self.infer.needs_reconnect()
        if verdict is None:
            # A batch failed: only the watchdog's own failing Health RPC says the shards
            # themselves are gone (a /health probe that fails never leads here).
            return not await self.infer.check_shards()
        return verdict

    async def reconnect(self) -> None:
        """Retries until the shards serve again (or the task is cancelled at shutdown)."""
        logger.warning("the shards are unavailable: reconnecting")
        attempt = 0
        while not self.infer.stopping:
            try:
                await self.infer.reconnect()
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:  # ShardCallError, InferStartError, a timeout, a stop
                delay = retry_delay(attempt)
                logger.warning("reconnect attempt %d failed (%s): retrying in %.2fs",
                               attempt + 1, err, delay)
            attempt += 1
            await asyncio.sleep(delay)
