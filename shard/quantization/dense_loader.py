"""The LinearLoader of float checkpoints: each projection's `.weight`, this rank's slice of it.

It reads exactly what the parallel linears read before loaders existed (the same get_part calls
in the same order), so a float model loads bit for bit as it did. Quantize-on-load reuses it:
`finish` turns the assembled float weight of one layer into what the layer holds (a
QuantizedWeight's from_float), right after it is read, so only one layer's float weight is ever
on the device at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pytgi_shard.quantization.checkpoint_tensors import CheckpointTensors
from pytgi_shard.quantization.linear_weight import LinearWeight, OutputPart


def keep_float(weight: torch.Tensor) -> LinearWeight:
    """The float checkpoint's finish: the weight as read."""
    return weight


class DenseLoader:
    """Float `.weight` tensors, sliced per rank; `finish` applied to each layer's weight."""

    def __init__(self, finish: Callable[[torch.Tensor], LinearWeight] = keep_float) -> None:
        self.finish = finish

    def column(
        self, weights: CheckpointTensors, prefixes: Sequence[str], parts: Sequence[OutputPart]
    ) -> LinearWeight:
        return self.finish(read_column(weights, prefixes, parts, "weight"))

    def row(self, weights: CheckpointTensors, prefix: str) -> LinearWeight:
        return self.finish(weights.get_sharded(f"{prefix}.weight", dim=1))


def read_column(
    weights: CheckpointTensors, prefixes: Sequence[str], parts: Sequence[OutputPart], suffix: str
) -> torch.Tensor:
    """Of each `prefixes[i].suffix`, output part `parts[i]`, concatenated along dim 0 (also how
    the column-parallel layers read their biases)."""
    if len(prefixes) != len(parts):
        raise ValueError(f"{len(prefixes)} projections but {len(parts)} output parts")
    tensors = [
        weights.get_part(f"{prefix}.{suffix}", 0, index, count)
        for prefix, (index, count) in zip(prefixes, parts, strict=True)
    ]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
