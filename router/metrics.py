"""Prometheus metrics with TGI's `tgi_*` names, so that TGI dashboards work unchanged.

One `Metrics` object per router process, on its own registry (no process-global state).
"""

from __future__ import annotations

import contextlib
import time

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

# Only ever incremented: a counter under the exact name TGI exposes.
Counter = Gauge

# TGI: every *_duration histogram has 35 geometric buckets from 150 µs, x1.5 each (~145 s top).
DURATION_BUCKETS = tuple(0.00015 * 1.5**i for i in range(35))


def _linear(limit: int, count: int = 100) -> tuple[float, ...]:
    step = max(1.0, limit / count)
    return tuple(step * (i + 1) for i in range(count))


class Metrics:
    def __init__(self, max_input_tokens: int = 1024, max_total_tokens: int = 2048) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        d = DURATION_BUCKETS
        # prometheus_client would export a Counter as `<name>_total`; TGI exports the bare name,
        # which its dashboards query, so TGI's counters are monotonic gauges here (`_Counter`).
        self.request_count = Counter("tgi_request_count", "Requests received", registry=r)
        self.request_success = Counter("tgi_request_success", "Requests succeeded", registry=r)
        self.request_failure = Counter(
            "tgi_request_failure", "Requests failed", ["err"], registry=r
        )
        self.request_duration = Histogram(
            "tgi_request_duration", "End-to-end request duration (s)", buckets=d, registry=r
        )
        self.request_validation_duration = Histogram(
            "tgi_request_validation_duration", "Validation duration (s)", buckets=d, registry=r
        )
        self.request_queue_duration = Histogram(
            "tgi_request_queue_duration", "Time in queue (s)", buckets=d, registry=r
        )
        self.request_inference_duration = Histogram(
            "tgi_request_inference_duration", "Inference duration (s)", buckets=d, registry=r
        )
        self.request_mean_time_per_token_duration = Histogram(
            "tgi_request_mean_time_per_token_duration",
            "Mean time per generated token (s)", buckets=d, registry=r,
        )
        self.request_input_length = Histogram(
            "tgi_request_input_length", "Prompt tokens", buckets=_linear(max_input_tokens),
            registry=r,
        )
        self.request_generated_tokens = Histogram(
            "tgi_request_generated_tokens", "Generated tokens", buckets=_linear(max_total_tokens),
            registry=r,
        )
        self.request_max_new_tokens = Histogram(
            "tgi_request_max_new_tokens", "Requested max_new_tokens",
            buckets=_linear(max_total_tokens), registry=r,
        )
        # Queue and batches.
        self.queue_size = Gauge("tgi_queue_size", "Requests waiting", registry=r)
        self.batch_current_size = Gauge("tgi_batch_current_size", "Running batch size", registry=r)
        self.batch_current_max_tokens = Gauge(
            "tgi_batch_current_max_tokens",
            "KV tokens held by the live requests (whole blocks, shared cached prefixes once)",
            registry=r
        )
        self.batch_max_total_tokens = Gauge(
            "tgi_batch_max_total_tokens", "KV capacity in tokens (from Warmup)", registry=r
        )
        self.batch_next_size = Histogram(
            "tgi_batch_next_size", "Size of each new batch",
            buckets=tuple(float(i) for i in range(1, 1025)), registry=r,
        )
        self.batch_concat = Counter(
            "tgi_batch_concat", "New batches joined onto the running one", ["reason"], registry=r
        )
        method = ["method"]
        self.batch_inference_count = Counter(
            "tgi_batch_inference_count", "Shard calls", method, registry=r
        )
        self.batch_inference_success = Counter(
            "tgi_batch_inference_success", "Shard calls that succeeded", method, registry=r
        )
        self.batch_inference_failure = Counter(
            "tgi_batch_inference_failure", "Shard calls that failed", method, registry=r
        )
        self.batch_inference_duration = Histogram(
            "tgi_batch_inference_duration", "Router-side shard call duration (s)", method,
            buckets=d, registry=r,
        )
        self.batch_forward_duration = Histogram(
            "tgi_batch_forward_duration", "Shard forward duration (s)", method, buckets=d,
            registry=r,
        )
        self.batch_decode_duration = Histogram(
            "tgi_batch_decode_duration", "Shard token post-processing duration (s)", method,
            buckets=d, registry=r,
        )
        self.batch_filter_duration = Histogram(
            "tgi_batch_filter_duration", "Sending tokens and filtering the batch (s)", method,
            buckets=d, registry=r,
        )
        self.batch_concat_duration = Histogram(
            "tgi_batch_concat_duration", "Shard batch concatenation duration (s)", method,
            buckets=d, registry=r,
        )
        # pytgi additions.
        self.kv_blocks_free = Gauge(
            "pytgi_kv_blocks_free",
            "KV-cache blocks no live request holds (free, or cached prefixes evicted on demand)",
            registry=r,
        )
        self.kv_blocks_total = Gauge("pytgi_kv_blocks_total", "KV-cache blocks", registry=r)
        # For Kubernetes' inference gateway (its endpoint picker's --kv-cache-usage-percentage-metric
        # and --cache-info-metric, vLLM's label names): a fraction, and the geometry as labels.
        self.kv_cache_usage = Gauge(
            "pytgi_kv_cache_usage_ratio",
            "Fraction of KV-cache blocks held by live requests (0 to 1; cached prefixes no live "
            "request holds count as free: they are evicted on demand)", registry=r,
        )
        self.cache_config_info = Gauge(
            "pytgi_cache_config_info", "The KV cache's geometry (value 1): tokens per block, "
            "usable blocks", ["block_size", "num_gpu_blocks"], registry=r,
        )
        self._kv_total = 0
        self.shard_reconnects = Counter(
            "pytgi_shard_reconnects", "Times the router re-connected to and re-warmed the shards",
            registry=r,
        )
        # Prefix caching and KV on demand.
        self.request_cached_tokens = Histogram(
            "pytgi_request_cached_tokens",
            "Prompt tokens found in the prefix cache, per request at its first admission",
            buckets=_linear(max_input_tokens), registry=r,
        )
        self.prefix_cache_hit_ratio = Gauge(
            "pytgi_prefix_cache_hit_ratio",
            "Prompt tokens served from the prefix cache / prompt tokens admitted, since start",
            registry=r,
        )
        self.preemptions = Counter(
            "pytgi_preemptions_total",
            "Requests preempted (KV blocks released, re-queued to resume) for want of KV blocks",
            registry=r,
        )
        # Speculation (the shards' --speculate): per verification step, from DecodeResponse's
        # drafted_tokens/drafted_rows and the tokens each Generation carries past its first.
        self.request_skipped_tokens = Histogram(
            "tgi_request_skipped_tokens",
            "Draft tokens kept per drafting sequence and step (tokens emitted beyond one)",
            buckets=tuple(float(i) for i in range(17)), registry=r,
        )
        self.speculative_drafted_tokens = Counter(
            "pytgi_speculative_drafted_tokens", "Draft tokens fed to the model", registry=r
        )
        self.speculative_accepted_tokens = Counter(
            "pytgi_speculative_accepted_tokens", "Draft tokens kept (emitted as generated)",
            registry=r,
        )
        self.speculative_rows = Counter(
            "pytgi_speculative_rows", "Sequence steps that carried drafts", registry=r
        )
        self.speculative_acceptance_rate = Gauge(
            "pytgi_speculative_acceptance_rate",
            "Draft tokens kept / draft tokens fed, since start", registry=r,
        )
        self.speculative_mean_accepted_length = Gauge(
            "pytgi_speculative_mean_accepted_length",
            "Tokens emitted per sequence step that carried drafts (kept drafts + 1), since start",
            registry=r,
        )
        # Multi-step decode (--max-decode-steps): one Decode call runs up to that many steps, so
        # tgi_batch_inference_count{method="decode"} counts calls and this the steps they ran.
        self.decode_steps = Counter(
            "pytgi_decode_steps_total",
            "Decode steps the shards ran (a Decode call runs up to --max-decode-steps of them)",
            registry=r,
        )
        # A newcomer arriving during a multi-step call cuts it short (the CutShort RPC) so that it
        # joins after the step in progress rather than after the call's last; so does a cancel.
        self.decode_cut_short = Counter(
            "pytgi_decode_calls_cut_short_total",
            "Multi-step Decode calls stopped early by the CutShort RPC for a newcomer or a cancel",
            registry=r,
        )
        self.shard_health_checks = Counter(
            "pytgi_shard_health_checks",
            "Health RPCs sent to the shards (/health shares one and caches it; the watchdog's own)",
            registry=r,
        )

        # LoRA (issue 31): per loaded adapter (the label's values are the loaded adapters' names
        # only: an unloaded adapter's series go), and vLLM's info gauge that Kubernetes'
        # inference gateway reads to route by adapter (its --lora-info-metric).
        self.lora_requests = Counter(
            "pytgi_lora_requests_total", "Requests that ended successfully under a LoRA adapter",
            ["adapter"], registry=r,
        )
        self.lora_generated_tokens = Counter(
            "pytgi_lora_generated_tokens_total", "Tokens generated under a LoRA adapter",
            ["adapter"], registry=r,
        )
        self.lora_requests_info = Gauge(
            "vllm:lora_requests_info", "LoRA adapters of the running and the waiting requests "
            "(comma lists) and --max-loras; the value is when it was read (Unix time, s), as "
            "vLLM's", ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r,
        )

    def adapter_served(self, name: str, generated_tokens: int) -> None:
        """A request under adapter `name` (still loaded) ended successfully."""
        self.lora_requests.labels(adapter=name).inc()
        self.lora_generated_tokens.labels(adapter=name).inc(generated_tokens)

    def forget_adapter(self, name: str) -> None:
        """An unloaded adapter's series go (bounded label values: loaded adapters only)."""
        for metric in (self.lora_requests, self.lora_generated_tokens):
            with contextlib.suppress(KeyError):
                metric.remove(name)

    def lora_info(self, running: list[str], waiting: list[str], max_lora: int) -> None:
        """vllm:lora_requests_info now: one series (the previous one goes), valued at the time,
        as vLLM sets it; a reader takes the series with the latest value."""
        self.lora_requests_info.clear()
        self.lora_requests_info.labels(
            running_lora_adapters=",".join(running), waiting_lora_adapters=",".join(waiting),
            max_lora=str(max_lora),
        ).set(time.time())

    def kv_capacity(self, block_size: int, blocks: int) -> None:
        """The KV cache's size, at every (re-)warm: a restarted shard group may size it anew, so
        the info metric's old labels go rather than leave two geometries for a scraper to pick."""
        self._kv_total = blocks
        self.kv_blocks_total.set(blocks)
        self.cache_config_info.clear()
        self.cache_config_info.labels(block_size=str(block_size), num_gpu_blocks=str(blocks)).set(1)

    def kv_free(self, free: int) -> None:
        """Blocks no live request holds, and the usage fraction that follows: set together so
        that a scrape never sees one without the other."""
        self.kv_blocks_free.set(free)
        total = self._kv_total
        self.kv_cache_usage.set((total - free) / total if total > 0 else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
