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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Segments:
    """A forward's rows grouped by slot and padded to equal length: row `gather[s - 1, j]` is
    slot s's j-th row (any row where `keep` is 0: padding), for slots 1..S-1, present or not."""

    gather: torch.Tensor  # [(S - 1) * length] int64
    keep: torch.Tensor  # [S - 1, length, 1] the dtype of the update: 1 real row, 0 padding
    length: int


def segments(index: torch.Tensor, slots: int, dtype: torch.dtype) -> Segments:
    """`index`'s rows per slot (one host read: the longest segment), built once per forward
    and shared by every layer of that forward."""
    tokens = index.shape[0]
    order = torch.argsort(index, stable=True)
    ordered = index[order]
    counts = torch.bincount(index, minlength=slots)
    starts = torch.cumsum(counts, 0) - counts
    length = max(1, int(counts[1:].max()) if slots > 1 else 1)
    position = torch.arange(tokens, device=index.device) - starts[ordered]
    adapted = ordered > 0
    where = (ordered[adapted] - 1) * length + position[adapted]
    gather = torch.zeros((slots - 1) * length, dtype=torch.long, device=index.device)
    gather[where] = order[adapted]
    keep = torch.zeros((slots - 1) * length, dtype=dtype, device=index.device)
    keep[where] = 1
    return Segments(gather, keep.view(slots - 1, length, 1), length)


# Below this many outputs one expand over the whole block-diagonal B beats one per piece (the
# per-call cost outweighs the zeros' work): measured on the CPU, 8 adapters of rank 16, batch 64:
# the demo model's q|k|v (384 outputs) 0.31 ms whole vs 0.42 per piece; Llama-3-8B's (6144)
# 7.6 ms whole vs 3.5 per piece, its gate|up (28672) 26.9 vs 18.4.
PIECEWISE_MIN_OUT = 1024


def add_segmented(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                  seg: Segments, pieces: Sequence[int]) -> None:
    """out += each row's update, as batched matmuls over slots 1..S-1: the rows of each slot
    gathered into its padded segment, shrunk by its A, padding zeroed, expanded by its B (on
    wide layers one batched matmul per fused piece, from the piece's own rank columns:
    LoraLinear's layout), added back. A fixed handful of ops whatever the number of adapters."""
    slots, rank, n = bt.shape
    rows = x.index_select(0, seg.gather).view(slots - 1, seg.length, -1)
    shrunk = torch.bmm(rows, a[1:].transpose(1, 2)) * seg.keep
    if len(pieces) == 1 or n < PIECEWISE_MIN_OUT:
        delta = torch.bmm(shrunk, bt[1:])
    else:
        step, starts = rank // len(pieces), [0, *itertools.accumulate(pieces)]
        delta = torch.cat([
            torch.bmm(shrunk[:, :, p * step:(p + 1) * step],
                      bt[1:, p * step:(p + 1) * step, starts[p]:starts[p + 1]])
            for p in range(len(pieces))], dim=2)
    out.index_add_(0, seg.gather, delta.view(-1, n).to(out.dtype))


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
