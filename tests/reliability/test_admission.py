"""Admission never over-commits the KV cache: with a KV budget of a few requests
(--max-batch-total-tokens), many concurrent long requests all complete (they wait in the queue
rather than fail), the reserved tokens never exceed the budget, no shard call fails, and every
block is free afterwards."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.http_helpers import metric
from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses

BUDGET = 256  # 16 blocks of 16 tokens: four requests of ~55 tokens (4 blocks each) at a time
REQUESTS = 24
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def router(shard: ShardProcesses, llama: Path) -> Iterator[RouterProcess]:
    with RouterProcess(shard.urls[0], llama, "--max-batch-total-tokens", str(BUDGET),
                       "--max-batch-prefill-tokens", str(BUDGET), "--max-input-tokens", "24",
                       "--max-total-tokens", "64") as process:
        yield process


class Sampler:
    """Reads the batch gauges from /metrics every few milliseconds while the load runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.reserved: list[float] = []
        self.queued: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.reserved.append(metric(self.url, "tgi_batch_current_max_tokens"))
            self.queued.append(metric(self.url, "tgi_queue_size"))
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def load(url: str) -> list[int]:
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"inputs": f"Request {i}: the quick brown fox",
                "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
        if i % 2:
            r = await client.post(f"{url}/generate", json=body)
            assert r.status_code == 200, r.text
            return int(r.json()["details"]["generated_tokens"])
        tokens = 0
        async with client.stream("POST", f"{url}/generate_stream", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    assert '"error"' not in line, line
                    tokens += 1
        return tokens

    limits = httpx.Limits(max_connections=REQUESTS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return list(await asyncio.gather(*(one(client, i) for i in range(REQUESTS))))


def test_many_long_requests_queue_within_the_kv_budget(router: RouterProcess) -> None:
    url = router.url
    assert httpx.get(f"{url}/info").json()["max_batch_total_tokens"] == BUDGET
    sampler = Sampler(url)
    try:
        generated = asyncio.run(load(url))
    finally:
        sampler.stop()
    assert all(0 < n <= NEW_TOKENS for n in generated)
    assert max(sampler.reserved) <= BUDGET, "admission over-committed the KV cache"
    assert max(sampler.queued) > 0, "the budget must have made requests wait"
    assert metric(url, "tgi_request_success") >= REQUESTS
    for method in ("prefill", "decode"):
        assert metric(url, "tgi_batch_inference_failure", method=method) == 0
    assert metric(url, "pytgi_kv_blocks_free") == metric(url, "pytgi_kv_blocks_total") == 16
    assert metric(url, "tgi_batch_current_size") == 0
