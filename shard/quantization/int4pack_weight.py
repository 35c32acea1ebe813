"""4-bit group-quantized weights through PyTorch's own int4 packed matmul (tinygemm's layout):
`_weight_int4pack_mm_for_cpu` on CPU, `_weight_int4pack_mm` on CUDA.

Those kernels dequantize as (q - 8) * scale + offset with one (scale, offset) pair per group of
consecutive input features, so a GPTQ/AWQ zero point z becomes offset = scale * (8 - z): then
(q - 8) * s + s * (8 - z) = s * (q - z). For float16 checkpoint scales every term is exact in
float32, so computing in float32 the kernel multiplies by exactly the dequantized weight.

It computes in bfloat16 (COMPUTE_DTYPE) on both devices, activations cast to it and the output
cast back: CUDA takes nothing else, and on CPU its float32 path is a slow fallback while the
bfloat16 one is vectorised (one thread, 4096 x 4096, groups of 128: batch 1 0.82 ms against
27.5 ms in float32 and 2.4 ms for the float32 F.linear it replaces; batch 64 25 ms against
1.7 s and 18 ms; bench/experiments/quant_kernels.py). The cost is bfloat16 rounding of the activations and of
each offset (within 1/64 of a quantization step): what every bf16 GPU deployment accepts.

Act-order weights and uneven groups are read as int4pack_layout orders and pads the inputs,
once at load; each call gathers the activations in that order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pytgi_shard.quantization.group_quantized import GroupQuantized
from pytgi_shard.quantization.int4pack_layout import Int4PackLayout
from pytgi_shard.quantization.linear_weight import QuantizedWeight

# What the op computes in (module docstring): activations and (scale, offset) pairs.
COMPUTE_DTYPE = torch.bfloat16
# The tiling factor of the packed layout along the inputs, largest first (8 is what tinygemm
# users pick; the in_features must be a multiple of 16 times it on CUDA).
INNER_K_TILES = (8, 4, 2)


def int4pack_fits(
    device: torch.device, dtype: torch.dtype, out_features: int, layout: Int4PackLayout, bits: int
) -> bool:
    """Whether the op serves this weight: 4 bits; on CPU out_features a multiple of 16; on CUDA
    a bfloat16 model (a float16 one is served by the Triton kernel, without a cast),
    out_features a multiple of 8 and no padding (Triton reads uneven groups in place)."""
    if bits != 4:
        return False
    if device.type == "cpu":
        return out_features % 16 == 0
    if device.type == "cuda":
        return dtype == torch.bfloat16 and out_features % 8 == 0 and not layout.padded
    return False


def _inner_k_tiles(in_features: int) -> int:
    return next((t for t in INNER_K_TILES if in_features % (16 * t) == 0), INNER_K_TILES[-1])


class Int4PackWeight(QuantizedWeight):
    """The weight in the op's packed layout (inputs as `layout` orders and pads them), with its
    [runs, out, 2] scales and offsets in `compute_dtype` (COMPUTE_DTYPE when serving; float32
    on CPU computes the exact weight)."""

    scales_and_zeros: torch.Tensor
    packed: torch.Tensor
    perm: torch.Tensor | None

    def __init__(
        self, weight: GroupQuantized, layout: Int4PackLayout,
        compute_dtype: torch.dtype = COMPUTE_DTYPE,
    ) -> None:  # fmt: skip
        super().__init__()
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.group_size = layout.group_size
        self.padded = layout.padded
        q = weight.int_weight()  # [in, out]
        if layout.perm is not None:
            # A pad row (index in_features) of 8s: any value, its activation is 0.
            q = F.pad(q, (0, 0, 0, 1), value=8)[layout.perm]
        scales = weight.scales[layout.groups].float()
        offsets = scales * (8 - weight.zeros[layout.groups].float())
        self.register_buffer(
            "scales_and_zeros", torch.stack([scales, offsets], -1).to(compute_dtype)
        )
        self.register_buffer("packed", _pack(q.t().contiguous()))
        perm = None if layout.perm is None else layout.perm.to(torch.int32)
        self.register_buffer("perm", perm)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if x2d.is_cuda:
            return torch.ops.aten._weight_int4pack_mm(
                x2d, self.packed, self.group_size, self.scales_and_zeros
            )
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2d, self.packed, self.group_size, self.scales_and_zeros
        )

    def _arrange(self, x: torch.Tensor) -> torch.Tensor:
        """x's inputs in the packed order, a zero where a pad sits."""
        if self.perm is None:
            return x
        if self.padded:
            x = F.pad(x, (0, 1))
        return x.index_select(-1, self.perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = self._arrange(x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype))
        return self._matmul(x2d.contiguous()).to(x.dtype).reshape(*x.shape[:-1], -1)

    def dequantize(self) -> torch.Tensor:
        """Read back through the kernel itself (identity activations), so it is exactly what the
        kernel multiplies by; costs an [in, in] matmul, meant for checks, not serving."""
        eye = torch.eye(
            self.in_features, dtype=self.scales_and_zeros.dtype, device=self.packed.device
        )
        return self._matmul(self._arrange(eye).contiguous()).t().contiguous()


def _pack(q: torch.Tensor) -> torch.Tensor:
    """[out, in] values 0..15 -> the op's layout: the CPU op packs int32 itself; the CUDA op takes
    two values a byte (even input in the high nibble, tinygemm's order)."""
    tiles = _inner_k_tiles(q.shape[1])
    if q.is_cuda:
        as_bytes = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(as_bytes, tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), tiles)
