"""LauncherSettings: everything `pytgi-launcher` is configured with, built once by the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pytgi_proto import contracts as c
from pytgi_proto.contracts import (
    DEFAULT_UDS_PATH,
    DTYPES,
    TGI_HTTP_PORT,
    shard_socket,
    token_limit_problems,
)
from pytgi_router.http.media.limits import MediaLimits, media_limit_problems
from pytgi_router.http.reasoning.registry import NO_PARSER, PARSER_NAMES
from pytgi_shard.settings import (
    KV_CACHE_DTYPES,
    SPECULATE_MAX,
    kernel_problems,
    parse_cuda_graphs,
    rope_problems,
)

# The model bundled with the package: a small Llama trained on Shakespeare (see its TRAINING.md).
DEMO_MODEL = Path(__file__).resolve().parent / "demo_model"
# Shard r listens on `{base}-{r}`: TGI's base name (DEFAULT_UDS_PATH) for TGI's HTTP port
# (3000), so TGI's tools find rank 0; another --port gets `{base}-{port}` (shard_base_path), so two
# instances on one host, which cannot share an HTTP port, never share a socket either.


@dataclass(frozen=True, slots=True)
class LauncherSettings:
    model_id: str = str(DEMO_MODEL)
    revision: str | None = None
    # Resolved by `num_shards()` (TGI's find_num_shards) from these two and the visible GPUs.
    num_shard: int | None = None
    sharded: bool | None = None
    # The name in /v1/models and OpenAI responses' `model`; None: model_id (/info keeps model_id).
    served_model_name: str | None = None
    # None: bfloat16 on GPU, float32 on CPU.
    dtype: str | None = None
    # TGI's --quantize (checked by its parser, quantization/method.py); None: the checkpoint's.
    quantize: str | None = None
    # TGI's --kv-cache-dtype: an FP8 format for the shards' KV cache; None: the model's dtype.
    kv_cache_dtype: str | None = None
    # TGI's --speculate: n-gram drafts per sequence and decode step; 0: off.
    speculate: int = 0
    # A draft model's directory (--speculator-model): the shards draft with it; None: n-gram.
    speculator_model: str | None = None
    # TGI's --lora-adapters: `id`, `name=id` or `name=path`, comma-separated; the shards load them.
    lora_adapters: str | None = None
    # LoRA device slots and their rank (the shards' --max-loras, --max-lora-rank; None: theirs),
    # and live loading (the router serves /v1/load_lora_adapter when the shards do).
    max_loras: int | None = None
    max_lora_rank: int | None = None
    # Adapters kept in host memory (the shards' --max-cpu-loras; None: every loaded one).
    max_cpu_loras: int | None = None
    enable_lora_runtime_updates: bool = False
    trust_remote_code: bool = False
    # Router limits and batching (TGI's defaults; None = decided by the shards' warmup).
    max_concurrent_requests: int = c.MAX_CONCURRENT_REQUESTS
    max_best_of: int = c.MAX_BEST_OF
    max_stop_sequences: int = c.MAX_STOP_SEQUENCES
    max_top_n_tokens: int = c.MAX_TOP_N_TOKENS
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    waiting_served_ratio: float = c.WAITING_SERVED_RATIO
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    max_waiting_tokens: int = c.MAX_WAITING_TOKENS
    max_decode_steps: int = c.MAX_DECODE_STEPS
    max_decode_call_ms: int = c.MAX_DECODE_CALL_MS
    max_batch_size: int | None = None
    max_queue_size: int | None = None
    # The router reuses the KV of prompt prefixes already computed (TGI's PREFIX_CACHING).
    prefix_caching: bool = True
    max_client_batch_size: int = c.MAX_CLIENT_BATCH_SIZE
    payload_limit: int = c.PAYLOAD_LIMIT
    max_connections: int = 1024
    validation_workers: int = 2
    disable_grammar_support: bool = False
    # The router's longest grammar, and the shards' grammar cache (None: the shard's default).
    max_grammar_bytes: int = c.MAX_GRAMMAR_BYTES
    grammar_cache_bytes: int | None = None
    responses_store_bytes: int = c.RESPONSES_STORE_BYTES
    # The router's image limits and URL fetching policy (router/http/media/; its defaults).
    max_images_per_request: int | None = None
    max_image_bytes: int | None = None
    max_image_pixels: int | None = None
    allow_media_urls: bool = False
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout: float | None = None
    # The router's reasoning parser (None: detected from the chat template; "none": off).
    reasoning_parser: str | None = None
    tokenizer_config_path: str | None = None
    # HTTP.
    hostname: str = "0.0.0.0"
    port: int = TGI_HTTP_PORT
    cors_allow_origin: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    # Shards. None: derived from --port (shard_base_path); a free port picked at launch.
    shard_uds_path: str | None = None
    master_addr: str = "localhost"
    master_port: int | None = None
    # Shared secret of the shards' gRPC (passed to shards and router through SHARD_TOKEN).
    shard_token: str | None = field(default=None, repr=False)
    cuda_memory_fraction: float = 1.0
    attention: str | None = None
    # TGI's --disable-custom-kernels: the shards run plain PyTorch (reference attention included).
    disable_custom_kernels: bool = False
    # TGI's --rope-scaling / --rope-factor, replacing the model's rope_scaling in every shard.
    rope_scaling: str | None = None
    rope_factor: float | None = None
    # TGI's comma list of decode batch sizes for CUDA graphs, passed to the shards; None: theirs.
    cuda_graphs: str | None = None
    # The CPU counterpart: decode batch sizes compiled on CPU shards; None: eager.
    cpu_graphs: str | None = None
    watermark_gamma: float | None = None
    watermark_delta: float | None = None
    # Weights.
    huggingface_hub_cache: str | None = None
    weights_cache_override: str | None = None
    # Observability.
    json_output: bool = False
    otlp_endpoint: str | None = None
    # None: the router reports as pytgi.router and the shards as pytgi.shard; set, both use it.
    otlp_service_name: str | None = None
    # Rank 0's JSON-lines file of each engine step's phases (shard/engine/step_timeline.py).
    step_timeline: str | None = None
    # Supervision.
    shard_startup_timeout: float = 600.0
    # Times the shard group is restarted after a shard dies (0: any death stops all, as TGI).
    max_shard_restarts: int = 3
    graceful_termination_timeout: float = 90.0
    # The router's not-ready period after SIGTERM, before it stops admitting (its own flag).
    drain_grace_seconds: float = 5.0
    env: bool = False

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _problems(self) -> list[str]:
        out: list[str] = []
        if not self.model_id:
            out.append("--model-id must not be empty")
        if self.num_shard is not None and self.num_shard < 1:
            out.append(f"--num-shard must be >= 1, got {self.num_shard}")
        if self.sharded is True and self.num_shard is not None and self.num_shard <= 1:
            out.append(f"--sharded true needs --num-shard > 1, got {self.num_shard}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            out.append("--served-model-name must not be empty")
        if self.dtype is not None and self.dtype not in DTYPES:
            out.append(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            out.append(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                       f"{self.kv_cache_dtype}")
        if not 0 <= self.speculate <= SPECULATE_MAX:
            out.append(f"--speculate must be in 0..{SPECULATE_MAX}, got {self.speculate}")
        if self.speculator_model is not None and not self.speculate:
            out.append("--speculator-model drafts --speculate N tokens per sequence and step: "
                       f"give --speculate N (1..{SPECULATE_MAX})")
        positive = {
            "max-concurrent-requests": self.max_concurrent_requests,
            "max-best-of": self.max_best_of,
            "max-client-batch-size": self.max_client_batch_size,
            "payload-limit": self.payload_limit,
            "max-connections": self.max_connections,
            "validation-workers": self.validation_workers,
            "max-grammar-bytes": self.max_grammar_bytes,
            "grammar-cache-bytes": self.grammar_cache_bytes,
            "max-batch-prefill-tokens": self.max_batch_prefill_tokens,
            "max-input-tokens": self.max_input_tokens,
            "max-total-tokens": self.max_total_tokens,
            "max-batch-total-tokens": self.max_batch_total_tokens,
            "max-batch-size": self.max_batch_size,
        }
        out += [f"--{k} must be > 0, got {v}" for k, v in positive.items() if v is not None and v <= 0]
        if not 1 <= self.max_decode_steps <= c.DECODE_STEPS_LIMIT:
            out.append(f"--max-decode-steps must be in 1..{c.DECODE_STEPS_LIMIT}, got "
                       f"{self.max_decode_steps}")
        if self.max_decode_call_ms < 0:
            out.append(f"--max-decode-call-ms must be >= 0, got {self.max_decode_call_ms}")
        if self.max_stop_sequences < 0 or self.max_top_n_tokens < 0 or self.max_waiting_tokens < 0:
            out.append("--max-stop-sequences, --max-top-n-tokens, --max-waiting-tokens must be >= 0")
        if self.reasoning_parser not in (None, NO_PARSER, *PARSER_NAMES):
            out.append(f"--reasoning-parser must be one of {', '.join(PARSER_NAMES)} or "
                       f"{NO_PARSER}, got {self.reasoning_parser!r}")
        if self.responses_store_bytes < 0:
            out.append(f"--responses-store-bytes must be >= 0, got {self.responses_store_bytes}")
        out += token_limit_problems(
            self.max_input_tokens, self.max_total_tokens, self.max_batch_total_tokens
        )
        for name, port in (("port", self.port), ("master-port", self.master_port)):
            if port is not None and not 0 < port < 65536:
                out.append(f"--{name} must be in 1..65535, got {port}")
        if not 0.0 < self.cuda_memory_fraction <= 1.0:
            out.append(f"--cuda-memory-fraction must be in (0, 1], got {self.cuda_memory_fraction}")
        if self.cuda_graphs is not None:
            try:
                parse_cuda_graphs(self.cuda_graphs)
            except ValueError as e:
                out.append(str(e))
        if self.cpu_graphs is not None:
            try:
                parse_cuda_graphs(self.cpu_graphs, "--cpu-graphs")
            except ValueError as e:
                out.append(str(e))
        out += rope_problems(self.rope_scaling, self.rope_factor)
        out += kernel_problems(self.disable_custom_kernels, self.attention)
        if self.shard_token is not None and not self.shard_token:
            out.append("--shard-token must not be empty")
        if self.max_shard_restarts < 0:
            out.append(f"--max-shard-restarts must be >= 0, got {self.max_shard_restarts}")
        if self.shard_startup_timeout <= 0:
            out.append("--shard-startup-timeout must be > 0")
        if self.graceful_termination_timeout < 0:
            out.append("--graceful-termination-timeout must be >= 0")
        if not self.drain_grace_seconds >= 0:
            out.append(f"--drain-grace-seconds must be >= 0, got {self.drain_grace_seconds}")
        out += media_limit_problems(self._media_limits(), self.payload_limit)
        return out

    def _media_limits(self) -> MediaLimits:
        """The router's image limits these flags make (its defaults where unset)."""
        default = MediaLimits()
        return MediaLimits(
            max_images=_given(self.max_images_per_request, default.max_images),
            max_image_bytes=self.max_image_bytes or self.payload_limit,
            max_image_pixels=_given(self.max_image_pixels, default.max_image_pixels),
            allow_urls=self.allow_media_urls,
            allowed_domains=self.allowed_media_domains,
            fetch_timeout_s=_given(self.media_fetch_timeout, default.fetch_timeout_s),
        )

    def num_shards(self, visible_gpus: int) -> int:
        """TGI's find_num_shards: the flags first, then the visible GPU count, then 1."""
        if self.sharded is False:
            return self.num_shard or 1
        if self.num_shard is not None:
            return self.num_shard
        if self.sharded is True and visible_gpus <= 1:
            raise ValueError(
                f"--sharded true needs more than one visible GPU ({visible_gpus} visible): "
                "give --num-shard N to shard on CPU"
            )
        return max(visible_gpus, 1)

    def resolved_dtype(self, on_gpu: bool) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if on_gpu else "float32"

    @property
    def shard_base_path(self) -> str:
        """--shard-uds-path, else TGI's base name on port 3000 and `{base}-{port}` elsewhere."""
        if self.shard_uds_path is not None:
            return self.shard_uds_path
        if self.port == TGI_HTTP_PORT:
            return DEFAULT_UDS_PATH
        return f"{DEFAULT_UDS_PATH}-{self.port}"

    def shard_socket(self, rank: int) -> str:
        return shard_socket(self.shard_base_path, rank)


T = TypeVar("T")


def _given(value: T | None, default: T) -> T:
    """A flag's value, or the router's default when the flag was not given."""
    return default if value is None else value
