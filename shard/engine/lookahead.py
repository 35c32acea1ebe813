"""The overlap scheduler's bookkeeping: decode forwards launched one step ahead.

Between two decode forwards the shard reads the step's tokens back, detokenizes, checks stops,
builds the response, and the router routes it and sends the next Decode; an accelerator that
waits for all of that idles for a fifth to a third of the time at large batches. So, as soon as
a step's tokens are chosen on the device (and before the host reads them), the shard queues the
next decode forward of the same requests; the next Decode finds its logits computed, or being
computed, and only samples from them.

What makes this exact: the forward a Decode would run depends only on the requests' tokens and
KV cache, which nothing changes between the two calls (FilterBatch drops requests, a Prefill adds
other requests and writes only their blocks, both queued after the look-ahead on the same
stream). Requests the router removes in between are dropped from the logits; a request that
finished (its stop only known once the host reads the step) got a row anyway, which writes to
the reserved block 0 when it has no slot left (Batch.lookahead_inputs) and is discarded.

A mixed Prefill takes the cached batch's look-ahead for its decode rows (the forward then covers
the newcomers' chunks only): the same logits a mixed forward would give those rows. A row whose
look-ahead ran with no slot because its block came late (a BlockGrant with the next step) is
seen at that step (Batch.headroom < 0 before the grant): the look-aheads are dropped and the
step computes its forward (shard/engine/block_grants.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytgi_shard.engine.forward_timer import ForwardTimer


@dataclass(slots=True)
class Lookahead:
    """One forward launched ahead: its requests, in row order, and their logits."""

    request_ids: list[int]
    # [len(request_ids), vocab]; a copy when the forward replayed a CUDA graph (the next replay
    # reuses the graph's output memory).
    logits: torch.Tensor
    timer: ForwardTimer


class Lookaheads:
    """The look-ahead forwards waiting for a Decode: one per Decode or Prefill step since the
    last Decode (a Decode takes them all)."""

    def __init__(self) -> None:
        self._pending: list[Lookahead] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, lookahead: Lookahead) -> None:
        self._pending.append(lookahead)

    def clear(self) -> None:
        self._pending.clear()

    def drop(self, finished: set[int]) -> None:
        """Frees the look-aheads none of whose requests is still running."""
        self._pending = [
            la for la in self._pending if not all(r in finished for r in la.request_ids)
        ]

    def take(self, request_ids: list[int]) -> tuple[torch.Tensor, ForwardTimer] | None:
        """The logits of `request_ids`, in that order, when every one of them was looked ahead
        (None otherwise: the caller runs the forward); the pending look-aheads are consumed."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        timer = pending[-1].timer
        if len(pending) == 1 and pending[0].request_ids == request_ids:
            return pending[0].logits, timer
        # Each request's row in the look-aheads' logits stacked in order.
        row_of = {rid: row for row, rid in enumerate(r for la in pending for r in la.request_ids)}
        if any(rid not in row_of for rid in request_ids):
            return None
        stacked = torch.cat([la.logits for la in pending]) if len(pending) > 1 else pending[0].logits
        rows = [row_of[rid] for rid in request_ids]
        index = torch.tensor(rows, dtype=torch.long).to(stacked.device, non_blocking=True)
        return stacked.index_select(0, index), timer
