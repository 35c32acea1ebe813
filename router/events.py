"""What the inference loop streams back for one request, in order.

A request yields at most one `Prefill`, then one `Token` per generated token, the last of which
is an `End` (a `Token` subclass carrying the finished text). Failures raise an `InferError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenInfo:
    id: int
    text: str
    logprob: float
    special: bool


@dataclass(slots=True)
class Prefill:
    """Prompt tokens with their logprobs (the first is NaN), when prefill logprobs were asked."""

    tokens: list[TokenInfo]


@dataclass(slots=True)
class Token:
    token: TokenInfo
    top_tokens: list[TokenInfo] = field(default_factory=list)


@dataclass(slots=True)
class End(Token):
    generated_text: str = ""
    # "length" | "eos_token" | "stop_sequence"
    finish_reason: str = "length"
    generated_tokens: int = 0
    seed: int | None = None
    # Monotonic timestamps (time.monotonic()) for the response headers and metrics.
    queued_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0


Event = Prefill | Token | End
