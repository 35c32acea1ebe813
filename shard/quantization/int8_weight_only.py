"""TGI's `--quantize eetq`: int8 weights, one symmetric scale per output channel.

W ~= q * scale[:, None] with q = round(W / scale) in [-127, 127] and scale = max |W[row]| / 127,
so each weight is rounded once to 1/254 of its row's range. Three kernels multiply by it; the
one taken is chosen per device by measurement (bench/experiments/on_load_kernels.py, README "Quantization"):

- INT_MM: the activations quantized per token on the fly (symmetric int8, one scale per row of
  x), then PyTorch's int8 GEMM `torch._int_mm` (int32 accumulation, exact) and both scales applied
  to the int32 result. Reads 1 byte per weight and uses AVX512-VNNI / the GPU's int8 tensor
  cores. Chosen on CPUs with AVX-512 and on CUDA. On this project's CPU (float32, one layer of
  the ~20M bench Llama, one thread) it was the only int8 kernel faster than float32's F.linear:
  1.17x at 1 token, 2.8x at 64 (the whole model decodes 1.5x / 1.6x faster than float32). It is
  W8A8 rather than EETQ's W8A16: each activation is also rounded to 1/254 of its token's range;
  the served perplexity on held-out text moves by +0.02% (tests/e2e/test_quantization_quality.py).
- INT8PACK: `torch.ops.aten._weight_int8pack_mm` (weight-only, activations in their dtype):
  0.24x float32 at 1 token and 0.03x at 64 on that CPU in float32; kept selectable, timed by
  the bench on every device.
- DEQUANT: the weight dequantized to the activations' dtype each call, then F.linear (0.21x /
  0.60x there): exact weight-only arithmetic anywhere, the fallback where `_int_mm` has no fast
  path (CPUs without AVX-512, where PyTorch's int8 GEMM is a scalar loop).

On CUDA `_int_mm` needs more than 16 rows and in/out features that are multiples of 8: fewer
rows are padded with zero rows (decoding reads the weight once either way); other shapes take
DEQUANT. The CUDA choice is not measured yet (no GPU was lent when it was written): bench/gpu.sh's
quantization stage times all three there.
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F

from pytgi_shard.device.capabilities import int_mm_fast
from pytgi_shard.quantization.linear_weight import QuantizedWeight

INT8_MAX = 127
# _int_mm on CUDA: cuBLASLt's int8 GEMM wants more than 16 rows and dimensions in multiples of 8.
CUDA_INT_MM_MIN_ROWS = 17
CUDA_INT_MM_MULTIPLE = 8


class Int8Kernel(str, Enum):
    INT_MM = "int_mm"
    INT8PACK = "int8pack"
    DEQUANT = "dequant"


def default_int8_kernel(device: torch.device) -> Int8Kernel:
    """The kernel measured fastest on `device` (this module's docstring says why; the table is
    DeviceCapabilities.int8_int_mm)."""
    fast = int_mm_fast(device.type, torch.backends.cpu.get_cpu_capability())
    return Int8Kernel.INT_MM if fast else Int8Kernel.DEQUANT


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 q, float32 scale [rows]) with values ~= q * scale[:, None], symmetric per row of a
    2-D tensor. An all-zero row gets scale 1 (its q is 0), never a division by zero."""
    absmax = values.abs().amax(dim=1).float()
    scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    q = torch.round(values.float() / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def quantize_tokens(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows for activations at every call, in fewer ops (a zero row's tiny scale gives
    q = 0): (int8 q, float32 scale [rows, 1])."""
    scale = rows.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-30).div_(INT8_MAX)
    return torch.round(rows / scale).to(torch.int8), scale


class Int8WeightOnly(QuantizedWeight):
    """qweight int8 [out, in] and scale float32 [out]; `kernel` as this module describes."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        dtype: torch.dtype,
        kernel: Int8Kernel | None = None,
    ) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(
                f"qweight must be a 2-D int8 tensor, got {qweight.dtype} {qweight.dim()}-D"
            )
        if scale.shape != (qweight.shape[0],):
            raise ValueError(f"scale must be [{qweight.shape[0]}], got {list(scale.shape)}")
        self.out_features, self.in_features = qweight.shape
        self.dtype = dtype
        self.kernel = default_int8_kernel(qweight.device) if kernel is None else kernel
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.float())

    @classmethod
    def from_float(cls, weight: torch.Tensor, kernel: Int8Kernel | None = None) -> Int8WeightOnly:
        q, scale = quantize_rows(weight)
        return cls(q, scale, weight.dtype, kernel)

    def dequantize(self) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel is Int8Kernel.INT_MM and self._int_mm_fits():
            out = self._int_mm(rows)
        elif self.kernel is Int8Kernel.INT8PACK:
            out = torch.ops.aten._weight_int8pack_mm(
                rows.contiguous(), self.qweight, self.scale.to(x.dtype)
            )
        else:
            out = F.linear(rows, self.dequantize().to(x.dtype))
        return out.reshape(*x.shape[:-1], self.out_features)

    def _int_mm_fits(self) -> bool:
        if self.qweight.device.type != "cuda":
            return True
        return self.in_features % CUDA_INT_MM_MULTIPLE == 0 and (
            self.out_features % CUDA_INT_MM_MULTIPLE == 0
        )

    def _int_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-token int8 activations, int32 GEMM, both scales applied in float32."""
        xq, x_scale = quantize_tokens(rows)
        count = xq.shape[0]
        if xq.device.type == "cuda" and count < CUDA_INT_MM_MIN_ROWS:
            xq = F.pad(xq, (0, 0, 0, CUDA_INT_MM_MIN_ROWS - count))
        acc = torch._int_mm(xq, self.qweight.t())[:count]
        return acc.float().mul_(x_scale).mul_(self.scale).to(rows.dtype)
