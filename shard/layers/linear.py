"""Tensor-parallel linear layers: each rank holds a slice of the weight and computes its share.

Column-parallel splits output features (no communication; the next row-parallel layer consumes
the split activations); row-parallel splits input features and sums the partial outputs.

Each holds a LinearWeight: a dense tensor, multiplied by F.linear exactly as before quantization
existed (that path is what float models decode through), or a QuantizedWeight, which carries its
own kernel; the bias stays dense and is added after it. The weights come from the checkpoint's
LinearLoader (weights.linear_loader), so the same layers read float, GPTQ, AWQ or FP8 tensors;
the biases are read here, sliced as the weights are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.device.distributed import Dist
from pytgi_shard.quantization.dense_loader import read_column
from pytgi_shard.quantization.linear_weight import LinearWeight, OutputPart, QuantizedWeight
from pytgi_shard.weights.reader import Weights


def _held(weight: LinearWeight) -> LinearWeight:
    """What a layer stores as its `weight`: a frozen Parameter, or the QuantizedWeight module."""
    if isinstance(weight, QuantizedWeight):
        return weight
    return nn.Parameter(weight, requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y_rank = x @ W_rank^T + b_rank, with W split by output features across ranks."""

    weight: LinearWeight

    def __init__(self, weight: LinearWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = _held(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def load(cls, weights: Weights, prefix: str, bias: bool) -> ColumnParallelLinear:
        return cls.load_packed(weights, [prefix], bias)

    @classmethod
    def load_packed(
        cls, weights: Weights, prefixes: list[str], bias: bool
    ) -> ColumnParallelLinear:
        """Several projections fused into one matmul (gate+up), each split across ranks alike."""
        dist = weights.dist
        return cls.load_parts(weights, prefixes, [(dist.rank, dist.world_size)] * len(prefixes),
                              bias)

    @classmethod
    def load_parts(
        cls, weights: Weights, prefixes: Sequence[str], parts: Sequence[OutputPart], bias: bool
    ) -> ColumnParallelLinear:
        """Of each projection `prefixes[i]`, output part `parts[i]`, fused into one matmul."""
        weight = weights.linear_loader.column(weights, prefixes, parts)
        b = read_column(weights, prefixes, parts, "bias") if bias else None
        return cls(weight, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight, self.bias)
        y = weight(x)
        return y if self.bias is None else y + self.bias


def kv_head_partition(num_kv_heads: int, dist: Dist) -> tuple[int, int]:
    """(index, parts): this rank holds KV head block `index` of `parts` equal blocks.

    KV heads split across ranks when they divide evenly; with fewer KV heads than ranks (GQA with
    one or two KV heads) each KV head is replicated on the world_size / num_kv_heads ranks whose
    query heads use it.
    """
    world = dist.world_size
    if num_kv_heads % world == 0:
        return dist.rank, world
    if world % num_kv_heads == 0:
        return dist.rank // (world // num_kv_heads), num_kv_heads
    raise ValueError(
        f"{num_kv_heads} key/value heads cannot be split or replicated over {world} shards: "
        f"use a number of shards that divides or is a multiple of {num_kv_heads}"
    )


def head_partition(num_heads: int, num_kv_heads: int, dist: Dist) -> tuple[int, int]:
    """kv_head_partition, once the query heads are known to split evenly over the ranks."""
    if num_heads % dist.world_size != 0:
        raise ValueError(
            f"{num_heads} attention heads do not split evenly over {dist.world_size} shards"
        )
    return kv_head_partition(num_kv_heads, dist)


def load_qkv(
    weights: Weights, prefix: str, num_heads: int, num_kv_heads: int, bias: bool
) -> ColumnParallelLinear:
    """q_proj, k_proj and v_proj of `prefix` fused into one column-parallel projection (fused
    checkpoint tensors: layers/fused_qkv.py)."""
    index, parts = head_partition(num_heads, num_kv_heads, weights.dist)
    dist = weights.dist
    return ColumnParallelLinear.load_parts(
        weights,
        [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
        [(dist.rank, dist.world_size), (index, parts), (index, parts)],
        bias,
    )


def load_fused_column(weights: Weights, name: str, parts: int, bias: bool) -> ColumnParallelLinear:
    """A checkpoint's `parts` equal projections stacked in one tensor (Phi-3's gate_up_proj),
    each split across ranks: this rank's slice of each, in order, as load_packed gives them."""
    dist = weights.dist
    world = dist.world_size
    pieces = [(p * world + dist.rank, parts * world) for p in range(parts)]
    return ColumnParallelLinear.load_parts(weights, [name] * parts, pieces, bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_rank @ W_rank^T, plus the bias once (rank 0 adds it)."""

    weight: LinearWeight

    def __init__(self, weight: LinearWeight, bias: torch.Tensor | None, dist: Dist) -> None:
        super().__init__()
        self.weight = _held(weight)
        self.bias = (
            nn.Parameter(bias, requires_grad=False) if bias is not None and dist.rank == 0 else None
        )
        self.dist = dist

    @classmethod
    def load(cls, weights: Weights, prefix: str, bias: bool) -> RowParallelLinear:
        weight = weights.linear_loader.row(weights, prefix)
        b = weights.get_tensor(f"{prefix}.bias") if bias else None
        return cls(weight, b, weights.dist)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share before the all-reduce (a LoRA update on this rank's input slice is
        added to it: the all-reduce then sums the update too)."""
        weight = self.weight
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight, self.bias)
        y = weight(x)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dist.all_reduce(self.partial(x))
