"""Variable-length causal attention in Triton over the paged cache (prefill and mixed batches).

Flash-attention style: a program takes BLOCK_M new tokens of one request and one query head, and
folds tiles of BLOCK_N keys into an online softmax. Keys and values are read from the paged cache
through the block table (one gathered row per key), not from the new k/v tensors, so new tokens
see their request's previously cached blocks: prefix caching and chunked prefill come for free.
Request i's new tokens sit at context positions seqlens_k[i] - q_len .. seqlens_k[i] - 1.

Rows in a bidirectional span (AttentionMetadata.spans) also see the span's later keys: the
block's key range is widened to its rows' spans and the masked tiles open them.

Tiles wholly below the causal diagonal skip the mask; only the tiles the diagonal (or the sliding
window) crosses pay for it. The grid (query blocks, query heads, requests) uses the host value
max_seqlen_q, so this path is not for CUDA graphs; decode has its own kernel. An FP8 cache's
tiles are decoded and scaled in float32 as they are loaded (triton_fp8.load_kv).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pytgi_shard.attention.kv_quant import KVScales
from pytgi_shard.attention.triton_fp8 import fp8_code, kernel_view, load_kv, scale_args
from pytgi_shard.attention.triton_online_softmax import (
    dot_precision,
    online_softmax_step,
    scaled_scores,
)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the prefill kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_config(device: torch.device) -> PrefillConfig:
    """Tiles measured on an H100 (bench/experiments/attention_kernels.py --sweep) on CUDA; small elsewhere.

    For head_dim 128, 64x64 tiles with 4 warps and 2 stages led or tied on every prompt shape
    measured (512-2048 tokens, 1-8 requests, with and without a cached prefix): 250-285 TFLOP/s
    on long prompts. (head_dim 256 fits too: 64x256 Q plus two stages of K and V tiles is 160 KiB
    of shared memory.)
    """
    if device.type != "cuda":
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, q_pos, n_lo, n_hi, key_cache_ptr, value_cache_ptr, table, head_offset,
    stride_cb, stride_co, stride_tn, stride_cd, d, d_mask, scale, softcap, window, slope,
    k_scale, v_scale, span_lo, span_hi,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr, HAS_SPANS: tl.constexpr,
):
    """Keys n_lo..n_hi (n_lo a multiple of BLOCK_N); MASKED applies causality, n_hi and window,
    and (HAS_SPANS) opens each row's bidirectional span [span_lo, span_hi) beside them."""
    for start_n in range(n_lo, n_hi, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = pos < n_hi
            block = tl.load(table + (pos // BLOCK_SIZE) * stride_tn, mask=valid, other=0)
        else:
            block = tl.load(table + (pos // BLOCK_SIZE) * stride_tn)
        rows = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_co + head_offset
        # K is loaded as [N, D] rows and transposed in registers: measured 10-20% faster on an
        # H100 than loading the [D, N] view directly.
        kv_mask = valid[:, None] & d_mask[None, :] if MASKED else d_mask[None, :]
        k = load_kv(key_cache_ptr + rows[:, None] + d[None, :] * stride_cd, kv_mask, k_scale, FP8)
        v = load_kv(value_cache_ptr + rows[:, None] + d[None, :] * stride_cd, kv_mask, v_scale,
                    FP8)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        scores = scaled_scores(qk, scale, softcap, HAS_SOFTCAP)
        if HAS_ALIBI:
            # slope * (key position - query position), in the scores' base 2.
            rel = (pos[None, :] - q_pos[:, None]).to(tl.float32)
            scores = scores + rel * (slope * 1.4426950408889634)
        if MASKED:
            allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (q_pos[:, None] - pos[None, :] < window)
            if HAS_SPANS:
                in_span = (pos[None, :] >= span_lo[:, None]) & (pos[None, :] < span_hi[:, None])
                allowed = allowed | (valid[None, :] & in_span)
            scores = tl.where(allowed, scores, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, scores, v.to(q.dtype), PRECISION)
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seqlens_ptr, cu_seqlens_q_ptr,
    out_ptr, k_scale_ptr, v_scale_ptr, spans_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_tb, stride_tn,
    stride_ot, stride_oh, stride_od,
    scale, softcap, window, head_dim, alibi_ptr,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr, HAS_SPANS: tl.constexpr,
):
    # The last query blocks of a request see the most keys: launch them first.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    req = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seqlen = tl.load(seqlens_ptr + req)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    first_q = seqlen - q_len + m_block * BLOCK_M
    q_pos = seqlen - q_len + rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )

    # Keys this block needs: [lo, hi); the ones below `full_hi` are visible to every row.
    hi = tl.minimum(first_q + BLOCK_M, seqlen)
    full_hi = ((first_q + 1) // BLOCK_N) * BLOCK_N
    lo = 0
    if HAS_WINDOW:
        lo = (tl.maximum(first_q - window + 1, 0) // BLOCK_N) * BLOCK_N
    span_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
    span_hi = tl.zeros([BLOCK_M], dtype=tl.int32)
    if HAS_SPANS:
        # Rows in a bidirectional span also see its later keys (up to its end) and, under a
        # window, its earlier ones: widen the block's key range to cover every row's span.
        span_rows = spans_ptr + (q_start + rows) * 2
        span_lo = tl.load(span_rows, mask=row_mask, other=0)
        span_hi = tl.load(span_rows + 1, mask=row_mask, other=0)
        hi = tl.maximum(hi, tl.minimum(tl.max(span_hi, axis=0), seqlen))
        if HAS_WINDOW:
            first_span = tl.min(tl.where(span_hi > span_lo, span_lo, seqlen), axis=0)
            lo = tl.minimum(lo, (first_span // BLOCK_N) * BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + req * stride_tb
    head_offset = (head // GROUP) * stride_ch
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + head).to(tl.float32)
    k_scale = 1.0
    v_scale = 1.0
    if FP8 != 0:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    if not HAS_WINDOW:
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, lo, full_hi, key_cache_ptr, value_cache_ptr, table,
            head_offset, stride_cb, stride_co, stride_tn, stride_cd, d, d_mask, scale, softcap,
            window, slope, k_scale, v_scale, span_lo, span_hi, BLOCK_SIZE=BLOCK_SIZE,
            MASKED=False, HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
            BLOCK_N=BLOCK_N, PRECISION=PRECISION, FP8=FP8, HAS_SPANS=HAS_SPANS,
        )
        lo = full_hi
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, lo, hi, key_cache_ptr, value_cache_ptr, table,
        head_offset, stride_cb, stride_co, stride_tn, stride_cd, d, d_mask, scale, softcap,
        window, slope, k_scale, v_scale, span_lo, span_hi, BLOCK_SIZE=BLOCK_SIZE, MASKED=True,
        HAS_WINDOW=HAS_WINDOW, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, BLOCK_N=BLOCK_N,
        PRECISION=PRECISION, FP8=FP8, HAS_SPANS=HAS_SPANS,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    config: PrefillConfig | None = None,
    alibi_slopes: torch.Tensor | None = None,
    kv_scales: KVScales | None = None,
    spans: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the flat new tokens q [T, Hq, D] over their paged contexts; [T, Hq, D].

    The new tokens' K/V must already be in the cache. alibi_slopes: [Hq] float32, or None.
    kv_scales: an FP8 cache's (required then). spans: [T, 2] int32 bidirectional spans
    (AttentionMetadata.spans), or None.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    batch = seqlens_k.shape[0]
    config = config or prefill_config(q.device)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    grid = (triton.cdiv(max_seqlen_q, config.block_m), num_heads, batch)
    k_scale, v_scale = scale_args(key_cache, kv_scales, out)
    _prefill_kernel[grid](
        q, kernel_view(key_cache), kernel_view(value_cache), block_tables, seqlens_k,
        cu_seqlens_q, out, k_scale, v_scale,
        # Without spans the pointer is never read; `out` stands in for it.
        out if spans is None else spans.to(torch.int32).contiguous(),
        *q.stride(), *key_cache.stride(), *block_tables.stride(), *out.stride(),
        scale, softcap or 0.0, sliding_window or 0, head_dim,
        # Without ALiBi the pointer is never read; `out` stands in for it.
        out if alibi_slopes is None else alibi_slopes,
        BLOCK_SIZE=key_cache.shape[1], GROUP=num_heads // num_kv_heads,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        HAS_ALIBI=alibi_slopes is not None,
        PRECISION=dot_precision(q.dtype == torch.float32), FP8=fp8_code(key_cache),
        HAS_SPANS=spans is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
