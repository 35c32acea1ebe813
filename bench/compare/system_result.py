"""What one system under comparison produced: wall times per repetition, tokens, or why it is N/A."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class SystemResult:
    system: str
    description: str
    # "ok", or "n/a" (the system refused this setup; `error` says why) or "error" (it broke).
    status: str = "ok"
    error: str | None = None
    # Seconds per timed repetition, first request sent -> last token received.
    wall_s: list[float] = field(default_factory=list)
    # Output tokens per repetition; every system must produce requests x new tokens.
    output_tokens: list[int] = field(default_factory=list)
    startup_s: float | None = None
    # System-specific numbers (latency percentiles of the HTTP run, knobs used).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.wall_s)

    @property
    def median_wall_s(self) -> float:
        return statistics.median(self.wall_s) if self.wall_s else float("nan")

    @property
    def tokens_per_s(self) -> float:
        if not self.ok:
            return float("nan")
        return statistics.median(
            t / w for t, w in zip(self.output_tokens, self.wall_s, strict=True)
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["median_wall_s"] = self.median_wall_s if self.ok else None
        data["tokens_per_s"] = self.tokens_per_s if self.ok else None
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SystemResult:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**fields)

    @classmethod
    def not_available(cls, system: str, description: str, error: str) -> SystemResult:
        return cls(system, description, status="n/a", error=error)
