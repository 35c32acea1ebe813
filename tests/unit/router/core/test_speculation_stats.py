"""Speculation's router metrics from Decode answers: drafted and kept tokens, the per-row kept
counts (tgi_request_skipped_tokens), acceptance rate and mean accepted length since start."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pytgi_proto import generate_pb2 as pb
from pytgi_router.core.speculation_stats import SpeculationStats
from pytgi_router.metrics import Metrics


def value(registry: CollectorRegistry, name: str) -> float:
    got = registry.get_sample_value(name)
    assert got is not None, name
    return got


def decode(drafted: int, rows: int, lengths: list[int]) -> pb.DecodeResponse:
    return pb.DecodeResponse(
        generations=[pb.Generation(request_id=i, tokens=pb.Tokens(ids=[5] * n))
                     for i, n in enumerate(lengths)],
        drafted_tokens=drafted,
        drafted_rows=rows,
    )


def test_kept_tokens_per_drafting_row_and_the_rates_since_start() -> None:
    metrics = Metrics()
    stats = SpeculationStats(metrics)
    r = metrics.registry
    stats.observe(decode(0, 0, [1, 1]))  # a plain step: nothing recorded
    assert value(r, "tgi_request_skipped_tokens_count") == 0
    # 3 rows drafted 7 tokens: one kept 3 (4 tokens), one kept 1, one kept none; a 4th row
    # did not draft.
    stats.observe(decode(7, 3, [4, 2, 1, 1]))
    assert value(r, "tgi_request_skipped_tokens_count") == 3
    assert value(r, "tgi_request_skipped_tokens_sum") == 4
    assert value(r, "pytgi_speculative_drafted_tokens") == 7
    assert value(r, "pytgi_speculative_accepted_tokens") == 4
    assert value(r, "pytgi_speculative_rows") == 3
    assert value(r, "pytgi_speculative_acceptance_rate") == 4 / 7
    assert value(r, "pytgi_speculative_mean_accepted_length") == (4 + 3) / 3
    stats.observe(decode(3, 1, [1, 4]))
    assert value(r, "pytgi_speculative_acceptance_rate") == 7 / 10
    assert value(r, "pytgi_speculative_mean_accepted_length") == (7 + 4) / 4
