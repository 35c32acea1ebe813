"""One `pytgi-benchmark run`: probe the endpoint, build the workload, warm up, measure.

A sweep runs the same workload once per concurrency level, each level after the shared warm-up.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import httpx

from pytgi_bench.api import api_for
from pytgi_bench.load import LoadGenerator, LoadResult, LoadShape
from pytgi_bench.settings import LoadSettings
from pytgi_bench.summary import Summary, summarize
from pytgi_bench.token_aligner import (
    LocalTokenCounter,
    TokenCounter,
    WordTokenCounter,
    server_counter_or_none,
)
from pytgi_bench.transport import HttpxTransport, RawTransport, Transport
from pytgi_bench.workload import Workload, build_workload


class BenchmarkError(Exception):
    """The run could not start or produced nothing: the endpoint is dead, unhealthy or broken."""


@dataclass(slots=True)
class BenchmarkRun:
    concurrency: int | None
    request_rate: float
    summary: Summary
    load: LoadResult


@dataclass(slots=True)
class BenchmarkReport:
    settings: LoadSettings
    workload: Workload
    server_info: dict[str, Any] | None
    runs: list[BenchmarkRun] = field(default_factory=list)


def _headers(settings: LoadSettings) -> dict[str, str]:
    return {"authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}


async def probe_endpoint(http: httpx.AsyncClient, settings: LoadSettings) -> dict[str, Any] | None:
    """Fails with a clear message unless the endpoint answers; returns TGI's /info when it has one."""
    path = "/health" if settings.api == "tgi" else "/v1/models"
    try:
        response = await http.get(settings.url + path, headers=_headers(settings))
    except httpx.HTTPError as exc:
        raise BenchmarkError(f"cannot reach {settings.url}: {type(exc).__name__}: {exc}") from None
    if response.status_code >= 500:
        raise BenchmarkError(
            f"{settings.url}{path} answered HTTP {response.status_code}: the server is unhealthy"
        )
    try:
        info = await http.get(settings.url + "/info")
        return info.json() if info.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _token_counter(http: httpx.AsyncClient, settings: LoadSettings) -> TokenCounter:
    if settings.tokenizer is not None:
        return LocalTokenCounter(settings.tokenizer)
    counter = await server_counter_or_none(http, settings.url)
    if counter is not None:
        return counter
    print(
        f"warning: {settings.url}/tokenize is not available; input lengths are estimated "
        "(pass --tokenizer for exact lengths)",
        file=sys.stderr,
    )
    return WordTokenCounter()


async def run_benchmark(
    settings: LoadSettings, concurrencies: list[int | None] | None = None
) -> BenchmarkReport:
    """Runs the workload once per entry of `concurrencies` (default: settings.concurrency)."""
    levels = concurrencies or [settings.concurrency]
    timeout = httpx.Timeout(settings.timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        info = await probe_endpoint(http, settings)
        counter = await _token_counter(http, settings)
        workload = await build_workload(
            settings.num_requests,
            settings.input_len,
            settings.output_len,
            counter,
            settings.prompts_file,
            settings.seed,
        )
        api = api_for(settings.api)
        transport = _transport(http, settings)
        generator = LoadGenerator(
            transport,
            api,
            settings.model,
            settings.ignore_eos,
            _headers(settings),
            settings.timeout_s,
        )
        try:
            report = await _measure(generator, settings, workload, info, levels)
        finally:
            await transport.aclose()
    return report


def _transport(http: httpx.AsyncClient, settings: LoadSettings) -> Transport:
    if settings.http_client == "raw" and settings.url.startswith("http://"):
        return RawTransport(settings.url)
    return HttpxTransport(http, settings.url)


async def _measure(
    generator: LoadGenerator,
    settings: LoadSettings,
    workload: Workload,
    info: dict[str, Any] | None,
    levels: list[int | None],
) -> BenchmarkReport:
    warm = await generator.warmup(workload.items, settings.warmup, levels[0])
    if warm and not any(r.ok for r in warm):
        raise BenchmarkError(f"every warm-up request failed: {warm[0].error}")
    report = BenchmarkReport(settings, workload, info)
    for level in levels:
        shape = LoadShape(
            concurrency=level,
            request_rate=settings.request_rate,
            num_requests=settings.num_requests,
            duration_s=settings.duration_s,
            seed=settings.seed,
            progress=settings.progress,
        )
        load = await generator.run(workload.items, shape)
        summary = summarize(load, settings.slo_ms)
        report.runs.append(BenchmarkRun(level, settings.request_rate, summary, load))
    return report
