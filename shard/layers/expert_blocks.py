"""(token, expert) assignments laid out for a grouped GEMM: sorted by expert, each expert's group
padded to a multiple of the kernel's row tile, so that no tile crosses from one expert to the next.

    assignments (flat index a = token * k + j) sorted by expert:
        expert 0: a a a . | expert 2: a . . . | expert 3: a a a a a . . .     (. = padding)
    block_experts: one entry per tile of `block_m` rows: 0, 2, 3, 3, E, E ...  (E = unused)

Computed on the device with fixed shapes (they depend only on the number of assignments, the
number of experts and the tile), and without reading anything back to the host: a CUDA graph
captures it. The layout is sized for the worst case: at most min(E, A) experts have tokens, each
padding fewer than block_m rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    # [rows]: the flat assignment index of each row, `num_assignments` on padding rows.
    sorted_ids: torch.Tensor
    # [rows // block_m]: the expert each tile of rows belongs to, `num_experts` past the last.
    block_experts: torch.Tensor
    block_m: int
    num_assignments: int
    num_experts: int


def padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Rows of the layout: every assignment plus each non-empty expert's padding, in whole tiles."""
    worst = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return -(-worst // block_m) * block_m


def expert_blocks(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """The layout of `experts` [tokens, k] (ids 0..num_experts, num_experts meaning an expert
    this rank does not hold: such assignments get no row)."""
    flat = experts.reshape(-1)
    count = flat.numel()
    rows = padded_rows(count, num_experts, block_m)
    sizes = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    sizes.scatter_add_(0, flat, torch.ones_like(flat))
    sizes = sizes[:num_experts]
    padded = (sizes + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    starts = sizes.cumsum(0) - sizes
    sorted_experts, order = torch.sort(flat, stable=True)
    held = sorted_experts < num_experts
    expert = sorted_experts.clamp(max=num_experts - 1)
    rank_in_group = torch.arange(count, device=flat.device) - starts[expert]
    destination = padded_ends[expert] - padded[expert] + rank_in_group
    # Assignments to experts held elsewhere land in one spare row, cut off below.
    destination = torch.where(held, destination, rows)
    sorted_ids = torch.full((rows + 1,), count, dtype=torch.long, device=flat.device)
    sorted_ids.scatter_(0, destination, order)
    tile_starts = torch.arange(0, rows, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_ends, tile_starts, right=True)
    return ExpertBlocks(sorted_ids[:rows], block_experts, block_m, count, num_experts)
