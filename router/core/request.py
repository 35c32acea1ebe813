"""The request inside the inference core: what it asks (`ValidRequest`, what the HTTP layer
hands over once validated) and where it is (`Entry`, from submission to its end)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from opentelemetry.trace import SpanContext

from pytgi_proto import generate_pb2
from pytgi_router.core.prefix_cache import media_keyed, span_keyed
from pytgi_router.core.request_stream import RequestStream, TokenInfo


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
    # The wire's own message (pytgi_proto.parameters.neutral_sampling builds one): the router
    # and the shards share one sampling type, declared in generate.proto and parameters.py.
    sampling: generate_pb2.NextTokenChooserParameters
    stopping: StoppingParameters
    top_n_tokens: int = 0
    prefill_logprobs: bool = False
    add_special_tokens: bool = True
    # The LoRA adapter it runs under: 0 the base model, i > 0 the shards' lora_adapters[i - 1].
    adapter_index: int = 0
    # That adapter's load key (core/lora_adapters.py), which the prefix cache keys its blocks by:
    # unique per load, so an adapter loaded later under the same name or index never shares them.
    adapter_key: int = 0
    # That adapter's name ("" for the base model): the per-adapter metrics' label.
    adapter_name: str = ""
    # Its images (a vision-language model's prompt), as the wire carries them.
    images: tuple[generate_pb2.Image, ...] = ()
    # Prompt spans [lo, hi) the model attends bidirectionally (PaliGemma's prompt, Gemma 3's
    # images; media/families.py PromptImages.attention): never split across prefill chunks
    # (step_plan.py), and keyed in the prefix cache by their whole content (key_tokens).
    noncausal_spans: tuple[tuple[int, int], ...] = ()

    @property
    def input_length(self) -> int:
        return len(self.input_ids)


class EntryState(Enum):
    """Where an entry is: in the queue, admitted with its prompt partly computed (not in the
    shards' batch: each step sends its next chunk), or in the shards' batch, generating."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"


@dataclass(slots=True, eq=False)
class Entry:
    """A request from submission to its end: queued, prefilling, running (and queued again if
    it is preempted, until it runs again)."""

    id: int
    request: ValidRequest
    stream: RequestStream
    # The wire form, built at submission; each admission fills in its blocks, cache_len and
    # chunk_len, a preemption its generated_ids.
    pb: generate_pb2.Request
    # The sequence: the prompt's ids, then each generated id as its step streams it. What the
    # prefix cache keys its blocks by, and what a preempted request resumes with.
    tokens: list[int] = field(default_factory=list)
    # Leading tokens of `tokens` whose KV its blocks hold (the next chunk's cache_len).
    computed: int = 0
    state: EntryState = EntryState.WAITING
    # Rank of its first admission (None before): preemption takes the newest first, and a
    # preempted request keeps its rank, so it is not the first victim again when it resumes.
    order: int | None = None
    # Blocks in its table (router side), and how many of them the shards' batch knows (the rest
    # go out as BlockGrants with the next step).
    blocks_held: int = 0
    blocks_sent: int = 0
    # Prompt logprobs of its chunks so far, streamed as one Prefill event when the prompt is done.
    prefill_infos: list[TokenInfo] = field(default_factory=list)
    prefill_sent: bool = False
    # time.monotonic() of its first admission.
    started_at: float = 0.0
    # Until it finishes, fails or is cancelled, the entry holds one max_concurrent_requests permit.
    holds_permit: bool = True
    # The span current at submission (the HTTP request's), linked from the batch's prefill span.
    trace_context: SpanContext | None = None
    # Its prompt as the prefix cache keys it, made once when it has images (key_tokens).
    keyed_prompt: list[int] | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.input_ids)

    @property
    def queued_at(self) -> float:
        return self.stream.queued_at

    @property
    def total_tokens(self) -> int:
        """Prompt plus every token it may generate: the most KV it can ever need (plus one)."""
        return len(self.request.input_ids) + self.request.stopping.max_new_tokens

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.request.input_ids):]

    @property
    def key_tokens(self) -> list[int]:
        """`tokens` as the prefix cache keys them: `tokens` itself without images; with images,
        each image's tokens stand for its content hash (prefix_cache.media_keyed), so the same
        text with another image never shares KV blocks, and the same image and text do."""
        images = self.request.images
        spans = self.request.noncausal_spans
        if not images and not spans:
            return self.tokens
        if self.keyed_prompt is None:
            keyed = media_keyed(self.request.input_ids,
                                [(i.token_offset, i.token_count, i.content_hash) for i in images])
            self.keyed_prompt = span_keyed(keyed, spans)
        return self.keyed_prompt + self.tokens[len(self.keyed_prompt):]
