"""A live batch on one shard: the flat, paged layout plus each request's generation state.

Mirrors the wire contract: `from_pb` builds a batch from the router's Batch, `to_pb` describes it
back as a CachedBatch, `filter` keeps a subset, `concatenate` merges batches. The state a decode
step needs lives in device tensors (token history, lengths, block tables) so that building a step's
inputs and appending its tokens are a handful of tensor ops, whatever the batch size; the Python
per-request state (stopping, detokenizer offsets) is only touched when building the Generations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.detokenizer import TextStream
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.generation_wire import request_field
from pytgi_shard.kv_cache import SCRATCH_SLOT
from pytgi_shard.request_validation import validate_request
from pytgi_shard.sampling import NextTokenChooser, SamplingParams, Watermark
from pytgi_shard.stopping import BatchStops, StoppingCriteria


@dataclass(frozen=True, slots=True)
class BatchContext:
    """What the shard knows that a batch must respect: the device, the KV cache, the vocabulary."""

    device: torch.device
    block_size: int
    num_blocks: int
    vocab_size: int
    eos_ids: frozenset[int]
    watermark: Watermark


@dataclass(slots=True)
class RequestState:
    id: int
    prompt_length: int
    blocks: list[int]
    top_n_tokens: int
    prefill_logprobs: bool
    stopping: StoppingCriteria
    text: TextStream
    # Reported in GeneratedText only when the request samples.
    seed: int | None

    @property
    def length(self) -> int:
        """Tokens known so far: the prompt and every generated token."""
        return self.prompt_length + self.text.generated


@dataclass(slots=True)
class ForwardInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # The flat tokens that need logits; None: all of them (a decode step).
    lm_head_indices: torch.Tensor | None
    # Row of the logits holding each request's last token.
    last_rows: torch.Tensor
    # For prefill logprobs: logits rows and the prompt token each row predicts.
    prompt_rows: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None


class Batch:
    def __init__(
        self,
        batch_id: int,
        requests: list[RequestState],
        all_ids: torch.Tensor,
        lengths: torch.Tensor,
        last_ids: torch.Tensor,
        block_tables: torch.Tensor,
        slot_table: torch.Tensor,
        chooser: NextTokenChooser,
        stops: BatchStops,
        block_size: int,
        prefilled: bool,
    ) -> None:
        self.batch_id = batch_id
        self.requests = requests
        # [batch, max prompt + max_new_tokens] int64: prompt then generated ids, zero padded.
        self.all_ids = all_ids
        # [batch] int64: tokens known per request; the last one is the next forward's input.
        self.lengths = lengths
        # [batch] int64: that last token (all_ids at lengths - 1).
        self.last_ids = last_ids
        # [batch, max blocks] int32, padded with block 0.
        self.block_tables = block_tables
        # [batch, max blocks * block_size] int64: the cache slot of every position.
        self.slot_table = slot_table
        self.chooser = chooser
        self.stops = stops
        self.block_size = block_size
        self.prefilled = prefilled
        # Host copy of max(lengths), so that a decode step needs no device-to-host sync.
        self.max_length = max((r.length for r in requests), default=0)
        # Per row, how many top tokens to report; None when no request asked (the usual case).
        top_n = [r.top_n_tokens for r in requests]
        self.top_n: list[int] | None = top_n if any(top_n) else None
        # What every decode step of this batch reuses: its rows (one token each), the requests'
        # text streams, ids and ids as Generation fields, and (once asked) its CachedBatch.
        self.rows = torch.arange(len(requests), device=lengths.device)
        self.cu_seqlens_decode = torch.arange(
            len(requests) + 1, dtype=torch.int32, device=lengths.device
        )
        self.streams = [r.text for r in requests]
        self.request_ids = [r.id for r in requests]
        self.request_fields = [request_field(r.id) for r in requests]
        self.stop_rows = [row for row, r in enumerate(requests) if r.stopping.stop_sequences]
        self._pb: generate_pb2.CachedBatch | None = None
        self._capacity: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.requests)

    @classmethod
    def from_pb(cls, pb: generate_pb2.Batch, ctx: BatchContext) -> Batch:
        """Validates the router's batch against this shard's limits and builds its state."""
        if not pb.requests:
            raise InvalidRequest(f"batch {pb.id} has no requests")
        ids = [r.id for r in pb.requests]
        if len(set(ids)) != len(ids):
            raise InvalidRequest(f"batch {pb.id} has duplicate request ids")
        prompts = [list(r.input_ids) for r in pb.requests]
        params = [SamplingParams.from_pb(r.parameters) for r in pb.requests]
        requests = [
            _request_state(r, prompt, p, ctx)
            for r, prompt, p in zip(pb.requests, prompts, params, strict=True)
        ]
        width = max(
            len(p) + r.stopping_parameters.max_new_tokens
            for p, r in zip(prompts, pb.requests, strict=True)
        )
        all_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            all_ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        stops = BatchStops.build(
            [len(p) for p in prompts], [r.stopping for r in requests], ctx.device
        )
        block_tables = _block_table([r.blocks for r in requests], ctx.device)
        return cls(
            batch_id=pb.id,
            requests=requests,
            all_ids=all_ids.to(ctx.device),
            lengths=torch.tensor([len(p) for p in prompts], dtype=torch.long, device=ctx.device),
            last_ids=torch.tensor([p[-1] for p in prompts], dtype=torch.long, device=ctx.device),
            block_tables=block_tables,
            slot_table=_slot_table(block_tables, ctx.block_size),
            chooser=NextTokenChooser.create(params, ctx.device, ctx.watermark),
            stops=stops,
            block_size=ctx.block_size,
            prefilled=False,
        )

    def to_pb(self) -> generate_pb2.CachedBatch:
        """The CachedBatch (a new message each call): what it says never changes for a Batch."""
        if self._pb is None:
            self._pb = generate_pb2.CachedBatch(
                id=self.batch_id,
                request_ids=self.request_ids,
                size=len(self),
                max_tokens=sum(len(r.blocks) for r in self.requests) * self.block_size,
                # A cached batch is prefilled: its next forward is one token per request.
                current_tokens=len(self),
            )
        out = generate_pb2.CachedBatch()
        out.CopyFrom(self._pb)
        return out

    def prefill_inputs(self) -> ForwardInputs:
        """Every prompt token of every request, flat; logits for last tokens (and prompt rows of
        requests that asked for prefill logprobs)."""
        device = self.lengths.device
        prompt_lengths = [r.prompt_length for r in self.requests]
        seqlens = torch.tensor(prompt_lengths, dtype=torch.long, device=device)
        starts = torch.cumsum(seqlens, 0) - seqlens
        total = sum(prompt_lengths)
        request_of_token = torch.repeat_interleave(torch.arange(len(self), device=device), seqlens)
        positions = torch.arange(total, device=device) - starts[request_of_token]
        input_ids = self.all_ids[request_of_token, positions]
        slots = self._slots(request_of_token, positions)
        meta = AttentionMetadata(
            is_prefill=True,
            cu_seqlens_q=torch.nn.functional.pad(torch.cumsum(seqlens, 0), (1, 0)).to(torch.int32),
            seqlens_k=seqlens.to(torch.int32),
            slot_mapping=slots,
            block_tables=self.block_tables,
            max_seqlen_q=max(prompt_lengths),
            max_seqlen_k=max(prompt_lengths),
            block_size=self.block_size,
        )
        if not any(r.prefill_logprobs for r in self.requests):
            last = starts + seqlens - 1
            rows = torch.arange(len(self), device=device)
            return ForwardInputs(input_ids, positions, meta, last, rows)
        return self._with_prompt_rows(input_ids, positions, meta, prompt_lengths)

    def _with_prompt_rows(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        prompt_lengths: list[int],
    ) -> ForwardInputs:
        """lm_head_indices with every prompt token of the requests that want prefill logprobs."""
        indices: list[int] = []
        last_rows: list[int] = []
        prompt_rows: list[int] = []
        targets: list[torch.Tensor] = []
        start = 0
        for row, (r, length) in enumerate(zip(self.requests, prompt_lengths, strict=True)):
            if r.prefill_logprobs:
                # The logits at prompt position i predict prompt token i + 1.
                prompt_rows.extend(range(len(indices), len(indices) + length - 1))
                targets.append(self.all_ids[row, 1:length])
                indices.extend(range(start, start + length))
            else:
                indices.append(start + length - 1)
            last_rows.append(len(indices) - 1)
            start += length
        device = self.lengths.device
        return ForwardInputs(
            input_ids,
            positions,
            meta,
            torch.tensor(indices, dtype=torch.long, device=device),
            torch.tensor(last_rows, dtype=torch.long, device=device),
            torch.tensor(prompt_rows, dtype=torch.long, device=device),
            torch.cat(targets),
        )

    def decode_inputs(self) -> ForwardInputs:
        """One token per request: the last known one, at position length - 1."""
        positions = self.lengths - 1
        return self._one_token_inputs(positions, self._slots(self.rows, positions), self.lengths)

    def lookahead_inputs(self) -> ForwardInputs:
        """decode_inputs for a forward launched before this step's stops are known (the overlap
        scheduler). A request that has just finished may have no slot left for its last token:
        such a row writes to the reserved block 0 and attends within its own blocks; its logits
        are never used. Every other row gets exactly decode_inputs' values."""
        if self._capacity is None:
            held = [len(r.blocks) * self.block_size for r in self.requests]
            self._capacity = torch.tensor(held, dtype=torch.long).to(
                self.lengths.device, non_blocking=True
            )
        positions, capacity = self.lengths - 1, self._capacity
        inside = torch.minimum(positions, capacity - 1)
        slots = torch.where(positions < capacity, self._slots(self.rows, inside), SCRATCH_SLOT)
        return self._one_token_inputs(positions, slots, torch.minimum(self.lengths, capacity))

    def _one_token_inputs(
        self, positions: torch.Tensor, slots: torch.Tensor, seqlens: torch.Tensor
    ) -> ForwardInputs:
        meta = AttentionMetadata(
            is_prefill=False,
            cu_seqlens_q=self.cu_seqlens_decode,
            seqlens_k=seqlens.to(torch.int32),
            slot_mapping=slots,
            block_tables=self.block_tables,
            max_seqlen_q=1,
            max_seqlen_k=self.max_length,
            block_size=self.block_size,
        )
        return ForwardInputs(self.last_ids, positions, meta, None, self.rows)

    def _slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.slot_table[rows, positions]

    def append(self, next_ids: torch.Tensor) -> None:
        """Records one new token per request (device side; host state is the caller's)."""
        self.all_ids.scatter_(1, self.lengths.unsqueeze(1), next_ids.unsqueeze(1))
        self.lengths += 1
        self.last_ids = next_ids
        self.max_length += 1
        self.prefilled = True

    def filter(self, request_ids: Sequence[int]) -> Batch:
        """The batch of the listed requests only, in their current order."""
        keep = set(request_ids)
        unknown = keep - set(self.request_ids)
        if unknown:
            raise InvalidRequest(f"requests {sorted(unknown)} are not in batch {self.batch_id}")
        indices = [i for i, r in enumerate(self.requests) if r.id in keep]
        if len(indices) == len(self):
            return self
        index = torch.tensor(indices, dtype=torch.long, device=self.lengths.device)
        requests = [self.requests[i] for i in indices]
        width = max((r.prompt_length + r.stopping.max_new_tokens for r in requests), default=0)
        max_blocks = max((len(r.blocks) for r in requests), default=0)
        return Batch(
            batch_id=self.batch_id,
            requests=requests,
            all_ids=self.all_ids[index, :width],
            lengths=self.lengths[index],
            last_ids=self.last_ids[index],
            block_tables=self.block_tables[index, :max_blocks],
            slot_table=self.slot_table[index, : max_blocks * self.block_size],
            chooser=self.chooser.filter(indices),
            stops=self.stops.index(index),
            block_size=self.block_size,
            prefilled=self.prefilled,
        )

    @classmethod
    def concatenate(cls, batches: Sequence[Batch]) -> Batch:
        """One batch of all requests, in order, under the first batch's id."""
        if len(batches) == 1:
            return batches[0]
        if not all(b.prefilled for b in batches):
            raise InvalidRequest("only prefilled batches can be concatenated")
        width = max(b.all_ids.shape[1] for b in batches)
        max_blocks = max(b.block_tables.shape[1] for b in batches)
        return cls(
            batch_id=batches[0].batch_id,
            requests=list(chain.from_iterable(b.requests for b in batches)),
            all_ids=torch.cat([_pad_columns(b.all_ids, width) for b in batches]),
            lengths=torch.cat([b.lengths for b in batches]),
            last_ids=torch.cat([b.last_ids for b in batches]),
            block_tables=torch.cat([_pad_columns(b.block_tables, max_blocks) for b in batches]),
            slot_table=torch.cat(
                [_pad_columns(b.slot_table, max_blocks * b.block_size) for b in batches]
            ),
            chooser=NextTokenChooser.concatenate([b.chooser for b in batches]),
            stops=BatchStops.concatenate([b.stops for b in batches]),
            block_size=batches[0].block_size,
            prefilled=True,
        )


def _pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def _slot_table(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of position p of row r: block_tables[r, p // block_size] * block_size + p % block_size."""
    offsets = torch.arange(block_size, device=block_tables.device)
    slots = block_tables.to(torch.long).unsqueeze(2) * block_size + offsets
    return slots.flatten(1)


def _block_table(blocks: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(b) for b in blocks)
    table = torch.zeros(len(blocks), width, dtype=torch.int32)
    for row, b in enumerate(blocks):
        table[row, : len(b)] = torch.tensor(b, dtype=torch.int32)
    return table.to(device)


def _request_state(
    pb: generate_pb2.Request, prompt: list[int], params: SamplingParams, ctx: BatchContext
) -> RequestState:
    stop = pb.stopping_parameters
    validate_request(pb, prompt, ctx.vocab_size, ctx.block_size, ctx.num_blocks)
    eos = () if stop.ignore_eos_token else ctx.eos_ids
    return RequestState(
        id=pb.id,
        prompt_length=len(prompt),
        blocks=list(pb.blocks),
        top_n_tokens=min(pb.top_n_tokens, ctx.vocab_size),
        prefill_logprobs=pb.prefill_logprobs,
        stopping=StoppingCriteria(stop.max_new_tokens, eos, list(stop.stop_sequences)),
        text=TextStream.start(prompt),
        seed=params.seed if params.samples else None,
    )
