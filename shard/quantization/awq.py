"""AWQ checkpoints in AutoAWQ's GEMM layout (version "gemm", zero_point true, 4 bits), read per
rank into the GroupQuantized form GPTQ weights take, so both share the kernels.

Layout of a quantized linear `prefix` (AutoAWQ WQLinear_GEMM):
  qweight int32 [in, out / 8]      packed along the outputs: the value at bits 4j of word c is
                                   output 8c + AWQ_ORDER[j], AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
  qzeros  int32 [groups, out / 8]  the zero points, packed the same way (stored as they are)
  scales  float16 [groups, out]
with groups of group_size consecutive inputs and W[o, i] = scales[i // gs, o] *
(q[i, o] - zero[i // gs, o]). Other AWQ versions (gemv, gemv_fast, marlin, exllama) pack
differently and zero_point false stores no zeros: both are refused at start-up.
"""

from __future__ import annotations

import torch

from pytgi_shard.quantization.checkpoint_tensors import CheckpointTensors
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.group_quantized import GroupQuantized
from pytgi_shard.quantization.group_quantized_loader import GroupQuantizedLoader, check_bits
from pytgi_shard.quantization.group_sharding import input_range, output_range
from pytgi_shard.quantization.int_kernel_choice import IntKernel
from pytgi_shard.quantization.int_packing import awq_columns_to_natural, pack_int32, unpack_int32
from pytgi_shard.quantization.linear_weight import LinearLoader, OutputPart

AWQ_BITS = 4
WORD = 32 // AWQ_BITS


class AWQLoader(GroupQuantizedLoader):
    """LinearLoader of AWQ GEMM checkpoints."""

    def __init__(
        self, bits: int, group_size: int, zero_point: bool = True, version: str = "gemm",
        kernel: IntKernel | None = None, dense: LinearLoader | None = None,
    ) -> None:  # fmt: skip
        check_bits("AWQ", bits, (AWQ_BITS,))
        if version.lower() != "gemm":
            raise QuantizationError(
                f"AWQ version {version!r} is not supported (pytgi reads AWQ's GEMM layout)"
            )
        if not zero_point:
            raise QuantizationError(
                "AWQ without zero points (zero_point false) is not supported "
                "(pytgi reads AWQ GEMM checkpoints with qzeros)"
            )
        if group_size <= 0:
            raise QuantizationError(f"AWQ group_size {group_size} is not supported (must be > 0)")
        self.group_size = group_size
        super().__init__(kernel, dense)

    def read_column_part(
        self, weights: CheckpointTensors, prefix: str, part: OutputPart
    ) -> GroupQuantized:
        return self._read(weights, prefix, column=part)

    def read_row(self, weights: CheckpointTensors, prefix: str) -> GroupQuantized:
        return self._read(weights, prefix, column=None)

    def _groups(self, weights: CheckpointTensors, prefix: str) -> torch.Tensor:
        in_features = weights.shape(f"{prefix}.qweight")[0]
        groups = weights.shape(f"{prefix}.scales")[0]
        if in_features % self.group_size or in_features // self.group_size != groups:
            raise QuantizationError(
                f"{prefix} has {in_features} inputs and {groups} groups of scales, which is "
                f"not group_size {self.group_size}"
            )
        rows = torch.arange(in_features, device=weights.dist.device, dtype=torch.int32)
        return rows // self.group_size

    def _read(self, weights: CheckpointTensors, prefix: str, column: OutputPart | None) -> GroupQuantized:
        """Column part `column` of every input, or (None) this rank's inputs of every output:
        one dimension is cut either way, so each tensor is read with one ranged read."""
        g_idx = self._groups(weights, prefix)
        if column is not None:
            out_features = weights.shape(f"{prefix}.qweight")[1] * WORD
            start, stop = output_range(prefix, out_features, column, WORD)
            packed_cuts = (1, start // WORD, stop // WORD)
            scale_cuts = (1, start, stop)
        else:
            # Inputs are repacked along their own axis (GPTQ's layout): whole words of 8.
            dist = weights.dist
            start, stop = input_range(prefix, g_idx, dist.rank, dist.world_size, WORD)
            first, last = int(g_idx[start]), int(g_idx[stop - 1]) + 1
            packed_cuts = scale_cuts = (0, first, last)
            g_idx = g_idx[start:stop] - first

        def unpacked(name: str, cuts: tuple[int, int, int]) -> torch.Tensor:
            words = weights.get_range(f"{prefix}.{name}", *cuts)
            return awq_columns_to_natural(unpack_int32(words, AWQ_BITS, dim=1))

        if column is not None:
            q = unpacked("qweight", packed_cuts)
        else:
            q = unpacked("qweight", (0, start, stop))
        return GroupQuantized(
            qweight=pack_int32(q, AWQ_BITS, dim=0),
            zeros=unpacked("qzeros", packed_cuts),
            scales=weights.get_range(f"{prefix}.scales", *scale_cuts, cast=False),
            g_idx=g_idx,
            bits=AWQ_BITS,
            dtype=weights.dtype,
        )
