"""The request inside the inference core: what it asks (`ValidRequest`, what the HTTP layer
hands over once validated) and where it is (`Entry`, from submission to its end)."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry.trace import SpanContext

from pytgi_proto import generate_pb2
from pytgi_router.core.request_stream import RequestStream


@dataclass(slots=True)
class SamplingParameters:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False
    # "" or a regex / JSON-schema string; grammar_type follows the proto enum (0 none, 1 json, 2 regex).
    grammar: str = ""
    grammar_type: int = 0


@dataclass(slots=True)
class StoppingParameters:
    max_new_tokens: int
    stop_sequences: list[str] = field(default_factory=list)
    ignore_eos_token: bool = False


@dataclass(slots=True)
class ValidRequest:
    """A request that passed validation: tokenized once, every limit checked."""

    inputs: str
    input_ids: list[int]
    truncate: int
    sampling: SamplingParameters
    stopping: StoppingParameters
    top_n_tokens: int = 0
    prefill_logprobs: bool = False
    add_special_tokens: bool = True

    @property
    def input_length(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True, eq=False)
class Entry:
    """A request from submission to its end: in the queue, then in the running batch."""

    id: int
    request: ValidRequest
    stream: RequestStream
    # The wire form, built at submission; its blocks are filled in at admission.
    pb: generate_pb2.Request
    # Set when the entry is admitted into a batch; None again once freed.
    blocks: list[int] | None = None
    # time.monotonic() of the prefill that started it.
    started_at: float = 0.0
    # Until it finishes, fails or is cancelled, the entry holds one max_concurrent_requests permit.
    holds_permit: bool = True
    # The span current at submission (the HTTP request's), linked from the batch's prefill span.
    trace_context: SpanContext | None = None

    @property
    def queued_at(self) -> float:
        return self.stream.queued_at

    @property
    def total_tokens(self) -> int:
        """Prompt plus every token it may generate: what its KV blocks must hold."""
        return len(self.request.input_ids) + self.request.stopping.max_new_tokens
