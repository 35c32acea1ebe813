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
  float32 absmax per block, no double quantization (TGI's default), and matmul_4bit in the
  activations' dtype: on CUDA bnb's fused kernel or its dequantize+GEMM by bnb's own size
  heuristic, on CPU its C dequantize then F.linear.

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
    """bnb's packed 4-bit weight (two values a byte, [(out * in + 1) // 2, 1] uint8), its float32
    absmax per block of 64 and the 16-value code of `quant_type`."""

    packed: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor

    quant_type: ClassVar[str]

    def __init__(
        self, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
        shape: tuple[int, int], dtype: torch.dtype,
    ) -> None:  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = shape
        self.dtype = dtype
        self.register_buffer("packed", packed)
        self.register_buffer("absmax", absmax)
        self.register_buffer("code", code)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Bnb4bitWeight:
        bnb = import_bitsandbytes()
        packed, state = bnb.functional.quantize_4bit(
            weight.contiguous(), blocksize=BLOCKSIZE_4BIT, quant_type=cls.quant_type
        )
        out_features, in_features = weight.shape
        return cls(packed, state.absmax, state.code, (out_features, in_features), weight.dtype)

    def quant_state(self, dtype: torch.dtype) -> object:
        """bnb's QuantState over this weight's buffers (built per call: cheap, and always the
        buffers' current device)."""
        bnb = import_bitsandbytes()
        return bnb.functional.QuantState(
            absmax=self.absmax,
            shape=torch.Size((self.out_features, self.in_features)),
            code=self.code,
            blocksize=BLOCKSIZE_4BIT,
            quant_type=self.quant_type,
            dtype=dtype,
        )

    def dequantize(self) -> torch.Tensor:
        bnb = import_bitsandbytes()
        return bnb.functional.dequantize_4bit(self.packed, self.quant_state(self.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bnb = import_bitsandbytes()
        rows = x.reshape(-1, self.in_features)
        out = bnb.matmul_4bit(rows, self.packed, self.quant_state(x.dtype))
        return out.reshape(*x.shape[:-1], self.out_features)


class BnbNf4Weight(Bnb4bitWeight):
    """`bitsandbytes-nf4`: the 4-bit NormalFloat code (quantiles of a normal distribution)."""

    quant_type = "nf4"


class BnbFp4Weight(Bnb4bitWeight):
    """`bitsandbytes-fp4`: bnb's 4-bit float code (1 sign, 2 exponent, 1 mantissa bits)."""

    quant_type = "fp4"
