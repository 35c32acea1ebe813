"""How PyTorch's int4 packed matmul reads a group-quantized weight whatever its grouping.

The op takes one (scale, offset) per run of `group_size` consecutive inputs, group_size one of
32, 64, 128, 256. A weight's inputs sorted by group (a permutation for act-order) give such runs
when every group has the same number of inputs and the op has a size dividing it (a group of 512
or GPTQ's group_size -1, one group of every input, is read as runs of 256 sharing a scale).
Otherwise (a row shard of an act-order weight holds each group's inputs unevenly; a group count
such as 48) every group's run is padded with zero inputs to a multiple of 32: the activations
gain a zero column, gathered into the pad positions, so each pad adds exactly 0. The padding
costs compute (for two act-order row shards about a quarter more inputs), never accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The group sizes the op accepts; the smallest is what uneven groups are padded to.
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class Int4PackLayout:
    """Inputs taken in `perm` order (None: as stored; the index in_features: a zero pad) fall
    into consecutive runs of `group_size`, run r belonging to group `groups[r]`."""

    in_features: int
    group_size: int
    perm: torch.Tensor | None
    groups: torch.Tensor

    @property
    def padded(self) -> bool:
        return self.perm is not None and self.perm.numel() > self.in_features


def op_group_size(count: int) -> int:
    """The largest group size the op takes that divides `count` (0: none)."""
    return next((s for s in reversed(INT4PACK_GROUP_SIZES) if count % s == 0), 0)


def int4pack_layout(g_idx: torch.Tensor) -> Int4PackLayout:
    """The op's reading of inputs grouped by `g_idx` (module docstring)."""
    in_features = g_idx.numel()
    sorted_groups, order = torch.sort(g_idx.long(), stable=True)
    present, counts = torch.unique_consecutive(sorted_groups, return_counts=True)
    size = op_group_size(int(counts[0]))
    if size and bool((counts == counts[0]).all()):
        identity = torch.equal(order, torch.arange(in_features, device=g_idx.device))
        return Int4PackLayout(in_features, size, None if identity else order, sorted_groups[::size])
    size = INT4PACK_GROUP_SIZES[0]
    padded_counts = (counts + size - 1) // size * size
    run_starts = torch.cumsum(padded_counts, 0) - padded_counts
    group_starts = torch.cumsum(counts, 0) - counts
    # Input j of the sorted order, the k-th of its group, lands at its run's start + k.
    which = torch.repeat_interleave(torch.arange(present.numel(), device=g_idx.device), counts)
    slots = run_starts[which] + torch.arange(in_features, device=g_idx.device) - group_starts[which]
    perm = torch.full((int(padded_counts.sum()),), in_features, dtype=torch.long,
                      device=g_idx.device)  # fmt: skip
    perm[slots] = order
    groups = torch.repeat_interleave(present, padded_counts // size)
    return Int4PackLayout(in_features, size, perm, groups)
