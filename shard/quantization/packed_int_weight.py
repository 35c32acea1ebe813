"""A group-quantized weight kept packed, dequantized whole at every matmul: the kernel that fits
every bit width, group layout and device, and the storage the Triton kernel reads in place.

It keeps the memory saving (4 or 8 bits a weight plus a scale and zero per group) but pays a full
dequantization per call, so the kernel choice (int_kernel_choice) takes it only where nothing
faster fits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pytgi_shard.quantization.group_quantized import GroupQuantized
from pytgi_shard.quantization.int_packing import unpack_int32
from pytgi_shard.quantization.linear_weight import QuantizedWeight


class PackedIntWeight(QuantizedWeight):
    """GPTQ's storage: qweight int32 [in / pack, out] packed along the inputs, scales and zeros
    [groups, out] (scales as stored, zeros as exact small integers in their dtype), g_idx int32
    [in]; `dtype` is the model's, which the weight is dequantized to."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    dtype: torch.dtype

    def __init__(self, weight: GroupQuantized) -> None:
        super().__init__()
        self.bits = weight.bits
        self.dtype = weight.dtype
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.register_buffer("qweight", weight.qweight.contiguous())
        self.register_buffer("scales", weight.scales.contiguous())
        # Zero points reach 2**bits (GPTQ v1's stored 15 + 1); every float dtype holds such
        # integers exactly, so (q - zero) stays exact in float32.
        self.register_buffer("zeros", weight.zeros.to(weight.scales.dtype).contiguous())
        self.register_buffer("g_idx", weight.g_idx.to(torch.int32).contiguous())

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        q = unpack_int32(self.qweight, self.bits, dim=0)
        shifted = q.float() - self.zeros[g].float()
        return (shifted * self.scales[g].float()).to(self.dtype).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize().to(x.dtype))
