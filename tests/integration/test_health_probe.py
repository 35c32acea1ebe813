"""/health against real `pytgi-shard serve` processes (issue 11, item 5): a flood of probes makes
one Health RPC (single-flight, cached), a probe that times out turns /health false without ever
leading the watchdog to reconnect, and a step slower than the health timeout does not flap
/health. A SIGSTOPped shard stands in for a wedged or very slow one: to the router the two look
the same (the call simply does not answer)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pytgi_router.core.infer import Infer
from pytgi_router.core.watchdog import Watchdog
from tests.integration.test_router_infer import Log, request, serving, settings, solo
from tests.shard_process import ShardProcesses, start_shards


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model / "tokenizer.json"))


@pytest.fixture(scope="module")
def shards(model: Path) -> Iterator[ShardProcesses]:
    with start_shards(model) as processes:
        yield processes


@contextmanager
def frozen(shards: ShardProcesses) -> Iterator[None]:
    pid = shards.procs[0].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def health_rpcs(infer: Infer) -> float:
    value = infer.metrics.registry.get_sample_value("pytgi_shard_health_checks")
    return value or 0.0


def reconnects(infer: Infer) -> float:
    return infer.metrics.registry.get_sample_value("pytgi_shard_reconnects") or 0.0


def test_a_health_flood_makes_one_rpc_and_a_failed_probe_never_reconnects(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    config = settings()
    config.health_recent_s, config.health_cache_s, config.health_timeout_s = 0.0, 0.5, 0.5

    async def main() -> None:
        async with serving(shards, config) as infer:
            watchdog = Watchdog(infer, poll_s=0.05)
            watchdog.start()
            try:
                assert await asyncio.gather(*(infer.health() for _ in range(300))) == [True] * 300
                assert health_rpcs(infer) == 1
                assert await infer.health() and health_rpcs(infer) == 1  # cached
                await asyncio.sleep(0.6)
                with frozen(shards):
                    answers = await asyncio.gather(*(infer.health() for _ in range(100)))
                    assert answers == [False] * 100 and health_rpcs(infer) == 2
                    await asyncio.sleep(1.0)  # twenty watchdog polls
                    assert infer.needs_reconnect() is False
                await asyncio.sleep(0.6)
                assert await infer.health()
                assert reconnects(infer) == 0
                assert len(await solo(infer, request(tokenizer, "Hello world!", 4))) == 4
            finally:
                await watchdog.stop()

    asyncio.run(main())


def test_a_step_slower_than_the_health_timeout_keeps_health_up(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    config = settings()
    config.health_recent_s, config.health_cache_s, config.health_timeout_s = 0.3, 0.1, 0.3

    async def main() -> None:
        async with serving(shards, config) as infer:
            watchdog = Watchdog(infer, poll_s=0.05)
            watchdog.start()
            try:
                stream = infer.submit(request(tokenizer, "The quick brown fox", 100))
                ids = await Log().read(0, stream, limit=1)
                rpcs = health_rpcs(infer)
                with frozen(shards):  # one step now takes 1.5 s, five health timeouts
                    answers = []
                    for _ in range(15):
                        await asyncio.sleep(0.1)
                        answers.append(await infer.health())
                assert answers == [True] * 15
                assert health_rpcs(infer) == rpcs, "a running step needs no Health RPC"
                await Log().read(0, stream, ids=ids)
                assert len(ids) == 100
                assert reconnects(infer) == 0
            finally:
                await watchdog.stop()

    asyncio.run(main())
