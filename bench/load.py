"""Drives a workload against an endpoint: warm-up, then closed-loop and/or Poisson arrivals.

Arrival times follow an absolute Poisson schedule (exponential gaps at `request_rate`, or all at
once for inf); a request that arrives while `concurrency` requests are in flight waits on the
client, and its timers start when it is actually sent — vLLM's semantics for --request-rate with
--max-concurrency.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tqdm import tqdm

from pytgi_bench.api import Api
from pytgi_bench.client import RequestResult, send_request
from pytgi_bench.transport import Transport
from pytgi_bench.workload import WorkloadItem


@dataclass(slots=True)
class LoadResult:
    results: list[RequestResult]
    # perf_counter() when the timed phase began, and its length up to the last completion.
    started: float
    duration_s: float
    max_in_flight: int


@dataclass(slots=True)
class LoadShape:
    concurrency: int | None
    request_rate: float
    num_requests: int
    duration_s: float | None
    seed: int
    progress: bool


class _InFlight:
    __slots__ = ("now", "peak")

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0


class LoadGenerator:
    def __init__(
        self,
        transport: Transport,
        api: Api,
        model: str,
        ignore_eos: bool,
        headers: dict[str, str],
        timeout_s: float,
    ) -> None:
        self._transport = transport
        self._timeout_s = timeout_s
        self._api = api
        self._model = model
        self._ignore_eos = ignore_eos
        self._headers = {"content-type": "application/json", **headers}

    def _body(self, item: WorkloadItem) -> bytes:
        return json.dumps(self._api.payload(item, self._model, self._ignore_eos)).encode()

    async def _send(self, item: WorkloadItem, body: bytes) -> RequestResult:
        return await send_request(
            self._transport, self._api, item, body, self._headers, self._timeout_s
        )

    async def warmup(
        self, items: list[WorkloadItem], count: int, concurrency: int | None
    ) -> list[RequestResult]:
        """Runs `count` requests whose results are discarded (connections, caches, allocators)."""
        if count == 0:
            return []
        chosen = [items[i % len(items)] for i in range(count)]
        limit = asyncio.Semaphore(concurrency or count)

        async def one(item: WorkloadItem) -> RequestResult:
            async with limit:
                return await self._send(item, self._body(item))

        return list(await asyncio.gather(*(one(item) for item in chosen)))

    async def run(self, items: list[WorkloadItem], shape: LoadShape) -> LoadResult:
        bodies = [self._body(item) for item in items]
        rng = random.Random(shape.seed)
        limit = asyncio.Semaphore(shape.concurrency) if shape.concurrency else None
        in_flight = _InFlight()
        total = shape.num_requests if shape.duration_s is None else None
        bar = tqdm(
            total=total,
            unit="req",
            file=sys.stderr,
            disable=not shape.progress,
            desc="benchmark",
            dynamic_ncols=True,
        )
        tasks: list[asyncio.Task[RequestResult]] = []

        async def one(index: int) -> RequestResult:
            in_flight.now += 1
            in_flight.peak = max(in_flight.peak, in_flight.now)
            try:
                return await self._send(items[index], bodies[index])
            finally:
                in_flight.now -= 1
                if limit is not None:
                    limit.release()
                bar.update(1)

        started = time.perf_counter()
        deadline = None if shape.duration_s is None else started + shape.duration_s
        arrival = started
        for index in _schedule(len(items), shape):
            if shape.request_rate != float("inf"):
                arrival += rng.expovariate(shape.request_rate)
                await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            if limit is not None:
                await limit.acquire()
            if deadline is not None and time.perf_counter() >= deadline:
                if limit is not None:
                    limit.release()
                break
            tasks.append(asyncio.create_task(one(index)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - started
        bar.close()
        return LoadResult(results, started, duration, in_flight.peak)


def _schedule(pool: int, shape: LoadShape) -> Iterator[int]:
    """Indices into the workload: each once, or cycled until the deadline in duration mode."""
    if shape.duration_s is None:
        return iter(range(shape.num_requests))
    return itertools.cycle(range(pool))
