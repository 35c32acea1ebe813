"""A live batch on one shard: the flat, paged layout plus each request's generation state.

Mirrors the wire contract: `from_pb` builds a batch from the router's Batch, `to_pb` describes it
back as a CachedBatch, `filter` keeps a subset, `concatenate` merges batches. The state a decode
step needs lives in device tensors (token history, lengths, block tables) so that building a step's
inputs and appending its tokens are a handful of tensor ops, whatever the batch size; the Python
per-request state (stopping, detokenizer offsets) is only touched when building the Generations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.attention.kv_cache import SCRATCH_SLOT
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.engine.drafting import DraftState
from pytgi_shard.engine.request_media import step_media
from pytgi_shard.engine.request_state import BatchContext, RequestState, request_state
from pytgi_shard.engine.step_inputs import ForwardInputs, chunk_inputs
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.output.detokenizer import TextStreams
from pytgi_shard.output.stopping import BatchStops
from pytgi_shard.output.wire import request_field
from pytgi_shard.sample.chooser import NextTokenChooser, SamplingParams
from pytgi_shard.structured_output.batch_grammar import BatchGrammar
from pytgi_shard.structured_output.compiler import GrammarSpec


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
        slack: list[int],
        grammar: BatchGrammar | None = None,
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
        # The constrained rows' grammar state; None when no row is constrained.
        self.grammar = grammar
        self.block_size = block_size
        # Per row, slots held minus tokens known, as of `steps` appends ago (the Batch's start):
        # each append uses one slot of every row, so `headroom` and `stops` need no row updates.
        self._slack = slack
        self.steps = 0
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
        self.streams = TextStreams([r.text for r in requests])
        self.request_ids = [r.id for r in requests]
        self.request_fields = [request_field(r.id) for r in requests]
        self.stop_rows = [row for row, r in enumerate(requests) if r.stopping.stop_sequences]
        # The rows that may draft (--speculate) and their drafters.
        self.drafting = [(row, r.draft) for row, r in enumerate(requests) if r.draft is not None]
        # Per row, what M-RoPE adds to a decode position (a request with images; None: none has).
        shifts = [r.media.rope_delta if r.media is not None else 0 for r in requests]
        self.position_shift = (
            torch.tensor(shifts, dtype=torch.long, device=lengths.device) if any(shifts) else None
        )
        self._pb: generate_pb2.CachedBatch | None = None
        self._capacity: torch.Tensor | None = None
        self._row_of: dict[int, int] | None = None

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
        sequences = [[*r.input_ids, *r.generated_ids] for r in pb.requests]
        params = [SamplingParams.from_pb(r.parameters) for r in pb.requests]
        requests = [
            request_state(r, sequence, p, ctx)
            for r, sequence, p in zip(pb.requests, sequences, params, strict=True)
        ]
        width = max(len(r.input_ids) + r.stopping_parameters.max_new_tokens for r in pb.requests)
        all_ids = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            all_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        stops = BatchStops.build([r.stopping for r in requests])
        block_tables = _block_table([r.blocks for r in requests], ctx.device)
        chooser = NextTokenChooser.create(params, ctx.device, ctx.watermark)
        # A resumed seeded request's draws continue at its next token's index (only once it
        # samples: a partial prefill's batch is dropped after its forward).
        chooser.skip_draws([r.resumed if r.complete else 0 for r in requests])
        grammar = _grammar(pb, [r.complete for r in requests], ctx)
        if ctx.speculate:
            for r in requests:
                # With images too: verification shifts its positions as decode does.
                if r.complete:
                    # Empty: indexed from the batch's history when a step may draft.
                    r.draft = DraftState.start(())
        return cls(
            batch_id=pb.id,
            requests=requests,
            all_ids=all_ids.to(ctx.device),
            lengths=torch.tensor([len(s) for s in sequences], dtype=torch.long, device=ctx.device),
            last_ids=torch.tensor([s[-1] for s in sequences], dtype=torch.long, device=ctx.device),
            block_tables=block_tables,
            slot_table=_slot_table(block_tables, ctx.block_size),
            chooser=chooser,
            stops=stops,
            block_size=ctx.block_size,
            slack=[
                len(r.blocks) * ctx.block_size - len(s)
                for r, s in zip(requests, sequences, strict=True)
            ],
            grammar=grammar,
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

    def prefill_inputs(self, decode: ForwardInputs | None = None) -> ForwardInputs:
        """Every request's chunk of its sequence, flat, after `decode`'s rows when given (a
        mixed step; shard/engine/step_inputs.py)."""
        inputs = chunk_inputs(
            self.requests, self.all_ids, self.slot_table, self.block_tables, self.block_size, decode
        )
        n_decode = 0 if decode is None else decode.meta.batch_size
        inputs.media = step_media(self.requests, inputs.positions, n_decode)
        return inputs

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
        if self.position_shift is not None:
            positions = positions + self.position_shift
        return ForwardInputs(self.last_ids, positions, meta, None, self.rows,
                             adapters=self.row_adapters())

    def row_adapters(self) -> torch.Tensor | None:
        """Each row's LoRA adapter's device slot (None: all base), from its RequestState:
        filter and concatenate keep it with the request."""
        per_row = [r.adapter_slot for r in self.requests]
        if not any(per_row):
            return None
        return torch.tensor(per_row, dtype=torch.long).to(self.rows.device, non_blocking=True)

    def _slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.slot_table[rows, positions]

    def headroom(self) -> int:
        """min over rows of (slots held - tokens known): a forward feeding every row's last
        token needs >= 0; a look-ahead launched after this step's append needed >= 0 then."""
        return min(self._slack) - self.steps

    def slack_after(self, grants: Mapping[int, Sequence[int]]) -> list[int]:
        """Per row, slots held minus tokens known once `grants` (request id -> blocks appended)
        are applied; ids of other batches are ignored."""
        slack = [s - self.steps for s in self._slack]
        row_of = self.row_of()
        for rid, blocks in grants.items():
            row = row_of.get(rid)
            if row is not None:
                slack[row] += len(blocks) * self.block_size
        return slack

    def room(self) -> list[int]:
        """Per row, KV slots held past its known tokens: the drafts a step may feed it."""
        return [s - self.steps for s in self._slack]

    def row_of(self) -> dict[int, int]:
        """Request id -> row."""
        if self._row_of is None:
            self._row_of = {rid: row for row, rid in enumerate(self.request_ids)}
        return self._row_of

    def grow(self, grants: Mapping[int, Sequence[int]]) -> None:
        """Appends blocks to the listed requests' tables (validated by the caller), widening
        the tables when a request outgrows them. What was derived from the tables is dropped."""
        row_of = self.row_of()
        grants = {rid: blocks for rid, blocks in grants.items() if blocks and rid in row_of}
        if not grants:
            return
        rows: list[int] = []
        columns: list[int] = []
        values: list[int] = []
        for rid, blocks in grants.items():
            row = row_of[rid]
            held = self.requests[row].blocks
            rows.extend([row] * len(blocks))
            columns.extend(range(len(held), len(held) + len(blocks)))
            values.extend(blocks)
            held.extend(blocks)
            self._slack[row] += len(blocks) * self.block_size
        width = max(columns) + 1
        if width > self.block_tables.shape[1]:
            self.block_tables = _pad_columns(self.block_tables, width)
            self.slot_table = _pad_columns(self.slot_table, width * self.block_size)
        device = self.block_tables.device
        row_t = torch.tensor(rows, dtype=torch.long, device=device)
        col_t = torch.tensor(columns, dtype=torch.long, device=device)
        block_t = torch.tensor(values, dtype=torch.long, device=device)
        self.block_tables[row_t, col_t] = block_t.to(torch.int32)
        offsets = torch.arange(self.block_size, device=device)
        positions = (col_t * self.block_size).unsqueeze(1) + offsets
        slots = (block_t * self.block_size).unsqueeze(1) + offsets
        self.slot_table[row_t.unsqueeze(1).expand_as(positions), positions] = slots
        self._capacity = None
        self._pb = None

    def append(self, next_ids: torch.Tensor) -> None:
        """Records one new token per request (device side; host state is the caller's)."""
        self.all_ids.scatter_(1, self.lengths.unsqueeze(1), next_ids.unsqueeze(1))
        self.lengths += 1
        self.last_ids = next_ids
        self.max_length += 1
        self.steps += 1

    def append_extra(self, rows: Sequence[int], extra: Sequence[Sequence[int]]) -> None:
        """Records, after a step's append, the further tokens the listed rows emitted (drafts
        a verification kept): their history, lengths and last tokens, and on the host their
        slack and length stops (the per-step counters assume one token per row)."""
        if not rows:
            return
        device = self.lengths.device
        flat_rows = [row for row, tokens in zip(rows, extra, strict=True) for _ in tokens]
        offsets = [i for tokens in extra for i in range(len(tokens))]
        row_t = torch.tensor(flat_rows, dtype=torch.long, device=device)
        values = torch.tensor([t for tokens in extra for t in tokens], dtype=torch.long,
                              device=device)
        positions = self.lengths[row_t] + torch.tensor(offsets, dtype=torch.long, device=device)
        self.all_ids[row_t, positions] = values
        index = torch.tensor(list(rows), dtype=torch.long, device=device)
        counts = torch.tensor([len(t) for t in extra], dtype=torch.long, device=device)
        self.lengths.index_add_(0, index, counts)
        last = torch.tensor([t[-1] for t in extra], dtype=torch.long, device=device)
        self.last_ids = self.last_ids.index_copy(0, index, last)
        self.max_length = max(r.length for r in self.requests)
        for row, tokens in zip(rows, extra, strict=True):
            self._slack[row] -= len(tokens)
            self.stops.consume(row, len(tokens))

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
            stops=self.stops.index(indices, self.steps),
            block_size=self.block_size,
            slack=[self._slack[i] - self.steps for i in indices],
            grammar=self.grammar.filter(indices) if self.grammar is not None else None,
        )

    @classmethod
    def concatenate(cls, batches: Sequence[Batch]) -> Batch:
        """One batch of all requests, in order, under the first batch's id."""
        if len(batches) == 1:
            return batches[0]
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
            stops=BatchStops.concatenate([b.stops for b in batches], [b.steps for b in batches]),
            block_size=batches[0].block_size,
            slack=[s - b.steps for b in batches for s in b._slack],
            grammar=BatchGrammar.concatenate([b.grammar for b in batches], [len(b) for b in batches]),
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


def _grammar(pb: generate_pb2.Batch, samples: list[bool], ctx: BatchContext) -> BatchGrammar | None:
    """The constrained rows' grammars (shard/structured_output/batch_grammar.py), compiled before any forward."""
    specs = [GrammarSpec.from_pb(r.parameters) for r in pb.requests]
    if all(s is None for s in specs):
        return None
    if ctx.grammars is None:
        raise InvalidRequest("grammar is not supported by this shard")
    generated = [list(r.generated_ids) for r in pb.requests]
    return BatchGrammar.start(specs, generated, samples, ctx.grammars, ctx.device)
