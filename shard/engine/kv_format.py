"""What the KV cache stores: the model's dtype, or FP8 with per-layer scales (--kv-cache-dtype).

Resolved once per shard, before any cache is allocated: the storage dtype every KVCache of this
rank takes, and for FP8 the scales its attention layers divide by on write and multiply by on
read (shard/attention/kv_quant.py), read from the checkpoint (shard/weights/kv_scales.py) and the
same on every rank. The scales are tensors that outlive every cache: a decode CUDA graph captured
over one cache reads them where they stay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.kv_quant import KVScales, dtype_name, is_fp8, kv_cache_dtype
from pytgi_shard.models.model import Model
from pytgi_shard.settings import ShardSettings
from pytgi_shard.weights.kv_scales import read_kv_scales

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVFormat:
    """What every KV cache of this rank stores, resolved once (resolve_kv_format)."""

    dtype: torch.dtype
    # One per layer for an FP8 cache; None when the cache holds the model's dtype.
    scales: list[KVScales] | None = None

    @property
    def name(self) -> str:
        """The dtype as the flag and the logs spell it (fp8_e4m3fn, bfloat16, ...)."""
        return dtype_name(self.dtype)


def fp8_refusal(settings: ShardSettings, model: Model) -> str | None:
    """Why this model cannot keep the FP8 cache asked for; None when it can (or none is)."""
    if settings.kv_cache_dtype is None or model.fp8_kv_refusal is None:
        return None
    return f"--kv-cache-dtype {settings.kv_cache_dtype} is not supported: {model.fp8_kv_refusal}"


def resolve_kv_format(settings: ShardSettings, model: Model) -> KVFormat:
    """The cache's dtype from --kv-cache-dtype (the model's when unset), and an FP8 cache's
    scales from the checkpoint (1.0 for layers it gives none)."""
    dtype = kv_cache_dtype(settings.kv_cache_dtype, model.dtype)
    if not is_fp8(dtype):
        return KVFormat(dtype)
    refusal = fp8_refusal(settings, model)
    if refusal is not None:
        raise ValueError(refusal)
    layers = read_kv_scales(settings.model_path, model.num_layers)
    given = sum(layer.from_checkpoint for layer in layers)
    log.info(
        "KV cache in %s: scales from the checkpoint for %d of %d layers%s", dtype_name(dtype),
        given, len(layers), "" if given == len(layers) else " (1.0 for the others)",
    )
    return KVFormat(dtype, [KVScales.of(s.key, s.value, model.device) for s in layers])


def capacity_line(kv: KVFormat, model: Model, num_blocks: int, block_size: int) -> str:
    """Warmup's word on what the cache holds: tokens, dtype and bytes per token, beside those of
    a cache in the model's dtype when they differ (FP8 holds 2x bfloat16's tokens per byte)."""
    m = model
    per_token = KVCache.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, kv.dtype)
    line = (
        f"KV cache dtype {kv.name}: {(num_blocks - 1) * block_size} tokens of context in "
        f"{num_blocks} blocks, {per_token} bytes per token"
    )
    if kv.dtype == m.dtype:
        return line
    plain = KVCache.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, m.dtype)
    return f"{line} ({dtype_name(m.dtype)}: {plain}, {plain / per_token:.0f}x the bytes)"
