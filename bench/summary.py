"""Turns the timed requests of a run into vLLM-style serving metrics.

Latency statistics are over successful requests (ITL pooled over all their token gaps);
throughputs divide by the whole run's duration; goodput counts requests that met every SLO.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pytgi_bench.client import RequestResult
from pytgi_bench.load import LoadResult


@dataclass(slots=True)
class LatencyStats:
    count: int = 0
    mean_ms: float = 0.0
    std_ms: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    min_ms: float = 0.0
    max_ms: float = 0.0

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        if not seconds:
            return cls()
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(
            count=len(seconds),
            mean_ms=float(ms.mean()),
            std_ms=float(ms.std()),
            p50_ms=float(p50),
            p90_ms=float(p90),
            p99_ms=float(p99),
            min_ms=float(ms.min()),
            max_ms=float(ms.max()),
        )


@dataclass(slots=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    # Sum of max_new_tokens over completed requests: equals total_output_tokens when no request
    # stopped early (EOS), which is what a token-exact run must show.
    requested_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    # Highest output tokens/s over 1-second windows (by token arrival time).
    peak_output_throughput: float
    max_concurrency: int
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    slo_ms: dict[str, float] = field(default_factory=dict)
    # Requests/s that met every SLO in slo_ms; None without SLOs.
    goodput: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _meets(result: RequestResult, slo_ms: dict[str, float]) -> bool:
    measured = {
        "ttft": result.ttft,
        "tpot": result.tpot or 0.0,
        "e2el": result.latency,
    }
    return all(measured[name] * 1000.0 <= limit for name, limit in slo_ms.items())


def _peak_throughput(load: LoadResult) -> float:
    """Max tokens in any 1-second bucket, counting one token per streamed payload."""
    buckets: Counter[int] = Counter()
    for result in load.results:
        if not result.ok:
            continue
        t = result.start + result.ttft - load.started
        buckets[int(t)] += 1
        for gap in result.itl:
            t += gap
            buckets[int(t)] += 1
    return float(max(buckets.values(), default=0))


def summarize(load: LoadResult, slo_ms: dict[str, float]) -> Summary:
    done = [r for r in load.results if r.ok]
    failed = [r for r in load.results if not r.ok]
    duration = max(load.duration_s, 1e-9)
    input_tokens = sum(r.input_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    goodput = None
    if slo_ms:
        goodput = sum(1 for r in done if _meets(r, slo_ms)) / duration
    return Summary(
        completed=len(done),
        failed=len(failed),
        duration_s=load.duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        requested_output_tokens=sum(r.max_new_tokens for r in done),
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        peak_output_throughput=_peak_throughput(load),
        max_concurrency=load.max_in_flight,
        ttft=LatencyStats.of([r.ttft for r in done]),
        tpot=LatencyStats.of([t for r in done if (t := r.tpot) is not None]),
        itl=LatencyStats.of([gap for r in done for gap in r.itl]),
        e2el=LatencyStats.of([r.latency for r in done]),
        slo_ms=dict(slo_ms),
        goodput=goodput,
        errors=dict(Counter(r.error or "" for r in failed).most_common()),
        finish_reasons=dict(Counter(r.finish_reason or "unknown" for r in done)),
    )
