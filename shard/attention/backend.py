"""The attention interface every model layer calls, and the registry of implementations."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pytgi_shard.attention.kv_quant import KVScales
from pytgi_shard.attention.metadata import AttentionMetadata

BACKENDS = ("reference", "triton")


class AttentionBackend(ABC):
    """Paged attention over the flat batch: cache writes and causal attention in one call."""

    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        *,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        """Writes k/v to the caches at meta.slot_mapping, then attends; returns [T, Hq, D].

        q [T, Hq, D], k/v [T, Hkv, D] with Hq a multiple of Hkv (grouped-query attention: query
        head h reads KV head h // (Hq // Hkv)); caches [num_blocks, block_size, Hkv, D].
        Request i's new tokens sit at positions seqlens_k[i] - q_len .. seqlens_k[i] - 1 of its
        context and attend causally to every earlier position (within `sliding_window` tokens,
        the query's own included, when given); a token in a bidirectional span
        (`meta.spans`, PaliGemma's prefix, Gemma 3's images) also attends to the whole span. `softcap` (Gemma 2) bounds each scaled score s as
        softcap * tanh(s / softcap) before the softmax.
        `alibi_slopes` (BLOOM, MPT) [Hq] float32 adds slope_h * (key position - query position)
        to head h's scaled scores; None leaves the scores as they are, at no cost.
        An FP8 cache (its dtype float8_e4m3fn or float8_e5m2) is written as k / kv_scales.key
        (v / kv_scales.value), saturated, and read back times the scale in float32; its layer's
        `kv_scales` are required then (KVCache.scales_of), and unused otherwise.
        """


def get_backend(name: str) -> AttentionBackend:
    """The backend called `name` ("reference": plain PyTorch, CPU and GPU; "triton": GPU kernels,
    or CPU under TRITON_INTERPRET=1)."""
    if name == "reference":
        from pytgi_shard.attention.reference import ReferenceAttention

        return ReferenceAttention()
    if name == "triton":
        from pytgi_shard.attention.triton_backend import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(BACKENDS)})")
