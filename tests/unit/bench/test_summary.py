"""Serving metrics computed from timed requests, against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from pytgi_bench.client import RequestResult
from pytgi_bench.load import LoadResult
from pytgi_bench.summary import summarize


def _ok(start: float, ttft: float, itl: list[float], tokens: int, asked: int) -> RequestResult:
    return RequestResult(
        ok=True,
        start=start,
        ttft=ttft,
        latency=ttft + sum(itl),
        itl=itl,
        output_tokens=tokens,
        input_tokens=5,
        max_new_tokens=asked,
        finish_reason="length",
    )


def test_summary_matches_hand_computed_metrics() -> None:
    results = [
        _ok(100.0, 0.10, [0.02, 0.04], tokens=3, asked=3),
        _ok(100.1, 0.30, [0.05, 0.05, 0.05], tokens=4, asked=4),
        _ok(100.2, 0.20, [], tokens=1, asked=4),
        RequestResult(ok=False, start=100.3, error="HTTP 429: Model is overloaded"),
        RequestResult(ok=False, start=100.4, error="HTTP 429: Model is overloaded"),
    ]
    s = summarize(
        LoadResult(results, started=100.0, duration_s=2.0, max_in_flight=5),
        {"ttft": 250.0, "tpot": 35.0},
    )
    assert (s.completed, s.failed) == (3, 2)
    assert s.errors == {"HTTP 429: Model is overloaded": 2}
    assert s.total_output_tokens == 8 and s.requested_output_tokens == 11
    assert s.total_input_tokens == 15
    assert s.output_throughput == pytest.approx(8 / 2.0)
    assert s.request_throughput == pytest.approx(3 / 2.0)
    assert s.total_token_throughput == pytest.approx(23 / 2.0)
    assert s.ttft.mean_ms == pytest.approx(200.0)
    assert s.ttft.p50_ms == pytest.approx(200.0)
    assert s.ttft.p99_ms == pytest.approx(float(np.percentile([100, 300, 200], 99)))
    # TPOT = (e2el - ttft) / (tokens - 1); the one-token request has none.
    assert s.tpot.count == 2
    assert s.tpot.mean_ms == pytest.approx((30.0 + 50.0) / 2)
    assert s.itl.count == 5 and s.itl.max_ms == pytest.approx(50.0)
    assert s.e2el.max_ms == pytest.approx(450.0)
    # Goodput: request 1 (ttft 100, tpot 30) and request 3 (ttft 200, no tpot) meet the SLO.
    assert s.goodput == pytest.approx(2 / 2.0)
    assert s.max_concurrency == 5
    assert s.peak_output_throughput == 8.0


def test_summary_of_a_run_where_everything_failed() -> None:
    results = [RequestResult(ok=False, start=0.0, error="ConnectError")]
    s = summarize(LoadResult(results, started=0.0, duration_s=0.5, max_in_flight=1), {})
    assert s.completed == 0 and s.failed == 1 and s.goodput is None
    assert s.ttft.count == 0 and s.output_throughput == 0.0
