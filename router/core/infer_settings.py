"""InferSettings: the inference core's knobs (budgets, limits, shard timeouts).

Settings flow one way: the router's flags (RouterSettings.infer_settings()) → InferSettings → the
scheduler's Budgets (Budgets.of, once the shards' Warmup fixed the KV budget). The defaults are
TGI's, from pytgi_proto.contracts, which the launcher's and the router's flags share.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytgi_proto import contracts as c

# The longest one Prefill/Decode (or Warmup) may take by default (--shard-step-timeout).
SHARD_STEP_TIMEOUT_S = 300.0


@dataclass
class InferSettings:
    max_concurrent_requests: int = c.MAX_CONCURRENT_REQUESTS
    # None → measured by the shards at Warmup (prefill throughput at a ladder of sizes).
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None  # None → from the shard's Warmup
    max_batch_size: int | None = None
    waiting_served_ratio: float = c.WAITING_SERVED_RATIO
    max_waiting_tokens: int = c.MAX_WAITING_TOKENS
    # Decode steps per Decode call when nothing waits to join (router/core/decode_steps.py).
    max_decode_steps: int = c.MAX_DECODE_STEPS
    # The longest a multi-step call is planned to run, in ms (0: no bound).
    max_decode_call_ms: int = c.MAX_DECODE_CALL_MS
    max_input_tokens: int | None = None  # None → from Warmup
    max_total_tokens: int | None = None  # None → from Warmup
    # Bound on waiting (not yet running) requests, below max_concurrent_requests: a queued
    # request holds a permit, so the permits alone bound queued + running. None: no other bound.
    max_queue_size: int | None = None
    # health(): a batch that succeeded this recently proves the shards; else a Health RPC with
    # this timeout.
    health_recent_s: float = 5.0
    health_timeout_s: float = 5.0
    # /health's Health RPC answer is reused this long (and one RPC is in flight at a time), so a
    # flood of probes costs the shards at most one RPC per this many seconds.
    health_cache_s: float = 1.0
    # The longest one Prefill/Decode (or Warmup) may take: a wedged shard then fails its batch
    # with a generation error instead of hanging every request forever. Generous, because a
    # large prefill on a slow device is legitimately slow.
    shard_step_timeout_s: float = SHARD_STEP_TIMEOUT_S
    # Reuse the KV of prompt prefixes already computed (the shards must support it too).
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        problems = [
            f"`{name}` must be >= {low}, got {value}"
            for name, value, low in (
                ("max_concurrent_requests", self.max_concurrent_requests, 1),
                ("max_batch_prefill_tokens", self.max_batch_prefill_tokens, 1),
                ("max_batch_total_tokens", self.max_batch_total_tokens, 1),
                ("max_batch_size", self.max_batch_size, 1),
                ("waiting_served_ratio", self.waiting_served_ratio, 0),
                ("max_waiting_tokens", self.max_waiting_tokens, 0),
                ("max_decode_steps", self.max_decode_steps, 1),
                ("max_decode_call_ms", self.max_decode_call_ms, 0),
                ("max_input_tokens", self.max_input_tokens, 1),
                ("max_total_tokens", self.max_total_tokens, 2),
                ("max_queue_size", self.max_queue_size, 1),
            )
            if value is not None and value < low
        ]
        if self.max_queue_size is not None and self.max_queue_size >= self.max_concurrent_requests:
            problems.append(
                f"`max_queue_size` must be < `max_concurrent_requests` "
                f"({self.max_concurrent_requests}), got {self.max_queue_size}: queued requests "
                f"hold permits, so it would never trigger"
            )
        if self.max_decode_steps > c.DECODE_STEPS_LIMIT:
            problems.append(f"`max_decode_steps` must be at most {c.DECODE_STEPS_LIMIT}, got "
                            f"{self.max_decode_steps}")
        if not self.shard_step_timeout_s > 0:
            problems.append(f"`shard_step_timeout_s` must be > 0, got {self.shard_step_timeout_s}")
        if problems:
            raise ValueError("; ".join(problems))
