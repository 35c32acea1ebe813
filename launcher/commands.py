"""The command lines and environments of the children, from the launcher's settings.

Children run as `python -m ...` with the launcher's own interpreter, so they are the installed
pytgi of this environment whatever PATH holds.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from pytgi_launcher.settings import LauncherSettings


def _opt(flag: str, value: object | None) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _switch(flag: str, on: bool) -> list[str]:
    return [flag] if on else []


def shard_argv(
    s: LauncherSettings,
    model_path: Path,
    rank: int,
    world_size: int,
    dtype: str,
    master_port: int | None = None,
    instance_id: str | None = None,
) -> list[str]:
    """`master_port`: the one resolved at launch (else --master-port, else the shard's default);
    `instance_id`: the launch's id, which the shard answers health checks for (readiness.py)."""
    return [
        sys.executable, "-m", "pytgi_shard.service.cli", "serve", str(model_path),
        "--rank", str(rank), "--world-size", str(world_size),
        "--master-addr", s.master_addr, *_opt("--master-port", master_port or s.master_port),
        "--uds-path", s.shard_base_path, "--dtype", dtype,
        *_opt("--quantize", s.quantize),
        *_opt("--kv-cache-dtype", s.kv_cache_dtype),
        *_opt("--speculate", s.speculate or None),
        *_opt("--speculator-model", s.speculator_model),
        *_opt("--lora-adapters", s.lora_adapters),
        *_opt("--max-loras", s.max_loras),
        *_opt("--max-cpu-loras", s.max_cpu_loras),
        *_opt("--max-lora-rank", s.max_lora_rank),
        *_switch("--enable-lora-runtime-updates", s.enable_lora_runtime_updates),
        *_opt("--instance-id", instance_id),
        "--cuda-memory-fraction", str(s.cuda_memory_fraction),
        *_switch("--trust-remote-code", s.trust_remote_code),
        *_opt("--attention", s.attention),
        *_switch("--disable-custom-kernels", s.disable_custom_kernels),
        *_opt("--rope-scaling", s.rope_scaling),
        *_opt("--rope-factor", s.rope_factor),
        *_opt("--cuda-graphs", s.cuda_graphs),
        *_opt("--cpu-graphs", s.cpu_graphs),
        *_opt("--grammar-cache-bytes", s.grammar_cache_bytes),
        *_opt("--watermark-gamma", s.watermark_gamma),
        *_opt("--watermark-delta", s.watermark_delta),
        *_switch("--json-output", s.json_output),
        *_opt("--otlp-endpoint", s.otlp_endpoint),
        *_opt("--otlp-service-name", s.otlp_service_name),
        *_opt("--step-timeline", s.step_timeline),
    ]


def shard_env(
    s: LauncherSettings,
    environ: Mapping[str, str],
    rank: int,
    world_size: int,
    master_port: int | None = None,
) -> dict[str, str]:
    """TGI's per-shard variables; the flags carry the same values, these serve code that reads
    the environment (torch.distributed, NCCL). The shard token goes here, not in argv."""
    # The API key is the router's alone: a shard has no use for it in its environment.
    env = {k: v for k, v in environ.items() if k not in ("LOG_LEVEL", "API_KEY")}
    port = master_port or s.master_port
    if port is not None:
        env["MASTER_PORT"] = str(port)
    if s.shard_token is not None:
        env["SHARD_TOKEN"] = s.shard_token
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "MASTER_ADDR": s.master_addr,
        "CUDA_MEMORY_FRACTION": str(s.cuda_memory_fraction),
        "TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def router_argv(s: LauncherSettings, model_path: Path) -> list[str]:
    return [
        sys.executable, "-m", "pytgi_router.cli",
        "--master-shard-uds-path", s.shard_socket(0),
        "--tokenizer-name", str(model_path),
        "--model-id", s.model_id,
        *_opt("--served-model-name", s.served_model_name),
        "--hostname", s.hostname, "--port", str(s.port),
        "--max-concurrent-requests", str(s.max_concurrent_requests),
        "--max-best-of", str(s.max_best_of),
        "--max-stop-sequences", str(s.max_stop_sequences),
        "--max-top-n-tokens", str(s.max_top_n_tokens),
        "--waiting-served-ratio", str(s.waiting_served_ratio),
        "--max-waiting-tokens", str(s.max_waiting_tokens),
        "--max-decode-steps", str(s.max_decode_steps),
        "--max-decode-call-ms", str(s.max_decode_call_ms),
        "--prefix-caching", "true" if s.prefix_caching else "false",
        "--max-client-batch-size", str(s.max_client_batch_size),
        "--payload-limit", str(s.payload_limit),
        "--max-connections", str(s.max_connections),
        "--validation-workers", str(s.validation_workers),
        "--max-grammar-bytes", str(s.max_grammar_bytes),
        "--responses-store-bytes", str(s.responses_store_bytes),
        "--graceful-termination-timeout", str(s.graceful_termination_timeout),
        "--drain-grace-seconds", str(s.drain_grace_seconds),
        *_opt("--max-input-tokens", s.max_input_tokens),
        *_opt("--max-total-tokens", s.max_total_tokens),
        *_opt("--max-batch-prefill-tokens", s.max_batch_prefill_tokens),
        *_opt("--max-batch-total-tokens", s.max_batch_total_tokens),
        *_opt("--max-batch-size", s.max_batch_size),
        *_opt("--max-queue-size", s.max_queue_size),
        *_opt("--tokenizer-config-path", s.tokenizer_config_path),
        *_opt("--reasoning-parser", s.reasoning_parser),
        *_opt("--max-images-per-request", s.max_images_per_request),
        *_opt("--max-image-bytes", s.max_image_bytes),
        *_opt("--max-image-pixels", s.max_image_pixels),
        *_opt("--media-fetch-timeout", s.media_fetch_timeout),
        *_switch("--allow-media-urls", s.allow_media_urls),
        *_opt("--allowed-media-domains", ",".join(s.allowed_media_domains) or None),
        *_switch("--disable-grammar-support", s.disable_grammar_support),
        *_switch("--json-output", s.json_output),
        *_opt("--otlp-endpoint", s.otlp_endpoint),
        *_opt("--otlp-service-name", s.otlp_service_name),
        *[arg for origin in s.cors_allow_origin for arg in ("--cors-allow-origin", origin)],
    ]


def router_env(
    s: LauncherSettings, environ: Mapping[str, str], compute_type: str
) -> dict[str, str]:
    env = dict(environ)
    env["PYTHONUNBUFFERED"] = "1"
    if s.shard_token is not None:
        env["SHARD_TOKEN"] = s.shard_token
    if s.api_key is not None:
        # Through the environment rather than argv, where `ps` would show it to every user.
        env["API_KEY"] = s.api_key
    # The x-compute-type header: TGI's "<num_shard>-<gpu name>" unless the user set one.
    env.setdefault("COMPUTE_TYPE", compute_type)
    return env
