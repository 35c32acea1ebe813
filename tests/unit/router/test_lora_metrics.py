"""LoRA metrics: vllm:lora_requests_info keeps one series (the latest), valued at the time it
was set, with vLLM's comma lists; the per-adapter counters lose an unloaded adapter's series."""

from __future__ import annotations

import time

from pytgi_router.metrics import Metrics


def series(m: Metrics, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for metric in m.registry.collect() for s in metric.samples
            if s.name == name]


def test_lora_info_is_one_series_at_the_current_time() -> None:
    m = Metrics()
    before = time.time()
    m.lora_info(["sql", "chat"], [], 4)
    m.lora_info(["sql"], ["chat", "math"], 4)
    ((labels, value),) = series(m, "vllm:lora_requests_info")
    assert labels == {"running_lora_adapters": "sql", "waiting_lora_adapters": "chat,math",
                      "max_lora": "4"}
    assert before <= value <= time.time()


def test_per_adapter_counters_and_forgetting_an_adapter() -> None:
    m = Metrics()
    m.adapter_served("sql", 5)
    m.adapter_served("sql", 3)
    m.adapter_served("chat", 2)
    assert dict((lbl["adapter"], v) for lbl, v in series(m, "pytgi_lora_requests_total")) == {
        "sql": 2.0, "chat": 1.0}
    assert dict((lbl["adapter"], v) for lbl, v in
                series(m, "pytgi_lora_generated_tokens_total")) == {"sql": 8.0, "chat": 2.0}
    m.forget_adapter("sql")
    m.forget_adapter("never-loaded")
    assert [lbl["adapter"] for lbl, _ in series(m, "pytgi_lora_requests_total")] == ["chat"]
