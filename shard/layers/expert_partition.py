"""Which part of the experts a rank holds, and their weights stacked for batched compute.

Two ways to split E experts of intermediate size I over `world` ranks (moe.py says which pytgi
uses and why):

- tensor parallel ("tp"): every rank holds all E experts, each expert's gate/up split by output
  features and its down by input features (I / world columns), as a dense MLP is split;
- expert parallel ("ep"): rank r holds experts [r * E / world, (r + 1) * E / world) whole.

Either way each rank computes a partial sum of the block's output for every token and one
all-reduce completes it: the hidden states entering the block are the same on every rank (the
attention's row-parallel output was all-reduced), so expert parallelism needs no all-to-all here.

The weights of a rank's experts are stacked in one tensor per projection, so that a grouped
kernel indexes an expert instead of looping over modules:

    gate_up [experts, 2 * inter, hidden]   gate rows then up rows (one matmul for both)
    down    [experts, hidden, inter]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pytgi_shard.device.distributed import Dist
from pytgi_shard.weights.reader import Weights

Sharding = Literal["tp", "ep"]


@dataclass(frozen=True, slots=True)
class ExpertPartition:
    """This rank's experts [first, first + count) of `total`, each expert's intermediate features
    split into `column_parts` parts of which it holds part `column_index`."""

    total: int
    first: int
    count: int
    column_index: int
    column_parts: int

    @classmethod
    def of(cls, sharding: Sharding, num_experts: int, dist: Dist) -> ExpertPartition:
        rank, world = dist.rank, dist.world_size
        if sharding == "tp":
            return cls(num_experts, 0, num_experts, rank, world)
        if num_experts % world:
            raise ValueError(
                f"{num_experts} experts do not split evenly over {world} shards (expert parallel)"
            )
        count = num_experts // world
        return cls(num_experts, rank * count, count, 0, 1)

    def local(self, experts: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's (0..count-1); another rank's experts -> `count`,
        which sorts after this rank's and which the grouped paths skip."""
        if self.count == self.total:
            return experts
        local = experts - self.first
        return torch.where((local >= 0) & (local < self.count), local, self.count)


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """An expert's projections in the checkpoint: `{prefix}.experts.{i}.{gate|up|down}.weight`
    (Mixtral: w1, w3, w2; Qwen: gate_proj, up_proj, down_proj)."""

    gate: str
    up: str
    down: str


def load_stacked_experts(
    weights: Weights, prefix: str, names: ExpertNames, partition: ExpertPartition
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up, down) of this rank's experts, each rank reading only its slices from disk and
    copying them into the stacked tensors one expert at a time (no second copy of the layer)."""
    index, parts = partition.column_index, partition.column_parts
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    for i in range(partition.count):
        base = f"{prefix}.experts.{partition.first + i}"
        gate = weights.get_part(f"{base}.{names.gate}.weight", 0, index, parts)
        up = weights.get_part(f"{base}.{names.up}.weight", 0, index, parts)
        d = weights.get_part(f"{base}.{names.down}.weight", 1, index, parts)
        if gate_up is None or down is None:
            inter, hidden = gate.shape
            gate_up = gate.new_empty(partition.count, 2 * inter, hidden)
            down = d.new_empty(partition.count, hidden, inter)
        gate_up[i, : gate.shape[0]].copy_(gate)
        gate_up[i, gate.shape[0] :].copy_(up)
        down[i].copy_(d)
    if gate_up is None or down is None:
        raise ValueError(f"{prefix} holds no experts on this rank")
    return gate_up, down
