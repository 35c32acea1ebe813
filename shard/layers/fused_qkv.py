"""Fused query/key/value projections of checkpoints, sliced per rank into [q | k | v] order.

Checkpoints fuse the three projections in one tensor, in one of two layouts:

- stacked: all query heads, then the key heads, then the value heads (GPT-2's c_attn,
  StarCoder's multi-query c_attn, Falcon-7B's query_key_value, MPT's Wqkv, Phi-3's qkv_proj);
- grouped: for each KV head, its `group` query heads, then its key, then its value head
  (Falcon-40B's new decoder architecture); one query head per group is the per-head interleaved
  layout of GPT-NeoX, BLOOM and GPT-BigCode without multi-query.

Either way each rank keeps its query heads and the KV heads they read (replicated when there are
fewer KV heads than ranks, see linear.kv_head_partition), reordered at load time into the
[q | k | v] rows every model then splits alike. GPT-2's Conv1D stores weights as [in, out]:
`transposed` reads the output features along dim 1 and transposes them.

These layouts are read as float tensors (Weights.linear_from_float): quantize-on-load applies to
them, pre-quantized checkpoints of these families are refused at start-up
(models/quantization.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pytgi_shard.layers.linear import ColumnParallelLinear, head_partition
from pytgi_shard.weights.reader import Weights


@dataclass(frozen=True)
class HeadShape:
    """The attention heads of a checkpoint (whole model, not per rank)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rows(weights: Weights, name: str, start: int, stop: int, transposed: bool) -> torch.Tensor:
    """Output features start:stop of weight or bias `name`, as [features, in] or [features]."""
    if transposed and len(weights.shape(name)) == 2:
        return weights.get_range(name, 1, start, stop).t().contiguous()
    return weights.get_range(name, 0, start, stop)


def _check_heads(heads: HeadShape, weights: Weights) -> tuple[int, int]:
    return head_partition(heads.num_heads, heads.num_kv_heads, weights.dist)


def load_stacked_qkv(
    weights: Weights, prefix: str, heads: HeadShape, bias: bool, transposed: bool = False
) -> ColumnParallelLinear:
    """[q heads | k heads | v heads] rows of `prefix`.weight/.bias, this rank's heads of each."""
    index, parts = _check_heads(heads, weights)
    dist, d = weights.dist, heads.head_dim
    q_rows = heads.num_heads * d // dist.world_size
    kv_rows = heads.num_kv_heads * d // parts
    k_start = heads.num_heads * d
    v_start = k_start + heads.num_kv_heads * d

    def read(name: str) -> torch.Tensor:
        return torch.cat([
            _rows(weights, name, dist.rank * q_rows, (dist.rank + 1) * q_rows, transposed),
            _rows(weights, name, k_start + index * kv_rows, k_start + (index + 1) * kv_rows,
                  transposed),
            _rows(weights, name, v_start + index * kv_rows, v_start + (index + 1) * kv_rows,
                  transposed),
        ])

    return _column(weights, read, prefix, bias)


def load_grouped_qkv(
    weights: Weights, prefix: str, heads: HeadShape, bias: bool
) -> ColumnParallelLinear:
    """Rows laid out [kv head, group + 2, head_dim] (q heads, k, v per group), as [q | k | v]."""
    index, parts = _check_heads(heads, weights)
    dist, d, group = weights.dist, heads.head_dim, heads.group
    groups = heads.num_kv_heads // parts
    per_group = (group + 2) * d
    # With fewer KV heads than ranks, `share` ranks split one group's query heads.
    share = dist.world_size // parts
    q_lo = (dist.rank % share) * (group // share)
    q_hi = q_lo + group // share

    def read(name: str) -> torch.Tensor:
        rows = weights.get_range(name, 0, index * groups * per_group, (index + 1) * groups * per_group)
        blocks = rows.view(groups, group + 2, d, *rows.shape[1:])
        q = blocks[:, q_lo:q_hi].reshape(-1, *rows.shape[1:])
        k = blocks[:, group].reshape(-1, *rows.shape[1:])
        v = blocks[:, group + 1].reshape(-1, *rows.shape[1:])
        return torch.cat([q, k, v]).contiguous()

    return _column(weights, read, prefix, bias)


def _column(
    weights: Weights, read: Callable[[str], torch.Tensor], prefix: str, bias: bool
) -> ColumnParallelLinear:
    """The layer of `prefix`.weight and .bias as `read` reorders them; the weight quantized on
    load when --quantize asks (weights.linear_from_float)."""
    weight = weights.linear_from_float(read(f"{prefix}.weight"))
    return ColumnParallelLinear(weight, read(f"{prefix}.bias") if bias else None)
