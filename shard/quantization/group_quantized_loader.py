"""What the GPTQ and AWQ checkpoint loaders share: both read a rank's slice of packed integers,
scales and zeros into a GroupQuantized weight and hand it to the same integer kernels, so only
the reading of one projection differs between them (`read_column_part`, `read_row`).

Projections the quantizer skipped (a `.weight` and no `.qweight`) load dense; a fused column
(q|k|v, gate|up) reads each projection's output part and concatenates them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pytgi_shard.quantization.checkpoint_tensors import CheckpointTensors
from pytgi_shard.quantization.dense_loader import DenseLoader
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.group_quantized import GroupQuantized, concat_outputs
from pytgi_shard.quantization.int_kernel_choice import IntKernel, build_int_weight
from pytgi_shard.quantization.linear_weight import LinearLoader, LinearWeight, OutputPart


def check_bits(method: str, bits: int, supported: Sequence[int]) -> None:
    """The one-line refusal of a bit width this reader has no packing for."""
    if bits not in supported:
        raise QuantizationError(
            f"{method} with {bits} bits is not supported (pytgi reads {method} at "
            f"{' and '.join(str(b) for b in supported)} bits)"
        )


def quantized_prefixes(weights: CheckpointTensors, prefixes: Sequence[str]) -> bool:
    """True when every projection is stored quantized, False when none is (the quantizer
    skipped it); a fused group mixing both is refused."""
    stored = [f"{p}.qweight" in weights for p in prefixes]
    if all(stored):
        return True
    if not any(stored):
        return False
    raise QuantizationError(
        f"{', '.join(prefixes)} are fused into one matmul but only some are quantized"
    )


class GroupQuantizedLoader(ABC):
    """A LinearLoader of group-quantized checkpoints; `kernel` forces one (tests, benchmarks),
    else each layer's is chosen by int_kernel_choice."""

    def __init__(self, kernel: IntKernel | None, dense: LinearLoader | None) -> None:
        self.kernel = kernel
        self.dense = dense if dense is not None else DenseLoader()

    @abstractmethod
    def read_column_part(self, weights: CheckpointTensors, prefix: str, part: OutputPart) -> GroupQuantized:
        """Output part `part` of projection `prefix`, every input."""

    @abstractmethod
    def read_row(self, weights: CheckpointTensors, prefix: str) -> GroupQuantized:
        """What row() hands its kernel: this rank's input features of every output."""

    def column(
        self, weights: CheckpointTensors, prefixes: Sequence[str], parts: Sequence[OutputPart]
    ) -> LinearWeight:
        if not quantized_prefixes(weights, prefixes):
            return self.dense.column(weights, prefixes, parts)
        return self._build(weights, self.read_column(weights, prefixes, parts))

    def row(self, weights: CheckpointTensors, prefix: str) -> LinearWeight:
        if not quantized_prefixes(weights, [prefix]):
            return self.dense.row(weights, prefix)
        return self._build(weights, self.read_row(weights, prefix))

    def read_column(
        self, weights: CheckpointTensors, prefixes: Sequence[str], parts: Sequence[OutputPart]
    ) -> GroupQuantized:
        """What column() hands its kernel: each projection's output part, fused."""
        pieces = [
            self.read_column_part(weights, p, part)
            for p, part in zip(prefixes, parts, strict=True)
        ]
        return concat_outputs(pieces, prefixes)

    def _build(self, weights: CheckpointTensors, weight: GroupQuantized) -> LinearWeight:
        dist = weights.dist
        return build_int_weight(weight, dist.device, weights.dtype, self.kernel, dist.caps)
