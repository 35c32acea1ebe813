"""A weight quantized per group of input features, as read from a GPTQ or AWQ checkpoint and
before a kernel takes it: one form for both formats, so each kernel has one converter.

    W[o, i] = scales[g_idx[i], o] * (q[i, o] - zeros[g_idx[i], o])

with q the unsigned `bits`-bit integers, packed along the input features in GPTQ's order
(int_packing), zeros the true zero points (GPTQ v1's stored-minus-one already undone, AWQ's
column order already natural) and g_idx the group of each input feature (arange // group_size
without act-order; any assignment with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pytgi_shard.quantization.int_packing import unpack_int32, values_per_word


@dataclass(frozen=True)
class GroupQuantized:
    qweight: torch.Tensor  # int32 [in / pack, out]
    zeros: torch.Tensor  # int32 [groups, out]
    scales: torch.Tensor  # float [groups, out], as stored (float16 mostly)
    g_idx: torch.Tensor  # int32 [in]
    bits: int
    dtype: torch.dtype  # the model's: what the dequantized weight is rounded to

    def __post_init__(self) -> None:
        pack = values_per_word(self.bits)
        k_words, n = self.qweight.shape
        if self.zeros.shape != self.scales.shape or self.scales.shape[1] != n:
            raise ValueError(
                f"scales {list(self.scales.shape)} and zeros {list(self.zeros.shape)} do not "
                f"match a weight of {n} outputs"
            )
        if self.g_idx.shape != (k_words * pack,):
            raise ValueError(f"g_idx has {self.g_idx.numel()} entries for {k_words * pack} inputs")
        if self.g_idx.numel() and (
            int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= self.scales.shape[0]
        ):
            raise ValueError(f"g_idx names groups outside the {self.scales.shape[0]} stored")

    @property
    def in_features(self) -> int:
        return self.g_idx.numel()

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def int_weight(self) -> torch.Tensor:
        """q as int32 [in, out]."""
        return unpack_int32(self.qweight, self.bits, dim=0)

    def dequantize(self) -> torch.Tensor:
        """W as [out, in] in the model dtype: each element computed in float32 (exact: a
        float16 scale times a small integer) and rounded once, as a float copy of the
        checkpoint dequantized to that dtype holds it."""
        g = self.g_idx.long()
        shifted = (self.int_weight() - self.zeros[g]).float()
        return (shifted * self.scales[g].float()).to(self.dtype).t().contiguous()


def concat_outputs(parts: Sequence[GroupQuantized], names: Sequence[str]) -> GroupQuantized:
    """Projections of the same inputs fused along their outputs (q|k|v, gate|up). They must
    share the input grouping: a kernel reads one g_idx for all columns."""
    first = parts[0]
    for part, name in zip(parts[1:], names[1:], strict=True):
        if (part.bits, part.scales.dtype) != (first.bits, first.scales.dtype):
            raise ValueError(f"{name} is stored unlike {names[0]} (bits, scales): not fusable")
        if not torch.equal(part.g_idx, first.g_idx):
            raise ValueError(
                f"{name} groups its input features (g_idx) unlike {names[0]}: projections of "
                "one input fused into one matmul must share it"
            )
    if len(parts) == 1:
        return first
    return GroupQuantized(
        qweight=torch.cat([p.qweight for p in parts], dim=1),
        zeros=torch.cat([p.zeros for p in parts], dim=1),
        scales=torch.cat([p.scales for p in parts], dim=1),
        g_idx=first.g_idx,
        bits=first.bits,
        dtype=first.dtype,
    )
