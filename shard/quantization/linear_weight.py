"""What a linear layer multiplies by: a dense tensor, or a quantized weight that knows its own
kernel; and how a checkpoint's linear weights are read for one rank.

Tensor-parallel layers (layers/linear.py) hold a LinearWeight and never look inside it, so a
quantization method is one QuantizedWeight subclass (its storage and matmul) plus, when the
checkpoint stores it pre-quantized, one LinearLoader (which tensors to read and how a rank's
slice of them is cut). The Weights of a checkpoint carry the LinearLoader its quantization needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol, TypeAlias

import torch
from torch import nn

from pytgi_shard.quantization.checkpoint_tensors import CheckpointTensors


class QuantizedWeight(nn.Module, ABC):
    """A [out_features, in_features] weight held in a compressed form with its matmul."""

    in_features: int
    out_features: int
    # Whether the matmul can run inside a CUDA graph: no host synchronisation, no shapes that
    # depend on the data (LLM.int8's outlier columns are found on the host: it cannot).
    graph_capturable: bool = True

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T for x [..., in_features], in x's dtype (the bias is the layer's business)."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The weight as the float [out_features, in_features] the kernel computes with."""

    def nbytes(self) -> int:
        """Bytes this weight occupies on its device (scales and zeros included)."""
        tensors = [*self.parameters(), *self.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)


# What ColumnParallelLinear / RowParallelLinear multiply by.
LinearWeight: TypeAlias = torch.Tensor | QuantizedWeight


# (index, parts): part `index` of `parts` equal slices of a projection's output features.
OutputPart: TypeAlias = tuple[int, int]


class LinearLoader(Protocol):
    """Reads one rank's share of a checkpoint's linear weights (the `.weight` of dense
    checkpoints; qweight/scales/qzeros/g_idx of GPTQ; ...). Biases stay dense and are read by
    the layers themselves."""

    def column(
        self, weights: CheckpointTensors, prefixes: Sequence[str], parts: Sequence[OutputPart]
    ) -> LinearWeight:
        """Column-parallel: of each projection `prefixes[i]`, the output slice `parts[i]`,
        concatenated along the output features in order (fused q|k|v, gate|up)."""
        ...

    def row(self, weights: CheckpointTensors, prefix: str) -> LinearWeight:
        """Row-parallel: this rank's 1/world_size slice of `prefix`'s input features."""
        ...
