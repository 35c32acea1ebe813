"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum), read per rank into GroupQuantized weights.

Layout of a quantized linear `prefix` with `bits` in (4, 8), pack = 32 / bits:
  qweight int32 [in / pack, out]   input feature pack*r + j of column o at bits j*bits of [r, o]
  qzeros  int32 [groups, out / pack]   column pack*c + j of group g at bits j*bits of [g, c]
  scales  float16 [groups, out]
  g_idx   int32 [in]   group of each input feature (arange // group_size; a permutation of that
                       under act-order, desc_act); absent in old checkpoints: arange // group_size
and W[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o]). checkpoint_format "gptq"
(v1, AutoGPTQ) stores each zero minus one (zero = stored + 1, as its kernels and TGI's add back);
"gptq_v2" (GPTQModel) stores the zero itself. `sym` only says what the quantizer wrote into
qzeros (2**(bits-1) everywhere); it is read the same way. 3-bit packing straddles words and is
refused. Projections the quantizer skipped (a `.weight` and no `.qweight`) load dense.
"""

from __future__ import annotations

import torch

from pytgi_shard.quantization.checkpoint_tensors import CheckpointTensors
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.group_quantized import GroupQuantized
from pytgi_shard.quantization.group_quantized_loader import GroupQuantizedLoader, check_bits
from pytgi_shard.quantization.group_sharding import input_range, is_sorted, output_range
from pytgi_shard.quantization.int_kernel_choice import IntKernel
from pytgi_shard.quantization.int_packing import PACKED_BITS, unpack_int32
from pytgi_shard.quantization.linear_weight import LinearLoader, OutputPart

CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> what to add to a stored zero


class GPTQLoader(GroupQuantizedLoader):
    """LinearLoader of GPTQ checkpoints."""

    def __init__(
        self, bits: int, group_size: int, desc_act: bool = False, sym: bool = True,
        checkpoint_format: str = "gptq", kernel: IntKernel | None = None,
        dense: LinearLoader | None = None,
    ) -> None:  # fmt: skip
        check_bits("GPTQ", bits, PACKED_BITS)
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise QuantizationError(
                f"GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                f"(pytgi reads {' and '.join(CHECKPOINT_FORMATS)})"
            )
        self.bits = bits
        self.pack = 32 // bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.zero_offset = CHECKPOINT_FORMATS[checkpoint_format]
        super().__init__(kernel, dense)

    def g_idx(self, weights: CheckpointTensors, prefix: str) -> torch.Tensor:
        """The checkpoint's g_idx, or arange // group_size when it stores none."""
        in_features = weights.shape(f"{prefix}.qweight")[0] * self.pack
        if f"{prefix}.g_idx" in weights:
            g_idx = weights.get_tensor(f"{prefix}.g_idx").to(torch.int32)
            if g_idx.shape != (in_features,):
                raise QuantizationError(
                    f"{prefix}.g_idx has {g_idx.numel()} entries for {in_features} inputs"
                )
            return g_idx
        if self.desc_act:
            raise QuantizationError(f"{prefix} is act-order (desc_act) but stores no g_idx")
        group = self.group_size if self.group_size > 0 else in_features
        return torch.arange(in_features, device=weights.dist.device, dtype=torch.int32) // group

    def _zeros(self, weights: CheckpointTensors, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        packed = weights.get_range(name, dim, start, stop)
        return unpack_int32(packed, self.bits, dim=1) + self.zero_offset

    def read_column_part(
        self, weights: CheckpointTensors, prefix: str, part: OutputPart
    ) -> GroupQuantized:
        out_features = weights.shape(f"{prefix}.qweight")[1]
        start, stop = output_range(prefix, out_features, part, self.pack)
        zeros = self._zeros(weights, f"{prefix}.qzeros", 1, start // self.pack, stop // self.pack)
        return GroupQuantized(
            qweight=weights.get_range(f"{prefix}.qweight", 1, start, stop),
            zeros=zeros,
            scales=weights.get_range(f"{prefix}.scales", 1, start, stop, cast=False),
            g_idx=self.g_idx(weights, prefix),
            bits=self.bits,
            dtype=weights.dtype,
        )

    def read_row(self, weights: CheckpointTensors, prefix: str) -> GroupQuantized:
        dist = weights.dist
        g_idx = self.g_idx(weights, prefix)
        start, stop = input_range(prefix, g_idx, dist.rank, dist.world_size, self.pack)
        rows = g_idx[start:stop]
        if is_sorted(g_idx):
            # This rank's own groups: their rows of scales and zeros, g_idx counted from them.
            first, last = int(rows[0]), int(rows[-1]) + 1
        else:
            first, last = 0, weights.shape(f"{prefix}.scales")[0]
        return GroupQuantized(
            qweight=weights.get_range(
                f"{prefix}.qweight", 0, start // self.pack, stop // self.pack
            ),
            zeros=self._zeros(weights, f"{prefix}.qzeros", 0, first, last),
            scales=weights.get_range(f"{prefix}.scales", 0, first, last, cast=False),
            g_idx=rows - first,
            bits=self.bits,
            dtype=weights.dtype,
        )
