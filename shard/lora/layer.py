"""LoRA applied per row: each adapted linear layer adds scale·(x·Aᵀ)·Bᵀ to the rows of each
adapter present in the forward, the base model's rows untouched.

The rows of one adapter are gathered (index_select), shrunk by A, expanded by B and added back
(index_add_): the BGMV/SGMV idea with plain torch ops, one pair of small matmuls per adapter
present rather than per row. The grouping (which rows belong to which adapter) is computed once
per forward by `RowAdapters.bind` and read by every layer, not recomputed per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pytgi_shard.layers.linear import RowParallelLinear


@dataclass(slots=True)
class RowAdapters:
    """The current forward's rows of each adapter: shared by every LoraLinear of one model, set
    by the ModelRunner around each forward (empty: every row runs the base model)."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def bind(self, adapters: torch.Tensor | None) -> None:
        """`adapters`: one adapter index per flat token (0: base). One host read of the indices
        present per forward (a device sync on a GPU; why CUDA graphs are off with adapters)."""
        self.groups = []
        if adapters is None:
            return
        for index in torch.unique(adapters).tolist():
            if index != 0:
                self.groups.append((int(index), torch.nonzero(adapters == index).flatten()))

    def clear(self) -> None:
        self.groups = []


class LoraLinear(nn.Module):
    """base(x) plus each adapter's low-rank update on its own rows.

    `a[i]` is adapter i+1's down projection (rank_total × in), `b[i]` its up projection
    (out × rank_total) with the scale folded in; fused layers (q|k|v, gate|up) stack the pieces'
    A and place each piece's B in its own output rows, zeros elsewhere, so one shrink and one
    expand serve the whole fused output. On several ranks each holds the slices of A and B that
    match its slice of the layer (shard/lora/attach.py); a row-parallel layer's update, computed
    from this rank's input slice, is added before the all-reduce, which sums it with the others'.
    """

    def __init__(self, base: nn.Module, a: list[torch.Tensor], b: list[torch.Tensor],
                 rows: RowAdapters) -> None:
        super().__init__()
        self.base = base
        self.a = a
        self.b = b
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if isinstance(base, RowParallelLinear):
            return base.dist.all_reduce(self._add_updates(x, base.partial(x)))
        return self._add_updates(x, base(x))

    def _add_updates(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each present adapter's update on its rows (in place)."""
        groups = self.rows.groups
        if not groups:
            return y
        flat = x.reshape(-1, x.shape[-1])
        out = y.reshape(-1, y.shape[-1])
        for index, rows in groups:
            a, b = self.a[index - 1], self.b[index - 1]
            if a.shape[0] == 0:
                continue  # this adapter does not target this layer
            delta = (flat.index_select(0, rows) @ a.t()) @ b.t()
            out.index_add_(0, rows, delta.to(out.dtype))
        return y
