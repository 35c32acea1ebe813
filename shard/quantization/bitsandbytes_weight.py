"""TGI's bitsandbytes modes, through the bitsandbytes library's own quantizers and matmuls (its
CPU and CUDA backends): `bitsandbytes` (LLM.int8), `bitsandbytes-nf4` and `bitsandbytes-fp4`.

- LLM.int8 (BnbInt8Weight): the weight int8 per output row (bnb's int8_vectorwise_quant, from
  float16 as bnb's Int8Params does); at each call the activations are quantized per token
  except the columns holding a value >= 6.0 in magnitude (TGI's threshold), which are multiplied
  in the activations' dtype by the dequantized weight columns: bnb's int8_vectorwise_quant with
  the threshold, then int8_mixed_scaled_mm. On CUDA bnb's kernels take float16 only, so the
  activations go through float16 there (as bnb's MatMul8bitLt does); on CPU they stay in their
  dtype (bnb's CPU ops accept any float).
- 4-bit (BnbNf4Weight, BnbFp4Weight): bnb's quantize_4bit in blocks of 64 (its default) with one
  absmax per block, no double quantization (TGI's default), multiplied by the kernels
  matmul_4bit dispatches to (gemm_4bit; gemv_4bit for bnb's CPU layout: see Bnb4bitWeight),
  called as torch ops with the weight's own buffers rather than through a per-call QuantState.

bitsandbytes is imported only when one of these classes quantizes a weight: it takes seconds to
import and is not needed by anything else.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType
from typing import ClassVar

import torch

from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.linear_weight import QuantizedWeight

# TGI's Linear8bitLt threshold: activation columns with a value this large stay in float.
LLM_INT8_THRESHOLD = 6.0
# bitsandbytes' default 4-bit block (TGI keeps it).
BLOCKSIZE_4BIT = 64
# Logs, at import, a failed attempt to load an optional CPU kernel from the Hugging Face Hub (the
# `kernels` package, which pytgi does not install: it downloads at run time), then falls back to
# its bundled kernels. pytgi never loads kernels from the Hub, so that warning is noise.
_HUB_KERNEL_LOGGER = "bitsandbytes.backends.cpu.ops"


def import_bitsandbytes() -> ModuleType:
    """bitsandbytes (which registers its torch.ops.bitsandbytes kernels), imported on first use
    with the warning above kept out of the shard's log."""
    loaded = sys.modules.get("bitsandbytes")
    if loaded is not None:
        return loaded
    hub_log = logging.getLogger(_HUB_KERNEL_LOGGER)
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        return importlib.import_module("bitsandbytes")
    except ModuleNotFoundError as error:
        raise QuantizationError(
            "--quantize bitsandbytes, bitsandbytes-nf4 and bitsandbytes-fp4 need the bitsandbytes "
            "package: pip install 'pytgi[quantization]'"
        ) from error
    finally:
        hub_log.setLevel(level)


class BnbInt8Weight(QuantizedWeight):
    """LLM.int8: CB int8 [out, in] and SCB float32 [out] (the row's absmax: W ~= CB * SCB / 127),
    with the outlier threshold applied to the activations at each call."""

    cb: torch.Tensor
    scb: torch.Tensor
    # The outlier columns of each call's activations are found on the host (TGI decodes every
    # bitsandbytes mode without CUDA graphs; pytgi only this one, whose kernel needs it).
    graph_capturable = False

    def __init__(
        self, cb: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype,
        threshold: float = LLM_INT8_THRESHOLD,
    ) -> None:  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = cb.shape
        self.dtype = dtype
        self.threshold = threshold
        self.register_buffer("cb", cb.contiguous())
        self.register_buffer("scb", scb.float())

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> BnbInt8Weight:
        bnb = import_bitsandbytes()
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(weight.to(torch.float16))
        return cls(cb, scb, weight.dtype)

    def dequantize(self) -> torch.Tensor:
        return (self.cb.float() * (self.scb[:, None] / 127.0)).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bnb = import_bitsandbytes()
        rows = x.reshape(-1, self.in_features)
        # Quantizing with a threshold zeroes the outliers of its input in place (and restores
        # them on CPU): it gets a private copy.
        a = rows.to(torch.float16) if rows.device.type == "cuda" else rows.clone()
        ca, sca, outlier_cols = bnb.functional.int8_vectorwise_quant(a, self.threshold)
        out, _ = torch.ops.bitsandbytes.int8_mixed_scaled_mm(
            a, ca, self.cb, sca, self.scb, outlier_cols, None
        )
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Bnb4bitWeight(QuantizedWeight):
    """bnb's 4-bit weight: codes two a byte, one absmax per block of 64 and the 16-value code of
    `quant_type`, in one of bnb's two layouts:

    - bnb's standard one ([(out * in + 1) // 2, 1] uint8, float32 absmax), multiplied by bnb's
      gemm_4bit (CUDA: its fused kernel or dequantize+GEMM by its own size heuristic; CPU: its C
      dequantize then F.linear), in the activations' dtype.
    - on CPUs with AVX512-BF16, bnb's CPU inference layout ([out, in / 2] uint8 tiled by 32
      outputs, bfloat16 absmax [in / 64, out]) for its fused gemv_4bit kernel, the layout bnb's
      own Linear4bit switches to for inference on such CPUs. That kernel computes in bfloat16
      whatever the activations' dtype (their result is cast back). On one layer of the bench
      Llama in float32 (one thread) it is 5x faster than the standard layout at 1 token (1.68x
      float32's F.linear against 0.31x) and slower at 64 (0.55x against 0.68x); the model
      decodes 1.9x float32 at batch 1 and 0.78x at batch 64 with it (README "Quantization").
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor

    quant_type: ClassVar[str]

    def __init__(
        self, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
        shape: tuple[int, int], dtype: torch.dtype, cpu_packed: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = shape
        self.dtype = dtype
        self.cpu_packed = cpu_packed
        self.register_buffer("packed", packed)
        self.register_buffer("absmax", absmax)
        self.register_buffer("code", code)

    @classmethod
    def from_float(cls, weight: torch.Tensor, cpu_packed: bool | None = None) -> Bnb4bitWeight:
        """`cpu_packed` None: bnb's CPU layout where it fits (see the class docstring)."""
        bnb = import_bitsandbytes()
        packed, state = bnb.functional.quantize_4bit(
            weight.contiguous(), blocksize=BLOCKSIZE_4BIT, quant_type=cls.quant_type
        )
        if cpu_packed is None:
            cpu_packed = cpu_layout_fits(weight, bnb.functional.has_avx512bf16())
        if cpu_packed:
            packed, state = bnb.functional._convert_weight_packed_for_cpu(packed, state)
        out_features, in_features = weight.shape
        shape = (out_features, in_features)
        return cls(packed, state.absmax, state.code, shape, weight.dtype, cpu_packed)

    def dequantize(self) -> torch.Tensor:
        if self.cpu_packed:
            codes = unpack_cpu_layout(self.packed, self.out_features, self.in_features)
            blocks = self.absmax.float().t().repeat_interleave(BLOCKSIZE_4BIT, dim=1)
            return (self.code[codes.long()] * blocks).to(self.dtype)
        import_bitsandbytes()
        return torch.ops.bitsandbytes.dequantize_4bit.default(
            self.packed, self.absmax, BLOCKSIZE_4BIT, self.quant_type, self._shape(), self.dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import_bitsandbytes()
        rows = x.reshape(-1, self.in_features)
        if self.cpu_packed:
            if rows.device.type != "cpu":
                raise RuntimeError("a weight in bnb's CPU layout was moved off the CPU: "
                                   "quantize it on the device it runs on")  # fmt: skip
            out = torch.ops.bitsandbytes.gemv_4bit.default(
                rows, self.packed, self._shape(), self.absmax, self.code, BLOCKSIZE_4BIT
            )
        else:
            out = torch.ops.bitsandbytes.gemm_4bit.default(
                rows, self.packed.view(-1, 1), self._shape(), self.absmax, BLOCKSIZE_4BIT,
                self.quant_type,
            )  # fmt: skip
        return out.reshape(*x.shape[:-1], self.out_features)

    def _shape(self) -> list[int]:
        return [self.out_features, self.in_features]


# bnb's CPU inference layout: outputs in tiles of 32, pairs of inputs interleaved within a tile.
CPU_LAYOUT_TILE = 32


def cpu_layout_fits(weight: torch.Tensor, has_avx512bf16: bool) -> bool:
    """Whether bnb's CPU inference layout takes `weight` (its tiling and one absmax row per
    block of inputs) on a CPU whose gemv_4bit kernel can use it."""
    out_features, in_features = weight.shape
    return (
        weight.device.type == "cpu"
        and has_avx512bf16
        and out_features % CPU_LAYOUT_TILE == 0
        and in_features % BLOCKSIZE_4BIT == 0
    )


def unpack_cpu_layout(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [out, in] 4-bit codes of bnb's CPU layout (the inverse of bitsandbytes'
    _convert_weight_packed_for_cpu: each byte holds the codes of two outputs 16 apart in a tile
    of 32, low nibble first, for one pair of consecutive inputs)."""
    tiles = packed.reshape(-1, CPU_LAYOUT_TILE)
    codes = torch.cat([tiles & 0xF, tiles >> 4], dim=-1)  # [..., 64]: (output, input pair)
    codes = codes.reshape(out_features // CPU_LAYOUT_TILE, in_features // 2, CPU_LAYOUT_TILE, 2)
    return codes.transpose(1, 2).reshape(out_features, in_features)


class BnbNf4Weight(Bnb4bitWeight):
    """`bitsandbytes-nf4`: the 4-bit NormalFloat code (quantiles of a normal distribution)."""

    quant_type = "nf4"


class BnbFp4Weight(Bnb4bitWeight):
    """`bitsandbytes-fp4`: bnb's 4-bit float code (1 sign, 2 exponent, 1 mantissa bits)."""

    quant_type = "fp4"
