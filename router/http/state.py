"""AppState: everything a route handler needs, built once at start-up (no globals)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from pytgi_router.core.infer import Infer, ShardInfo
from pytgi_router.http.media.vision_model import ImageSupport
from pytgi_router.http.openai.chat_template import ChatTemplate
from pytgi_router.http.reasoning import ReasoningParser
from pytgi_router.http.validation import Validator
from pytgi_router.metrics import Metrics
from pytgi_router.settings import RouterSettings
from pytgi_router.tracing import Tracing


def package_version() -> str:
    try:
        return metadata.version("pytgi")
    except metadata.PackageNotFoundError:
        return "0.0.0"


@dataclass
class AppState:
    settings: RouterSettings
    infer: Infer
    info: ShardInfo
    validator: Validator
    metrics: Metrics
    chat_template: ChatTemplate | None
    # The reasoning parser every chat-shaped route splits its output with (None: no thinking
    # to split off): --reasoning-parser, or detected from the chat template at start-up.
    reasoning: ReasoningParser | None = None
    tracing: Tracing = field(default_factory=Tracing)
    # From the model's files (model_files.py): the resolved Hub revision, the pipeline tag.
    model_sha: str | None = None
    model_pipeline_tag: str | None = None
    # config.json's `architectures`, which SGLang's routers read from a worker's /model_info.
    architectures: tuple[str, ...] = ()
    # Whether the model takes images (router/http/media/vision_model.py): a text model's are
    # refused on the chat-shaped routes.
    images: ImageSupport = field(default_factory=ImageSupport)
    version: str = field(default_factory=package_version)
    # Set on SIGTERM: /health answers 503 (not ready) while every route still serves, for the
    # drain's grace period (--drain-grace-seconds), so that balancers stop sending first.
    not_ready: bool = False
    # Set when that grace ends: new requests answer 503 too while in-flight ones finish.
    draining: bool = False
    # HTTP requests currently being served by the generation routes.
    in_flight: int = 0
    started_at: float = field(default_factory=time.time)

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Counts a request in flight for the drain on shutdown."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    @property
    def model_id(self) -> str:
        """The name OpenAI clients see (/v1/models, chat and completions' `model`): the
        --served-model-name, else the model's id, which /info reports either way."""
        return self.settings.openai_model_name

    @property
    def system_fingerprint(self) -> str:
        return f"{self.version}-native"

    def info_json(self) -> dict[str, Any]:
        """TGI's /info, plus the batching limits TGI 2.x used to show (the KV budget as of the
        shards' latest Warmup: a restarted group may have sized its cache anew)."""
        s, i = self.settings, self.infer.info
        return {
            "model_id": s.served_model_id,
            "model_sha": self.model_sha,
            "model_dtype": i.dtype,
            "model_device_type": i.device_type,
            # pytgi's: TGI's launcher only logs it. null for float weights.
            "quantize": i.quantize or None,
            "model_pipeline_tag": self.model_pipeline_tag,
            "max_concurrent_requests": s.max_concurrent_requests,
            "max_best_of": s.max_best_of,
            "max_stop_sequences": s.max_stop_sequences,
            "max_input_tokens": i.max_input_tokens,
            "max_total_tokens": i.max_total_tokens,
            "validation_workers": s.validation_workers,
            "max_client_batch_size": s.max_client_batch_size,
            "waiting_served_ratio": s.waiting_served_ratio,
            "max_batch_total_tokens": i.max_batch_total_tokens,
            "max_batch_prefill_tokens": i.max_batch_prefill_tokens,
            "max_waiting_tokens": s.max_waiting_tokens,
            "max_batch_size": s.max_batch_size,
            # TGI's: drafts per sequence and decode step (the shards' --speculate), 0 when off.
            "speculate": i.speculate,
            # pytgi's: the LoRA adapters served (--lora-adapters and live loads), what
            # `adapter_id` may name; how many may be on the device at once (--max-loras), and
            # whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served.
            "lora_adapters": self.infer.adapters.names(),
            "max_loras": i.max_loras,
            "lora_runtime_updates": i.lora_runtime_updates,
            "router": "text-generation-router",
            "version": self.version,
            "sha": None,
            "docker_label": None,
        }
