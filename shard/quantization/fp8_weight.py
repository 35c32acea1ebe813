"""float8_e4m3fn weights with a float32 scale per tensor or per output row: TGI's
`--quantize fp8` (from_float: dynamic per-row scales) and FP8 checkpoints (fp8_checkpoint.py
builds Fp8Weight(qweight, scale, input_scale) from the stored tensors).

W = qweight * scale (each row by its scale). Two kernels:

- On CUDA with compute capability >= 8.9 (Ada, Hopper), `torch._scaled_mm`: the activations are
  quantized to float8_e4m3fn with one dynamic scale per token (or the checkpoint's static
  per-tensor input_scale when it has one), and the FP8 tensor cores multiply. _scaled_mm is
  called with unit tensor-wise scales and the product is scaled per token and per output row
  afterwards, in float32: y[m, n] = acc[m, n] * s_x[m] * s_w[n]. That one form serves per-tensor
  and per-row weight scales and every output dtype on both 8.9 and 9.0, where row-wise scaled
  _scaled_mm has narrower support (bfloat16 output only, architecture-dependent); the epilogue is
  one elementwise pass over [tokens, out], small against the GEMM. _scaled_mm needs in/out
  features that are multiples of 16; other shapes take the fallback.
- Elsewhere (CPU, older GPUs): the weight dequantized to the activations' dtype and F.linear:
  the weight stays 1 byte per value in memory, the arithmetic is the activations' dtype. On the
  CPU this is slow: PyTorch converts float8 to float element by element (0.03x float32's
  F.linear on one layer of the bench Llama; the model decodes at 0.08x), and its CPU _scaled_mm
  is slower still (a 3072x512 projection: 4.4 ms against 0.1 ms). FP8 is a GPU format; on the
  CPU it saves memory only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pytgi_shard.device.capabilities import cuda_capability_of, scaled_mm_runs
from pytgi_shard.quantization.linear_weight import QuantizedWeight

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# torch._scaled_mm: both dimensions of the weight in multiples of 16.
SCALED_MM_MULTIPLE = 16


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether `device` has FP8 tensor cores torch._scaled_mm runs on (DeviceCapabilities)."""
    return scaled_mm_runs(device.type, cuda_capability_of(device))


def quantize_fp8_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn q, float32 scale [rows]) with values ~= q * scale[:, None]: each row's
    largest magnitude maps to 448. An all-zero row gets scale 1."""
    absmax = values.abs().amax(dim=1).float()
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (values.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale


def _scale_shape(scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """The scale as float32 [] (per tensor) or [out] (per row), from [], [1], [out] or [out, 1]."""
    if scale.numel() == 1:
        return scale.float().reshape(())
    if scale.numel() == out_features and scale.shape in ((out_features,), (out_features, 1)):
        return scale.float().reshape(out_features)
    raise ValueError(
        f"an FP8 weight scale is per tensor ([] or [1]) or per output row ([{out_features}] or "
        f"[{out_features}, 1]), got {list(scale.shape)}"
    )


class Fp8Weight(QuantizedWeight):
    """qweight float8_e4m3fn [out, in], scale float32 [] or [out], input_scale float32 [] (a
    checkpoint's static activation scale) or None (dynamic per token). dequantize() is in
    `dtype`: the model's dtype for --quantize fp8, float32 by default (exact for any scale)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        input_scale: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if qweight.dtype != FP8_DTYPE or qweight.dim() != 2:
            raise ValueError(
                f"qweight must be a 2-D {FP8_DTYPE}, got {qweight.dtype} {qweight.dim()}-D"
            )
        self.out_features, self.in_features = qweight.shape
        self.dtype = dtype
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", _scale_shape(scale, self.out_features))
        static = None if input_scale is None else input_scale.float().reshape(())
        self.register_buffer("input_scale", static)
        self.use_scaled_mm = scaled_mm_supported(qweight.device) and (
            self.in_features % SCALED_MM_MULTIPLE == 0
            and self.out_features % SCALED_MM_MULTIPLE == 0
        )

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Fp8Weight:
        q, scale = quantize_fp8_rows(weight)
        return cls(q, scale, None, weight.dtype)

    def dequantize(self) -> torch.Tensor:
        return self._float_weight().to(self.dtype)

    def _float_weight(self) -> torch.Tensor:
        """q * scale in float32: one rounding when cast to the activations' dtype (a product in
        float16 could lose a tiny scale to subnormals)."""
        scale = self.scale[:, None] if self.scale.dim() == 1 else self.scale
        return self.qweight.float() * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.use_scaled_mm:
            out = self._scaled_mm(rows)
        else:
            out = F.linear(rows, self._float_weight().to(x.dtype))
        return out.reshape(*x.shape[:-1], self.out_features)

    def _quantize_input(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 activations and their float32 scale [tokens, 1]: static when the checkpoint has
        one (values beyond its range saturate, as the checkpoint was calibrated), else one
        dynamic scale per token."""
        if self.input_scale is None:
            xq, x_scale = quantize_fp8_rows(rows)
            return xq, x_scale[:, None]
        xq = (rows.float() / self.input_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return xq, self.input_scale.expand(rows.shape[0], 1)

    def _scaled_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """FP8 GEMM with unit tensor-wise scales, then s_x per token and s_w per row in float32."""
        xq, x_scale = self._quantize_input(rows)
        one = torch.ones((), device=rows.device, dtype=torch.float32)
        # b column-major: the [in, out] transpose of the row-major [out, in] weight.
        result = torch._scaled_mm(
            xq.contiguous(), self.qweight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
        )
        acc = result[0] if isinstance(result, tuple) else result
        return (acc * x_scale * self.scale).to(rows.dtype)
