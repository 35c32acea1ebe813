"""GPT-2's Conv1D checkpoints: linear weights stored [in, out], loaded transposed into the
parallel linears (column-parallel slices the output features, dim 1 on disk; row-parallel the
input features, dim 0 on disk), so the forward is the same F.linear as every other model's, and
--quantize's on-load quantization applies to them as to any float weight."""

from __future__ import annotations

from pytgi_shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from pytgi_shard.weights.reader import Weights


def load_conv1d_column(weights: Weights, prefix: str) -> ColumnParallelLinear:
    weight = weights.get_sharded(f"{prefix}.weight", dim=1).t().contiguous()
    return ColumnParallelLinear(
        weights.linear_from_float(weight), weights.get_sharded(f"{prefix}.bias", dim=0)
    )


def load_conv1d_row(weights: Weights, prefix: str) -> RowParallelLinear:
    weight = weights.get_sharded(f"{prefix}.weight", dim=0).t().contiguous()
    return RowParallelLinear(
        weights.linear_from_float(weight), weights.get_tensor(f"{prefix}.bias"), weights.dist
    )
