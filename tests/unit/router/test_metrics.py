"""The gauges Kubernetes' inference gateway reads: KV usage as a fraction and the cache's
geometry as an info metric's labels (vLLM's label names), consistent across a re-warm."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pytgi_router.metrics import Metrics


def _samples(metrics: Metrics, name: str) -> list[tuple[dict[str, str], float]]:
    text = metrics.render().decode()
    return [(s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name]


def test_usage_is_the_fraction_of_blocks_held() -> None:
    m = Metrics()
    assert _samples(m, "pytgi_kv_cache_usage_ratio") == [({}, 0.0)]
    m.kv_capacity(16, 200)
    m.kv_free(150)
    assert _samples(m, "pytgi_kv_cache_usage_ratio") == [({}, 0.25)]
    assert _samples(m, "pytgi_kv_blocks_free") == [({}, 150.0)]
    m.kv_free(200)
    assert _samples(m, "pytgi_kv_cache_usage_ratio") == [({}, 0.0)]


def test_cache_info_has_one_geometry_after_a_rewarm() -> None:
    """A restarted shard group may size its cache anew: only the latest geometry is shown."""
    m = Metrics()
    m.kv_capacity(16, 200)
    m.kv_capacity(16, 120)
    assert _samples(m, "pytgi_cache_config_info") == [
        ({"block_size": "16", "num_gpu_blocks": "120"}, 1.0)
    ]
    assert _samples(m, "pytgi_kv_blocks_total") == [({}, 120.0)]
