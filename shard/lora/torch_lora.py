"""The LoRA update with torch ops, over a layer's slot tensors (layer.py: `a` [slots, rank, in],
`bt` [slots, rank, out], slot 0 zeros) and one slot index per flat token.

Two ways, each where it is the faster or the only one allowed:
- grouped: per slot present, gather its rows, shrink, expand, add back (index_select, two small
  matmuls, index_add_). Work only for the rows of each adapter, but one host read of the slots
  present per forward (a device sync on a GPU) and four ops per adapter present.
- dense: every row shrunk by every slot's A in one matmul, the other slots' ranks zeroed by a
  one-hot mask of the row's slot, one expand over all slots. No host read (capturable in a CUDA
  graph), a fixed handful of ops, but the work of every slot for every row.
Measured on the CPU by bench/experiments/lora_overhead.py (its numbers: /tmp/docs/lora-kernel.md).
"""

from __future__ import annotations

import torch


def slot_groups(index: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, the flat rows using it) for every non-zero slot in `index` (a host read)."""
    groups = []
    for slot in torch.unique(index).tolist():
        if slot != 0:
            groups.append((int(slot), torch.nonzero(index == slot).flatten()))
    return groups


def add_grouped(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                ranks: list[int], groups: list[tuple[int, torch.Tensor]]) -> None:
    """out[rows of s] += (x[rows of s] · A[s]ᵀ) · Bᵀ[s] for each (s, rows) of `groups`."""
    for slot, rows in groups:
        rank = ranks[slot]
        if rank == 0:
            continue  # this adapter does not target this layer (or was cleared)
        delta = (x.index_select(0, rows) @ a[slot, :rank].t()) @ bt[slot, :rank]
        out.index_add_(0, rows, delta.to(out.dtype))


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
