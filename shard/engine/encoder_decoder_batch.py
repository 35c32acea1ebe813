"""An encoder-decoder's requests on the shard: the router's batch turned into its decoder's, and
the step inputs that place the decoder's K/V after the prompt's cross-attention K/V.

The router treats an encoder-decoder request like any other: a sequence of prompt then generated
tokens, KV blocks for its known tokens plus one, no chunks and no cached prefix (the shard says
so in Info). On the shard the request's sequence is its decoder's: the decoder start token, then
the generated tokens, so that sampling (the penalties read the decoder's tokens, as transformers'
generate does), stopping, the incremental text (its context is the start token, as TGI's
seq2seq) and the prompt logprobs (the start token alone, with NaN: nothing predicts it; TGI
returns no encoder tokens either) all run the decoder-only code as is. The prompt is kept only
as its length (RequestState.encoder_length): the Prefill encodes it once and writes each decoder
layer's cross-attention K/V into the request's first encoder_length slots; decoder position d
lives at table position encoder_length + d (attention/encoder_decoder.py).

Counted in tokens, the blocks the router holds for a request are then exactly what it uses:
P + n + 1 slots for P prompt tokens and n generated ones (P cross-attention, the start token and
each fed-back generated token). Only one slot is missing, at the very last step, which feeds a
token whose K/V no later step reads: its K/V go to the scratch block (the model attends to it
from the forward's own tensors). Any other missing slot is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.attention.encoder_decoder import EncoderDecoderMetadata, EncoderInputs, table_slots
from pytgi_shard.attention.kv_cache import SCRATCH_SLOT
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.request_state import BatchContext, RequestState
from pytgi_shard.engine.step_inputs import ForwardInputs
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.models.encoder_decoder_model import EncoderDecoderModel
from pytgi_shard.models.model import Model


@dataclass(frozen=True, slots=True)
class Encoding:
    """A Prefill's newcomers as an encoder-decoder runs them: their prompts to encode, and where
    their decoder tokens' K/V go (after the prompts' slots)."""

    encoder: EncoderInputs
    # [newcomers] int64: each prompt's length.
    lengths: torch.Tensor
    # [decoder tokens] int64: the slot of each newcomer's decoder token, in the flat order.
    decoder_slots: torch.Tensor


def new_batch(
    pb: generate_pb2.Batch, ctx: BatchContext, model: Model
) -> tuple[Batch, Encoding | None]:
    """A Prefill's newcomers: Batch.from_pb, or for an encoder-decoder its decoder's batch with
    the prompts to encode."""
    if isinstance(model, EncoderDecoderModel):
        return encoder_decoder_batch(pb, ctx, model.decoder_start_token_id)
    return Batch.from_pb(pb, ctx), None


def encoder_decoder_batch(
    pb: generate_pb2.Batch, ctx: BatchContext, decoder_start: int
) -> tuple[Batch, Encoding]:
    """The decoder's batch of the router's `pb` (each request's sequence: `decoder_start`, then
    its generated_ids) and what the Prefill encodes."""
    for r in pb.requests:
        _check_prompt(r, ctx.vocab_size)
    decoder_pb = generate_pb2.Batch()
    decoder_pb.CopyFrom(pb)
    for r in decoder_pb.requests:
        r.input_ids[:] = [decoder_start]
        r.ClearField("cache_len")
        r.ClearField("chunk_len")
        r.ClearField("slots")
    batch = Batch.from_pb(decoder_pb, ctx)
    for state, r in zip(batch.requests, pb.requests, strict=True):
        state.encoder_length = len(r.input_ids)
    held = check_slots(batch.requests, ctx.block_size)
    prompts = [list(r.input_ids) for r in pb.requests]
    cross: list[int] = []
    decoder: list[int] = []
    for state, prompt, capacity in zip(batch.requests, prompts, held, strict=True):
        cross.extend(_slots(state.blocks, range(len(prompt)), capacity, ctx.block_size))
        table = range(len(prompt), len(prompt) + state.length)
        decoder.extend(_slots(state.blocks, table, capacity, ctx.block_size))
    lengths = [len(p) for p in prompts]

    def tensor(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(ctx.device)

    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    encoder = EncoderInputs(
        input_ids=tensor([t for p in prompts for t in p]),
        cu_seqlens=tensor(cu),
        max_length=max(lengths),
        cross_slots=tensor(cross),
    )
    return batch, Encoding(encoder, tensor(lengths), tensor(decoder))


def decoder_inputs(batch: Batch) -> ForwardInputs:
    """A decode step of an encoder-decoder batch: batch.decode_inputs with each fed token's slot
    after its request's prompt (the scratch slot for a request's last possible token)."""
    inputs = batch.decode_inputs()
    held = check_slots(batch.requests, batch.block_size)
    device = batch.lengths.device
    lengths = [r.encoder_length for r in batch.requests]
    encoder_lengths = torch.tensor(lengths, dtype=torch.long).to(device)
    capacity = torch.tensor(held, dtype=torch.long).to(device)
    table_pos = encoder_lengths + inputs.positions
    slots = table_slots(batch.block_tables, table_pos.unsqueeze(1), batch.block_size).squeeze(1)
    slots = torch.where(table_pos < capacity, slots, SCRATCH_SLOT)
    meta = _with_encoder(inputs.meta, slots, encoder_lengths, max(lengths), None)
    return dataclasses.replace(inputs, meta=meta)


def prefill_inputs(
    new: Batch, decode: ForwardInputs | None, encoding: Encoding | None
) -> ForwardInputs:
    """A Prefill's forward: the running batch's decode rows, then the newcomers' chunks
    (Batch.prefill_inputs). For an encoder-decoder (an `encoding`) the chunks are the
    decoder's tokens and the metadata carries the newcomers' prompts, encoded first."""
    inputs = new.prefill_inputs(decode)
    if encoding is None:
        return inputs
    slots, lengths = encoding.decoder_slots, encoding.lengths
    longest = encoding.encoder.max_length
    if decode is not None:
        running = decode.meta
        assert isinstance(running, EncoderDecoderMetadata), "decode rows built by decoder_inputs"
        slots = torch.cat([running.slot_mapping, slots])
        lengths = torch.cat([running.encoder_lengths, lengths])
        longest = max(longest, running.max_encoder_length)
    meta = _with_encoder(inputs.meta, slots, lengths, longest, encoding.encoder)
    return dataclasses.replace(inputs, meta=meta)


def check_slots(requests: Sequence[RequestState], block_size: int) -> list[int]:
    """Each request's slots held, once they hold its prompt and the decoder tokens this step
    computes, all but the last token when it is the last one it can ever feed."""
    held = []
    for r in requests:
        have = len(r.blocks) * block_size
        needed = r.encoder_length + r.length
        last_step = r.text.generated + 1 >= r.stopping.max_new_tokens
        if have < needed - (1 if last_step else 0):
            raise InvalidRequest(
                f"request {r.id}: {len(r.blocks)} blocks of {block_size} hold {have} slots; its "
                f"{r.encoder_length} prompt tokens' cross-attention K/V and {r.length} decoder "
                f"tokens need {needed}: grant its next block (BlockGrant) with the step"
            )
        held.append(have)
    return held


def _check_prompt(r: generate_pb2.Request, vocab_size: int) -> None:
    """A prompt the encoder can embed, computed in one Prefill: no cached prefix, no chunks (a
    prompt leaves no decoder KV to continue from). Batch.from_pb checks the rest."""
    total = len(r.input_ids) + len(r.generated_ids)
    if not r.input_ids:
        raise InvalidRequest(f"request {r.id}: input_ids is empty")
    if max(r.input_ids) >= vocab_size:
        raise InvalidRequest(
            f"request {r.id}: token id {max(r.input_ids)} is not below the vocabulary size "
            f"{vocab_size}"
        )
    if r.cache_len or (r.chunk_len and r.chunk_len != total):
        raise InvalidRequest(
            f"request {r.id}: an encoder-decoder takes its whole prompt in one Prefill "
            f"(cache_len 0, no chunk_len short of {total}); got cache_len {r.cache_len}, "
            f"chunk_len {r.chunk_len} (this shard reports support_chunking and "
            "use_prefix_caching false)"
        )


def _slots(blocks: Sequence[int], table: range, capacity: int, block_size: int) -> list[int]:
    """The slots of table positions `table` of a request's blocks; the scratch slot past them."""
    return [
        blocks[p // block_size] * block_size + p % block_size if p < capacity else SCRATCH_SLOT
        for p in table
    ]


def _with_encoder(
    meta: AttentionMetadata,
    slots: torch.Tensor,
    encoder_lengths: torch.Tensor,
    max_encoder_length: int,
    encoder: EncoderInputs | None,
) -> EncoderDecoderMetadata:
    return EncoderDecoderMetadata(
        is_prefill=meta.is_prefill, cu_seqlens_q=meta.cu_seqlens_q, seqlens_k=meta.seqlens_k,
        slot_mapping=slots, block_tables=meta.block_tables, max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k, block_size=meta.block_size,
        encoder_lengths=encoder_lengths, max_encoder_length=max_encoder_length, encoder=encoder,
    )  # fmt: skip
