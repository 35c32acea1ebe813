"""A QuantizedWeight for tests of the quantization plumbing: symmetric int8 per output row in
plain PyTorch. It stands in for the kernels' classes where a test is about how weights are read,
held and routed (loaders, layers, on-load quantization, start-up), never about a kernel.
"""

from __future__ import annotations

from typing import Self

import torch

from pytgi_shard.quantization.linear_weight import QuantizedWeight


class RowInt8(QuantizedWeight):
    """W ~= q * scale[:, None], q int8, one float32 scale per output row."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.dtype = dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Self:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale, weight.dtype)

    def dequantize(self) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantize().to(x.dtype))


class DequantFp8(QuantizedWeight):
    """An FP8 checkpoint's weight as Fp8CheckpointLoader hands it over, multiplied by
    dequantizing (W = weight * scale per row or per tensor) in float32."""

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("fp8", weight)
        self.register_buffer("scale", scale)
        self.input_scale = input_scale

    def dequantize(self) -> torch.Tensor:
        scale = self.scale if self.scale.dim() == 0 else self.scale[:, None]
        return self.fp8.float() * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantize().to(x.dtype))
