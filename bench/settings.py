"""Typed settings of one load run of `pytgi-benchmark run`, parsed once from the command line."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

APIS = ("tgi", "openai-chat", "openai-completions")
SLO_METRICS = ("ttft", "tpot", "e2el")
HTTP_CLIENTS = ("raw", "httpx")


@dataclass(slots=True, frozen=True)
class LengthRange:
    """Token lengths drawn uniformly from [low, high): "32" is exactly 32, "16:64" is U[16, 64)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        try:
            if ":" in text:
                low_text, high_text = text.split(":", 1)
                low, high = int(low_text), int(high_text)
            else:
                low = int(text)
                high = low + 1
        except ValueError:
            raise ValueError(f"length must be N or LOW:HIGH, got {text!r}") from None
        if low < 1 or high <= low:
            raise ValueError(f"length range must satisfy 1 <= LOW < HIGH, got {text!r}")
        return cls(low, high)

    @property
    def fixed(self) -> bool:
        return self.high == self.low + 1

    def sample(self, rng: random.Random) -> int:
        return self.low if self.fixed else rng.randrange(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.fixed else f"{self.low}:{self.high}"


def parse_slo(items: list[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO must be one of {'/'.join(SLO_METRICS)}:MS, got {item!r}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO value must be milliseconds, got {item!r}") from None
        if slo[name] <= 0:
            raise ValueError(f"goodput SLO must be positive, got {item!r}")
    return slo


@dataclass(slots=True)
class LoadSettings:
    url: str
    api: str = "tgi"
    # The `model` field of OpenAI requests; TGI ignores it unless it names a LoRA adapter.
    model: str = "tgi"
    input_len: LengthRange = field(default_factory=lambda: LengthRange(32, 33))
    output_len: LengthRange = field(default_factory=lambda: LengthRange(64, 65))
    prompts_file: Path | None = None
    # A local tokenizer.json (or model directory) to align synthetic prompts without /tokenize.
    tokenizer: Path | None = None
    num_requests: int = 64
    # When set, requests keep coming until this many seconds passed (num_requests is the pool).
    duration_s: float | None = None
    # Closed loop: at most this many requests in flight; None means no cap.
    concurrency: int | None = None
    # Open loop: Poisson arrivals at this many requests/s; inf sends everything at once.
    request_rate: float = math.inf
    warmup: int = 1
    seed: int = 0
    # Sends the non-TGI `ignore_eos` extension (vLLM, pytgi) so output lengths are exact.
    ignore_eos: bool = False
    slo_ms: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 600.0
    progress: bool = True
    api_key: str | None = None
    # "raw": the lean HTTP/1.1 streaming client (http:// only); "httpx" for everything else.
    http_client: str = "raw"

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"--api must be one of {', '.join(APIS)}, got {self.api!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        self.url = self.url.rstrip("/")
        if self.http_client not in HTTP_CLIENTS:
            raise ValueError(f"--http-client must be one of {', '.join(HTTP_CLIENTS)}")
        if self.num_requests < 1:
            raise ValueError("--num-requests must be at least 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be positive (inf sends all at once)")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("--duration must be positive")
        if (
            self.duration_s is not None
            and self.concurrency is None
            and math.isinf(self.request_rate)
        ):
            raise ValueError("--duration needs --concurrency or a finite --request-rate")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")
