"""The FP8 KV cache's number format: which dtypes, their per-layer scales, and the plain-PyTorch
quantize/dequantize that the reference backend runs and the Triton kernels are tested against.

A quantized cache stores K/V as `round_to_nearest_even(clamp(x / scale, -max, max))` in FP8
(`--kv-cache-dtype fp8_e4m3fn|fp8_e5m2`, TGI's flag) and reads them back as `stored * scale` in
float32. The clamp saturates instead of letting a large value become inf (e5m2) or NaN (e4m3fn,
which has no inf). One scale per tensor per layer (k_scale, v_scale), the same on every rank:
checkpoints calibrated for an FP8 cache carry them (shard/weights/kv_scales.py); without them
they are 1.0, as in TGI and vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# --kv-cache-dtype's values (TGI's) and the storage dtype of each.
FP8_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype: the flag's FP8 format, or the model's own dtype when unset."""
    if name is None:
        return model_dtype
    if name not in FP8_KV_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype must be one of {', '.join(FP8_KV_DTYPES)}, got {name!r}"
        )
    return FP8_KV_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` holds quantized values that need their scales to be read."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def dtype_name(dtype: torch.dtype) -> str:
    """The name a log line and the flag use: fp8_e4m3fn, fp8_e5m2, or torch's (bfloat16, ...)."""
    for name, fp8 in FP8_KV_DTYPES.items():
        if fp8 == dtype:
            return name
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KVScales:
    """One layer's dequantization scales, as [1] float32 tensors on the cache's device: tensors,
    not floats, so that a captured CUDA graph reads them where they stay."""

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def of(cls, key: float, value: float, device: torch.device) -> KVScales:
        """Scales from two numbers; a non-finite or non-positive one is refused (it would turn
        every cached value into 0, inf or NaN)."""
        for what, s in (("k_scale", key), ("v_scale", value)):
            if not (s > 0 and s < float("inf")):
                raise ValueError(f"KV cache {what} must be a positive finite number, got {s}")
        return cls(
            torch.tensor([key], dtype=torch.float32, device=device),
            torch.tensor([value], dtype=torch.float32, device=device),
        )


def required_scales(cache: torch.Tensor, scales: KVScales | None) -> KVScales | None:
    """The scales an FP8 `cache` is read and written with; None for an unquantized one. An FP8
    cache without scales is a caller's bug, refused rather than silently read at scale 1."""
    if not is_fp8(cache.dtype):
        return None
    if scales is None:
        raise ValueError(f"a {cache.dtype} KV cache is read and written with its kv_scales")
    return scales


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 format: where quantization saturates."""
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale, saturated to the format's range and rounded to nearest-even, as the raw bytes
    (uint8) of `dtype`: CPU index_copy_ has no FP8 kernel, so caches are written as bytes."""
    limit = fp8_max(dtype)
    return (x.float() / scale).clamp_(-limit, limit).to(dtype).view(torch.uint8)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 values (any view of the cache) times their scale, in float32, then in `dtype`."""
    return stored.float().mul_(scale).to(dtype)
