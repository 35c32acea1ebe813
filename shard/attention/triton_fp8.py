"""FP8 KV-cache values inside the Triton kernels: the cache is uint8 storage, and the kernels
encode and decode its bytes with integer arithmetic instead of Triton's fp8 types.

Why bytes and not `tl.float8e4nv` casts:
- Triton's interpreter (the CPU path the kernels are tested on) rounds float32 -> fp8 wrongly:
  a mantissa that rounds up does not carry into the exponent (127.8 -> 64, not 128, in Triton
  3.9) and ties round away from zero; the encoder below rounds to nearest-even exactly as
  torch's `.to(torch.float8_*)` does, on the interpreter and on a GPU alike (tested bit for bit).
- Decoding needs no fp8 instruction: an e5m2 byte is the top half of the float16 with the same
  value, and an e4m3fn byte placed in a float16's bits 7..14 is the float16 of its value / 256
  (subnormals included), so a shift and one multiply decode it on any GPU (Triton refuses
  fp8e4nv before sm_89) and under the interpreter, in Triton 3.6 and 3.9 alike.

Format codes, a kernel's FP8 constexpr: 0 = not quantized (the cache holds the model's dtype),
1 = fp8_e4m3fn, 2 = fp8_e5m2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pytgi_shard.attention.kv_quant import KVScales, is_fp8, required_scales

NOT_QUANTIZED = 0
E4M3FN = 1
E5M2 = 2


def fp8_code(cache: torch.Tensor) -> int:
    """The FP8 constexpr of a cache tensor, from its dtype."""
    if cache.dtype == torch.float8_e4m3fn:
        return E4M3FN
    if cache.dtype == torch.float8_e5m2:
        return E5M2
    return NOT_QUANTIZED


def kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """What a kernel is handed: an FP8 cache as its bytes (no fp8 pointer type reaches Triton)."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def scale_args(
    cache: torch.Tensor, scales: KVScales | None, stand_in: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value scale pointers; `stand_in` (never read) for an unquantized cache."""
    needed = required_scales(cache, scales)
    return (stand_in, stand_in) if needed is None else (needed.key, needed.value)


@triton.jit
def _round_shift(v, s):
    """v >> s (v >= 0, 1 <= s <= 31) rounded to nearest, ties to even."""
    half_less = (1 << (s - 1)) - 1
    return (v + half_less + ((v >> s) & 1)) >> s


@triton.jit
def fp8_encode(x, FP8: tl.constexpr):
    """float32 -> the byte of its FP8 value: saturated to the format's largest finite value,
    rounded to nearest-even from the float32 bits (normal and subnormal results)."""
    # Mantissa bits, exponent bias and largest finite value: e4m3fn's (FP8 1) or e5m2's (2).
    MANT: tl.constexpr = 4 - FP8
    BIAS: tl.constexpr = 8 * FP8 - 1
    LIMIT: tl.constexpr = 448.0 if FP8 == 1 else 57344.0
    SHIFT: tl.constexpr = 23 - MANT
    x = tl.minimum(tl.maximum(x, -LIMIT), LIMIT)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exponent = mag >> 23
    # A normal result: drop SHIFT bits of the magnitude (a carry moves into the exponent), then
    # rebias the exponent from float32's 127 to the format's.
    normal = _round_shift(mag, SHIFT) - ((127 - BIAS) << MANT)
    # A subnormal one: the mantissa with its implicit bit, shifted to units of the smallest
    # subnormal (2 ** (1 - BIAS - MANT)); one that rounds up to 2 ** MANT is the smallest normal.
    mantissa = (mag & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)
    shift = tl.minimum(tl.maximum(SHIFT + (1 - BIAS) - (exponent - 127), 1), 31)
    subnormal = _round_shift(mantissa, shift)
    code = tl.where(exponent - 127 >= 1 - BIAS, normal, subnormal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _fp8_as_half(raw, FP8: tl.constexpr):
    """FP8 bytes (uint8) as the float16 of their value: exactly it for e5m2, value / 256 for
    e4m3fn (see the module docstring)."""
    r = raw.to(tl.uint16)
    if FP8 == 1:
        return (((r & 0x80) << 8) | ((r & 0x7F) << 7)).to(tl.float16, bitcast=True)
    else:
        return (r << 8).to(tl.float16, bitcast=True)


@triton.jit
def fp8_decode(raw, FP8: tl.constexpr):
    """The float32 value of FP8 bytes (uint8), exactly."""
    return _fp8_as_half(raw, FP8).to(tl.float32) * (256.0 if FP8 == 1 else 1.0)


@triton.jit
def load_kv(ptrs, mask, scale, FP8: tl.constexpr):
    """A tile of the cache as values the attention can use: as stored when not quantized, else
    decoded and multiplied by the layer's scale in float32 (one multiply: e4m3fn's 256 joins the
    scale, exactly, being a power of two)."""
    if FP8 == 0:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        factor = scale * 256.0 if FP8 == 1 else scale
        return _fp8_as_half(tl.load(ptrs, mask=mask, other=0), FP8).to(tl.float32) * factor
