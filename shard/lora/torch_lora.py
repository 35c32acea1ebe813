"""The LoRA update with torch ops, over a layer's slot tensors (layer.py: `a` [slots, rank, in],
`bt` [slots, rank, out], slot 0 zeros) and one slot index per flat token.

Two ways, each where it is the faster or the only one allowed:
- segmented (the CPU's): the rows of each slot gathered into padded segments (built once per
  forward, one host read: the longest segment), then two batched matmuls over all slots: a fixed
  five ops per layer whatever the number of adapters, the work of the (padded) rows only. It
  replaced the first version's gather/shrink/expand/scatter per adapter present (four ops per
  adapter: at 8 adapters on the demo model several times slower: lora_overhead.py).
- dense (CUDA without Triton): every row shrunk by every slot's A in one matmul, the other
  slots' ranks zeroed by a one-hot mask of the row's slot, one expand over all slots. No host
  read (capturable in a CUDA graph), a fixed handful of ops, but every slot's work per row.
Measured on the CPU by bench/experiments/lora_overhead.py (its numbers: /tmp/docs/lora-kernel.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Segments:
    """A forward's adapted rows grouped by slot and padded to equal length, over the slots
    `first`..`first + count - 1` (the range the present adapters span: a slot with no rows
    beyond either end costs nothing): row `gather[(s - first) * length + j]` is slot s's j-th
    row (padding: row 0, its result never read). `place[t]` is token t's row in the padded
    result, or `count * length` (a zero row appended) for a token on the base model, so the
    update goes back with one row gather and one add: no scatter, no mask."""

    slots: int
    first: int
    count: int  # 0: no row is adapted
    length: int
    gather: torch.Tensor  # [count * length] int64
    place: torch.Tensor  # [tokens] int64
    base_rows: bool  # some token is on the base model: the result needs the zero row


def segments(index: torch.Tensor, slots: int) -> Segments:
    """`index`'s rows per slot (one host read: the slots' row counts), built once per forward
    and shared by every layer of that forward."""
    tokens, device = index.shape[0], index.device
    counts = torch.bincount(index, minlength=slots)
    host = counts.tolist()
    present = [s for s in range(1, slots) if host[s]]
    if not present:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return Segments(slots, 1, 0, 0, empty, empty, tokens > 0)
    first, count = present[0], present[-1] - present[0] + 1
    length = max(host[first:first + count])
    order = torch.argsort(index, stable=True)
    ordered = index[order]
    starts = torch.cumsum(counts, 0) - counts
    padded = (ordered - first) * length + torch.arange(tokens, device=device) - starts[ordered]
    adapted = ordered > 0
    padded = torch.where(adapted, padded, count * length)
    gather = torch.zeros(count * length, dtype=torch.long, device=device)
    gather[padded[adapted]] = order[adapted]
    place = torch.empty(tokens, dtype=torch.long, device=device)
    place[order] = padded
    return Segments(slots, first, count, length, gather, place, host[0] > 0)


def add_segmented(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor,
                  b_pieces: Sequence[torch.Tensor], seg: Segments, used: int | None = None) -> None:
    """out += each row's update, as batched matmuls over the present slots' range: the rows of
    each slot gathered into its padded segment, shrunk by its A ([slots, rank, in], read as
    its contiguous transposed storage), expanded by its B — one batched matmul, or one per
    fused piece from the piece's own rank columns and contiguous B (LoraLinear.b_pieces) —
    into a result with a zero row for base rows, gathered back in token order and added. A
    fixed handful of ops whatever the number of adapters. `used`: the largest rank per piece
    among the present slots (None: all of the capacity): the columns past it are zeros in
    every present slot and are skipped (with runtime updates the capacity is --max-lora-rank,
    64 by default, whatever the loaded adapters' ranks)."""
    if seg.count == 0:
        return
    n = out.shape[1]
    lo, hi, size = seg.first, seg.first + seg.count, seg.count * seg.length
    count, capacity = len(b_pieces), a.shape[1] // len(b_pieces)
    used = capacity if used is None else used
    rows = x.index_select(0, seg.gather).view(seg.count, seg.length, -1)
    shrunk = torch.bmm(rows, a[lo:hi, :used if count == 1 else None].transpose(1, 2))
    delta = torch.empty(size + seg.base_rows, n, dtype=shrunk.dtype, device=out.device)
    result = delta[:size].view(seg.count, seg.length, n)
    if count == 1:
        torch.bmm(shrunk, b_pieces[0][lo:hi, :used], out=result)
    else:
        torch.cat([torch.bmm(shrunk[:, :, p * capacity:p * capacity + used],
                             piece[lo:hi, :used])
                   for p, piece in enumerate(b_pieces)], dim=2, out=result)
    if seg.base_rows:
        delta[size].zero_()
    out.add_(delta.index_select(0, seg.place))


def add_dense(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
              index: torch.Tensor) -> None:
    """out += for each row, (x · A[slot]ᵀ) · Bᵀ[slot], computed for all slots at once and masked
    to the row's own slot (slot 0 is zeros, so base rows gain nothing)."""
    slots, rank, _ = a.shape
    shrunk = x @ a.reshape(slots * rank, -1).t()
    mask = index.unsqueeze(1) == torch.arange(slots, device=index.device)
    shrunk = (shrunk.view(-1, slots, rank) * mask.unsqueeze(2).to(shrunk.dtype))
    out.add_((shrunk.view(-1, slots * rank) @ bt.reshape(slots * rank, -1)).to(out.dtype))


def reference_update(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                     index: torch.Tensor) -> torch.Tensor:
    """Each row's update, row by row in float32: what every path is tested against."""
    rows = [x[i].float() @ a[int(s)].float().t() @ bt[int(s)].float()
            for i, s in enumerate(index.tolist())]
    return torch.stack(rows) if rows else x.new_zeros(0, bt.shape[2], dtype=torch.float32)
