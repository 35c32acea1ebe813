"""A model of the shards for the router's batching task, in process: what each KV slot holds,
the batch the shards keep between steps, BlockGrants, partial and completing chunks, refusals.

It stands in for `ShardClient` (the step calls the Scheduler makes) so that the real Scheduler,
planner and PrefixCache run against it. Tokens are a deterministic function of the sequence
(greedy decoding of a fixed model): a repeated prompt generates the same tokens. A slot's KV is
modelled by the whole token prefix it was computed from, so every read can check it holds what
the sequence itself would have computed (the differential property: outputs equal those without
caching), and that a step writes only blocks its request alone holds. Without `checked` (a
large workload) it only bounds writes by the tables and generates the tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from pytgi_proto import generate_pb2 as pb
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.shard_client import ShardCallError

VOCAB = 3


def next_token(tokens: Sequence[int], vocab: int = VOCAB) -> int:
    """The model's greedy choice after `tokens` (the default small vocabulary makes blocks
    repeat often)."""
    return (sum(tokens) * 7 + len(tokens)) % vocab


def reference(prompt: Sequence[int], max_new: int, vocab: int = VOCAB) -> list[int]:
    """What a request generates without any caching, chunking or preemption."""
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(next_token(tokens, vocab))
    return tokens[len(prompt):]


@dataclass
class Row:
    """One request in the shards' batch: its sequence so far and its block table."""

    tokens: list[int]
    table: list[int]
    prompt: int
    max_new: int


class ModelShard:
    """Duck-types ShardClient's prefill / decode / filter_batch / clear_cache."""

    def __init__(self, cache: PrefixCache, checked: bool = True, vocab: int = VOCAB) -> None:
        self.cache = cache
        self.size = cache.block_size
        self.checked = checked
        self.vocab = vocab
        self.kv: dict[int, list[tuple[int, ...] | None]] = {}
        self.rows: dict[int, Row] = {}
        self.batch_id: int | None = None
        # Set by a test: the next Prefill is refused (INVALID_ARGUMENT) before touching anything.
        self.refuse_next = False
        self.refused: set[int] = set()
        self._owned: dict[int, int] | None = None
        # max_steps of every Decode call, in order.
        self.calls: list[int] = []
        # Steps every multi-step Decode call ran, in order.
        self.ran: list[int] = []
        # Set by a test: called with the steps done so far between a multi-step call's steps
        # (where a newcomer arrives mid-call).
        self.between_steps: Callable[[int], None] | None = None
        # The call id of the last CutShort, and every CutShort's, in order.
        self.cut_id = 0
        self.cuts: list[int] = []

    # The calls

    async def prefill(
        self,
        batch: pb.Batch,
        cached: pb.CachedBatch | None,
        timeout: float | None = None,
        grants: Sequence[pb.BlockGrant] = (),
    ) -> pb.PrefillResponse:
        if self.refuse_next:
            self.refuse_next = False
            self.refused.update(r.id for r in batch.requests)
            raise refusal()
        self._check_batch(cached)
        self._begin()
        self._grant(grants)
        out = pb.PrefillResponse(generations=self._decode_rows())
        for request in batch.requests:
            generation = self._chunk(request)
            if generation is not None:
                out.generations.append(generation)
        self.batch_id = batch.id
        self._finish_reply(out)
        return out

    async def decode(
        self,
        batches: list[pb.CachedBatch],
        timeout: float | None = None,
        grants: Sequence[pb.BlockGrant] = (),
        max_steps: int = 1,
        call_id: int = 0,
    ) -> pb.DecodeResponse:
        """One decode step, or up to `max_steps` (multi-step decode, as
        shard/engine/multi_step.py: finished rows leave, the call stops when none is left or
        when a CutShort named `call_id`, read between steps, the event loop run meanwhile as
        the shards' own runs during a call): every step's writes must fall in the blocks granted
        with the call."""
        (cached,) = batches
        self._check_batch(cached)
        self._begin()
        self._grant(grants)
        out = pb.DecodeResponse(generations=self._decode_rows())
        self.calls.append(max_steps)
        if max_steps > 1:
            sizes = [len(out.generations)]
            while len(sizes) < max_steps and self.rows:
                if self.between_steps is not None:
                    self.between_steps(len(sizes))
                for _ in range(3):  # the CutShort's task: sent, answered
                    await asyncio.sleep(0)
                if call_id and self.cut_id == call_id:
                    break
                step = self._decode_rows()
                out.generations.extend(step)
                sizes.append(len(step))
            out.step_sizes.extend(sizes)
            self.ran.append(len(sizes))
        self._finish_reply(out)
        return out

    async def cut_short(self, call_id: int, timeout: float | None = None) -> None:
        self.cut_id = call_id
        self.cuts.append(call_id)

    async def filter_batch(
        self, batch_id: int, request_ids: list[int], timeout: float | None = None
    ) -> pb.CachedBatch | None:
        assert batch_id == self.batch_id, "filtering a batch the shards do not hold"
        assert set(request_ids) <= set(self.rows), "keeping requests the batch does not have"
        self.rows = {rid: self.rows[rid] for rid in request_ids}
        return self._cached_pb()

    async def clear_cache(self, batch_id: int | None = None, timeout: float | None = None) -> None:
        self.rows.clear()
        self.batch_id = None

    # Steps

    def _check_batch(self, cached: pb.CachedBatch | None) -> None:
        if cached is None:
            assert not self.rows, "a Prefill without the cached batch the shards hold"
            return
        assert cached.id == self.batch_id and list(cached.request_ids) == list(self.rows)

    def _begin(self) -> None:
        """Which blocks each request alone holds now (the only ones a step may write)."""
        if not self.checked:
            return
        snap = self.cache.snapshot()
        owned: dict[int, int] = {}
        for seq_id, table in snap.tables.items():
            for block in table:
                if snap.refs[block] == 1 and block not in snap.index:
                    owned[block] = seq_id
        self._owned = owned

    def _grant(self, grants: Sequence[pb.BlockGrant]) -> None:
        """Appends each grant to its request's table, which must then be the router's."""
        for grant in grants:
            row = self.rows[grant.request_id]
            row.table.extend(grant.blocks)
            assert tuple(row.table) == self.cache.table(grant.request_id)

    def _decode_rows(self) -> list[pb.Generation]:
        """Each row feeds its last token (writing its KV) and samples the next."""
        generations = []
        for rid, row in list(self.rows.items()):
            position = len(row.tokens) - 1
            self._read(row.tokens, row.table, position)
            self._write(rid, row.tokens, row.table, position, position + 1)
            generations.append(self._sample(rid, row))
        return generations

    def _chunk(self, request: pb.Request) -> pb.Generation | None:
        """Tokens [cache_len, cache_len + chunk_len) of the request's sequence: their KV, and a
        token when the chunk reaches the sequence's end."""
        tokens = list(request.input_ids) + list(request.generated_ids)
        table = list(request.blocks)
        end = request.cache_len + request.chunk_len if request.chunk_len else len(tokens)
        self._read(tokens, table, request.cache_len)
        self._write(request.id, tokens, table, request.cache_len, end)
        if end < len(tokens):
            return None
        row = Row(tokens, table, len(request.input_ids), request.stopping_parameters.max_new_tokens)
        self.rows[request.id] = row
        return self._sample(request.id, row)

    def _sample(self, rid: int, row: Row) -> pb.Generation:
        token = next_token(row.tokens, self.vocab)
        row.tokens.append(token)
        generation = pb.Generation(
            request_id=rid,
            tokens=pb.Tokens(ids=[token], logprobs=[0.0], texts=[str(token)], is_special=[False]),
        )
        generated = len(row.tokens) - row.prompt
        if generated >= row.max_new:
            generation.generated_text.CopyFrom(pb.GeneratedText(
                text="".join(map(str, row.tokens[row.prompt:])), generated_tokens=generated,
            ))
            del self.rows[rid]
        return generation

    def _finish_reply(self, out: pb.PrefillResponse | pb.DecodeResponse) -> None:
        batch = self._cached_pb()
        if batch is None:
            self.batch_id = None
        else:
            out.batch.CopyFrom(batch)
        self._owned = None

    def _cached_pb(self) -> pb.CachedBatch | None:
        if not self.rows:
            return None
        assert self.batch_id is not None
        blocks = sum(len(row.table) for row in self.rows.values())
        return pb.CachedBatch(id=self.batch_id, request_ids=list(self.rows), size=len(self.rows),
                              max_tokens=blocks * self.size)

    # KV memory

    def _read(self, tokens: list[int], table: list[int], end: int) -> None:
        """Attention over positions [0, end): each slot holds the KV of exactly this prefix
        (checked only when `checked`: O(end^2))."""
        if not self.checked:
            return
        size = self.size
        for position in range(end):
            block = table[position // size]
            held = self.kv.get(block, [None] * size)[position % size]
            assert held == tuple(tokens[:position + 1]), (
                f"position {position} of block {block} holds KV of {held}, not of "
                f"{tokens[:position + 1]}"
            )

    def _write(self, rid: int, tokens: list[int], table: list[int], start: int, end: int) -> None:
        size = self.size
        assert end <= len(table) * size, f"request {rid}: no KV slot for position {end - 1}"
        if not self.checked:
            return
        for position in range(start, end):
            block = table[position // size]
            if self._owned is not None:
                assert self._owned.get(block) == rid, (
                    f"request {rid} writes block {block}, which it does not hold alone"
                )
            slots = self.kv.setdefault(block, [None] * size)
            slots[position % size] = tuple(tokens[:position + 1])


def refusal() -> ShardCallError:
    """What ShardClient raises when a shard answers INVALID_ARGUMENT."""
    cause = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, details="refused by the model")
    err = ShardCallError("refused by the model")
    err.__cause__ = cause
    return err
