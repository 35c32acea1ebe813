"""The Triton attention backend: cache write, then the decode or the varlen prefill kernel.

`--attention triton`. A forward whose every request has exactly one new token
(meta.max_seqlen_q == 1) takes the split-K decode kernel, which is capturable in a CUDA graph;
anything else (prefills, chunked prefills over cached prefixes, mixed batches whose is_prefill
may be False while some request has several tokens) takes the varlen kernel. The decode plan
(split count and partial buffers) is built once per forward in meta.plans and shared by every
layer.
"""

from __future__ import annotations

import torch

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.attention.kv_quant import KVScales
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.attention.plans import DecodeShape
from pytgi_shard.attention.triton_cache import write_kv_cache
from pytgi_shard.attention.triton_decode import (
    DecodePlan,
    decode_splits,
    paged_decode,
    plan_decode,
)
from pytgi_shard.attention.triton_prefill import paged_prefill

# SMs assumed where the device cannot tell (the interpreter on CPU).
_FALLBACK_SMS = 4


class TritonAttention(AttentionBackend):
    """Paged attention in Triton kernels; `num_splits` pins the decode split count (tests)."""

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self.num_splits = num_splits
        self._sms: dict[torch.device, int] = {}

    def _num_sms(self, device: torch.device) -> int:
        if device not in self._sms:
            self._sms[device] = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda" else _FALLBACK_SMS
            )
        return self._sms[device]

    def _decode_plan(
        self, meta: AttentionMetadata, q: torch.Tensor, num_kv_heads: int
    ) -> DecodePlan:
        batch, num_heads, head_dim = q.shape
        shape = DecodeShape(num_heads, num_kv_heads, head_dim)
        plan = meta.plans.triton_decode.get(shape)
        if plan is None:
            splits = self.num_splits or decode_splits(
                batch, num_kv_heads, self._num_sms(q.device)
            )
            plan = plan_decode(batch, num_heads, head_dim, splits, q.device)
            meta.plans.triton_decode[shape] = plan
        return plan

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
        """See AttentionBackend.forward; `softcap` caps scores as softcap * tanh(s / softcap),
        `alibi_slopes` [Hq] adds slope * (key position - query position), `kv_scales` are an
        FP8 cache's."""
        write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, kv_scales)
        if meta.max_seqlen_q == 1:
            if q.shape[0] != meta.batch_size:
                raise ValueError(
                    f"a decode forward has one token per request: {q.shape[0]} tokens, "
                    f"{meta.batch_size} requests"
                )
            plan = self._decode_plan(meta, q, k.shape[1])
            return paged_decode(
                q, key_cache, value_cache, meta.block_tables, meta.seqlens_k, plan, scale,
                sliding_window, softcap, alibi_slopes=alibi_slopes, kv_scales=kv_scales,
            )
        return paged_prefill(
            q, key_cache, value_cache, meta.block_tables, meta.seqlens_k, meta.cu_seqlens_q,
            meta.max_seqlen_q, scale, sliding_window, softcap, alibi_slopes=alibi_slopes,
            kv_scales=kv_scales, spans=meta.spans,
        )
