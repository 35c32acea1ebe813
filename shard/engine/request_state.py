"""One request inside a shard's batch, and what the shard knows that every batch must respect.

`RequestState` is a request's per-step Python state (its stopping criteria, its text so far,
where this step's chunk lies in its sequence, its drafter); `Batch` (shard/engine/batch.py) holds
the flat device tensors of all of them. `BatchContext` is the shard's side: the device, the KV
cache's geometry, the vocabulary, and what a batch may ask of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.engine.drafting import DraftState
from pytgi_shard.engine.request_media import RequestMedia, request_media
from pytgi_shard.engine.request_validation import chunk_end, validate_request
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.models.media_inputs import ImageLayout
from pytgi_shard.output.detokenizer import TextStream
from pytgi_shard.output.stopping import StoppingCriteria
from pytgi_shard.sample.chooser import SamplingParams, Watermark
from pytgi_shard.structured_output.compiler import GrammarCompiler


@dataclass(frozen=True, slots=True)
class BatchContext:
    """What the shard knows that a batch must respect: the device, the KV cache, the vocabulary."""

    device: torch.device
    block_size: int
    num_blocks: int
    vocab_size: int
    eos_ids: frozenset[int]
    watermark: Watermark
    # Compiles constrained requests' grammars; None: this shard refuses them.
    grammars: GrammarCompiler | None = None
    # --speculate: the eligible requests keep an n-gram index (shard/engine/drafting.py).
    speculate: int = 0
    # The wire indices of the LoRA adapters loaded (AdapterSet.loaded): what adapter_index may name.
    loaded_adapters: frozenset[int] = frozenset()
    # The model's reading of wire images (Model.image_layout); None: images are refused.
    image_layout: ImageLayout | None = None


@dataclass(slots=True)
class RequestState:
    id: int
    # len(input_ids): the sequence is the prompt, then generated_ids, then what this shard adds.
    prompt_length: int
    blocks: list[int]
    top_n_tokens: int
    prefill_logprobs: bool
    stopping: StoppingCriteria
    text: TextStream
    # Reported in GeneratedText only when the request samples.
    seed: int | None
    # This step computes tokens [cache_len, chunk_end) of the sequence's sequence_length.
    cache_len: int
    chunk_end: int
    sequence_length: int
    # How many generated_ids the router sent (a request resumed after preemption).
    resumed: int
    # An encoder-decoder's prompt length: its blocks hold the prompt's cross-attention K/V
    # first, then this sequence's (the decoder's) tokens (shard/engine/encoder_decoder_batch.py).
    encoder_length: int = 0
    # Its n-gram drafter when it may draft (--speculate, shard/engine/drafting.py), else None.
    draft: DraftState | None = None
    # Its LoRA adapter: 0 the base model, i the shard's adapter i (Info.lora_adapters[i - 1]).
    adapter_index: int = 0
    # The device slot holding that adapter's weights, which the forward's rows read (0: base):
    # set by AdapterSet.place when the request joins (shard/lora/residency.py).
    adapter_slot: int = 0
    # Its images (a vision-language model's; shard/engine/request_media.py), else None.
    media: RequestMedia | None = None

    @property
    def length(self) -> int:
        """Tokens known so far: the prompt and every generated token."""
        return self.prompt_length + self.text.generated

    @property
    def complete(self) -> bool:
        """Whether this step's chunk ends the sequence (the request samples its next token)."""
        return self.chunk_end == self.sequence_length


def request_state(
    pb: generate_pb2.Request, sequence: list[int], params: SamplingParams, ctx: BatchContext
) -> RequestState:
    """A request of the router's Batch as this shard runs it, validated against the cache and
    the vocabulary (InvalidRequest otherwise)."""
    stop = pb.stopping_parameters
    validate_request(pb, sequence, ctx.vocab_size, ctx.block_size, ctx.num_blocks)
    if pb.adapter_index and pb.adapter_index not in ctx.loaded_adapters:
        raise InvalidRequest(f"request {pb.id}: adapter_index {pb.adapter_index} names no "
                             f"loaded LoRA adapter ({len(ctx.loaded_adapters)} loaded)")
    eos = () if stop.ignore_eos_token else ctx.eos_ids
    stopping = StoppingCriteria(stop.max_new_tokens, eos, list(stop.stop_sequences))
    stopping.generated = len(pb.generated_ids)
    return RequestState(
        id=pb.id,
        prompt_length=len(pb.input_ids),
        blocks=list(pb.blocks),
        top_n_tokens=min(pb.top_n_tokens, ctx.vocab_size),
        prefill_logprobs=pb.prefill_logprobs,
        stopping=stopping,
        text=TextStream.start(pb.input_ids, pb.generated_ids),
        seed=params.seed if params.samples else None,
        cache_len=pb.cache_len,
        chunk_end=chunk_end(pb, len(sequence)),
        sequence_length=len(sequence),
        resumed=len(pb.generated_ids),
        adapter_index=pb.adapter_index,
        media=request_media(pb, ctx.image_layout),
    )
