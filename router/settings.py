"""RouterSettings: every knob of the router process, parsed once by the CLI and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field

from pytgi_proto import contracts as c
from pytgi_proto.contracts import (
    DEFAULT_UDS_PATH,
    TGI_HTTP_PORT,
    shard_socket,
    token_limit_problems,
)
from pytgi_router.core.infer_settings import SHARD_STEP_TIMEOUT_S, InferSettings
from pytgi_router.http.media.limits import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_REQUEST,
    MEDIA_FETCH_TIMEOUT_S,
    MediaLimits,
    media_limit_problems,
)
from pytgi_router.http.reasoning.registry import NO_PARSER, PARSER_NAMES

# Rank 0's socket under TGI's base name.
DEFAULT_MASTER_SHARD_UDS_PATH = shard_socket(DEFAULT_UDS_PATH, 0)


@dataclass(frozen=True, slots=True)
class RouterSettings:
    # Where rank 0 listens; the address wins over the socket path when both are given.
    master_shard_uds_path: str = DEFAULT_MASTER_SHARD_UDS_PATH
    master_shard_address: str | None = None
    # Shared secret the shards require (--shard-token on them), sent as gRPC metadata.
    shard_token: str | None = field(default=None, repr=False)
    tokenizer_name: str = ""
    tokenizer_config_path: str | None = None
    # The model's id in /info; defaults to tokenizer_name.
    model_id: str | None = None
    # The name OpenAI clients see (/v1/models, responses' `model`); defaults to the model's id.
    served_model_name: str | None = None
    revision: str | None = None
    hostname: str = "0.0.0.0"
    port: int = TGI_HTTP_PORT
    # Request limits (TGI's defaults).
    max_concurrent_requests: int = c.MAX_CONCURRENT_REQUESTS
    max_best_of: int = c.MAX_BEST_OF
    max_stop_sequences: int = c.MAX_STOP_SEQUENCES
    max_top_n_tokens: int = c.MAX_TOP_N_TOKENS
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    max_client_batch_size: int = c.MAX_CLIENT_BATCH_SIZE
    payload_limit: int = c.PAYLOAD_LIMIT
    # Open HTTP connections; past it a new one gets 503 at once (slow clients cannot pile up).
    max_connections: int = 1024
    # Scheduler budgets, forwarded to the inference core.
    waiting_served_ratio: float = c.WAITING_SERVED_RATIO
    # None: measured by the shards at Warmup (shard/engine/prefill_budget.py).
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    max_waiting_tokens: int = c.MAX_WAITING_TOKENS
    # Decode steps one Decode call may run when nothing waits to join (1: one per call).
    max_decode_steps: int = c.MAX_DECODE_STEPS
    # The longest a multi-step call is planned to run (0: no bound).
    max_decode_call_ms: int = c.MAX_DECODE_CALL_MS
    max_batch_size: int | None = None
    max_queue_size: int | None = None
    # Reuse the KV of prompt prefixes already computed (TGI's PREFIX_CACHING).
    prefix_caching: bool = True
    validation_workers: int = 2
    disable_grammar_support: bool = False
    # The longest grammar (compact JSON Schema or regex) accepted: router/http/grammar.py.
    max_grammar_bytes: int = c.MAX_GRAMMAR_BYTES
    # The reasoning parser (router/http/reasoning/): None detects one from the chat template,
    # "none" turns both off.
    reasoning_parser: str | None = None
    # Stored /v1/responses (this replica's memory, LRU): router/http/openai/response_store.py.
    responses_store_bytes: int = c.RESPONSES_STORE_BYTES
    # Images (router/http/media/): per request, per image (None: --payload-limit), and the URL
    # fetching policy, off unless --allow-media-urls or --allowed-media-domains turns it on.
    max_images_per_request: int = MAX_IMAGES_PER_REQUEST
    max_image_bytes: int | None = None
    max_image_pixels: int = MAX_IMAGE_PIXELS
    allow_media_urls: bool = False
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout: float = MEDIA_FETCH_TIMEOUT_S
    # HTTP and operations.
    api_key: str | None = field(default=None, repr=False)
    cors_allow_origin: tuple[str, ...] = ()
    otlp_endpoint: str | None = None
    otlp_service_name: str = "pytgi.router"
    json_output: bool = False
    graceful_termination_timeout: float = 90.0
    # After SIGTERM, seconds /health answers 503 (not ready) while every route still serves, so
    # that load balancers and Kubernetes take the replica out before it stops admitting.
    drain_grace_seconds: float = 5.0
    # The longest one shard call may take before its batch fails (a wedged shard).
    shard_step_timeout: float = SHARD_STEP_TIMEOUT_S
    # Value of the x-compute-type header (TGI reads COMPUTE_TYPE).
    compute_type: str = "gpu+optimized"

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("; ".join(problems))

    def _problems(self) -> list[str]:
        out = []
        if not self.tokenizer_name:
            out.append("--tokenizer-name is required")
        if self.served_model_name is not None and not self.served_model_name.strip():
            out.append("--served-model-name must not be empty")
        positive = {
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_best_of": self.max_best_of,
            "max_client_batch_size": self.max_client_batch_size,
            "payload_limit": self.payload_limit,
            "max_connections": self.max_connections,
            "validation_workers": self.validation_workers,
            "max_grammar_bytes": self.max_grammar_bytes,
        }
        out += [f"--{k.replace('_', '-')} must be > 0" for k, v in positive.items() if v <= 0]
        if self.max_batch_prefill_tokens is not None and self.max_batch_prefill_tokens <= 0:
            out.append("--max-batch-prefill-tokens must be > 0")
        if self.max_stop_sequences < 0 or self.max_top_n_tokens < 0:
            out.append("--max-stop-sequences and --max-top-n-tokens must be >= 0")
        queue, permits = self.max_queue_size, self.max_concurrent_requests
        if queue is not None and not 0 < queue < permits:
            # A queued request holds a permit: a bound at or above the permits is dead.
            out.append(f"--max-queue-size must be > 0 and < --max-concurrent-requests ({permits}), "
                       f"got {queue}: queued requests hold permits, so it would never trigger")
        if not 0 <= self.port <= 65535:
            out.append(f"--port must be in 0..65535, got {self.port}")
        out += token_limit_problems(
            self.max_input_tokens, self.max_total_tokens, self.max_batch_total_tokens
        )
        if self.reasoning_parser not in (None, NO_PARSER, *PARSER_NAMES):
            out.append(f"--reasoning-parser must be one of {', '.join(PARSER_NAMES)} or "
                       f"{NO_PARSER}, got {self.reasoning_parser!r}")
        if self.responses_store_bytes < 0:
            out.append(f"--responses-store-bytes must be >= 0, got {self.responses_store_bytes}")
        if self.graceful_termination_timeout < 0:
            out.append("--graceful-termination-timeout must be >= 0")
        if not self.drain_grace_seconds >= 0:
            out.append(f"--drain-grace-seconds must be >= 0, got {self.drain_grace_seconds}")
        if not self.shard_step_timeout > 0:
            out.append(f"--shard-step-timeout must be > 0, got {self.shard_step_timeout}")
        if not 1 <= self.max_decode_steps <= c.DECODE_STEPS_LIMIT:
            out.append(f"--max-decode-steps must be in 1..{c.DECODE_STEPS_LIMIT}, got "
                       f"{self.max_decode_steps}")
        if self.max_decode_call_ms < 0:
            out.append(f"--max-decode-call-ms must be >= 0, got {self.max_decode_call_ms}")
        out += media_limit_problems(self.media_limits(), self.payload_limit)
        return out

    def media_limits(self) -> MediaLimits:
        """The image flags as router/http/media/ reads them."""
        return MediaLimits(
            max_images=self.max_images_per_request,
            max_image_bytes=self.max_image_bytes or self.payload_limit,
            max_image_pixels=self.max_image_pixels,
            allow_urls=self.allow_media_urls,
            allowed_domains=self.allowed_media_domains,
            fetch_timeout_s=self.media_fetch_timeout,
        )

    def infer_settings(self) -> InferSettings:
        """The inference core's share of these settings (the flags it takes, unchanged)."""
        return InferSettings(
            max_concurrent_requests=self.max_concurrent_requests,
            max_batch_prefill_tokens=self.max_batch_prefill_tokens,
            max_batch_total_tokens=self.max_batch_total_tokens,
            max_batch_size=self.max_batch_size,
            waiting_served_ratio=self.waiting_served_ratio,
            max_waiting_tokens=self.max_waiting_tokens,
            max_decode_steps=self.max_decode_steps,
            max_decode_call_ms=self.max_decode_call_ms,
            max_input_tokens=self.max_input_tokens,
            max_total_tokens=self.max_total_tokens,
            max_queue_size=self.max_queue_size,
            shard_step_timeout_s=self.shard_step_timeout,
            prefix_caching=self.prefix_caching,
        )

    @property
    def served_model_id(self) -> str:
        """The model's id, as /info reports it (TGI keeps the model id there)."""
        return self.model_id or self.tokenizer_name

    @property
    def openai_model_name(self) -> str:
        """The name in /v1/models and OpenAI responses: --served-model-name, else the id."""
        return self.served_model_name or self.served_model_id

    @property
    def shard_uri(self) -> str:
        """The target ShardClient.connect takes: "host:port" or "unix:///path"."""
        if self.master_shard_address:
            return self.master_shard_address
        path = self.master_shard_uds_path
        return path if path.startswith("unix:") else f"unix://{path}"

