"""Paged decode attention in Triton: one new token per request, split-K ("flash-decoding").

Grid (batch, kv_heads, num_splits). A program loads the query rows of every query head that
shares its KV head (grouped-query attention: each K/V tile is read once for the whole group) and
walks its share of the request's context through the block table. The context is cut into
`num_splits` ranges of whole BLOCK_N tiles computed from seqlens_k on the device, so neither the
grid nor any shape depends on a step's lengths: the launch is capturable in a CUDA graph. With
several splits each program writes a normalised partial output and its base-2 log-sum-exp, and a
second kernel merges the splits; with one split the first kernel writes the output directly.
An FP8 cache's tiles are decoded and scaled in float32 as they are loaded (triton_fp8.load_kv).
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

# More splits than this only add reduction work: 16 x BLOCK_N keys already cover 1024 tokens.
MAX_SPLITS = 16


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode kernel: keys per tile, warps, software-pipelining depth."""

    block_n: int
    num_warps: int
    num_stages: int


def decode_config(device: torch.device) -> DecodeConfig:
    """H100-tuned tiles on CUDA; small tiles elsewhere (the interpreter), so tests see many."""
    if device.type == "cuda":
        return DecodeConfig(block_n=64, num_warps=4, num_stages=2)
    return DecodeConfig(block_n=16, num_warps=4, num_stages=1)


def decode_splits(batch: int, kv_heads: int, num_sms: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits per (request, KV head) so that about two programs run per SM.

    Depends only on the batch size and the head count (never on context lengths), so a CUDA graph
    captured for a batch-size bucket stays valid for every step; a split whose range is empty
    exits at once, so short contexts cost little.
    """
    programs = max(batch * kv_heads, 1)
    wanted = -(-2 * num_sms // programs)
    return max(1, min(max_splits, triton.next_power_of_2(wanted) if wanted > 1 else 1))


@triton.jit
def _decode_split_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seqlens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_tb, stride_tn,
    stride_ot, stride_oh, stride_od,
    scale, softcap, window, head_dim, alibi_ptr,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seqlen = tl.load(seqlens_ptr + req)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seqlen - window, 0)
    # This split's tiles: an equal share of the tiles that hold [start, seqlen).
    first_tile = start // BLOCK_N
    num_tiles = tl.cdiv(seqlen, BLOCK_N) - first_tile
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, first_tile + num_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + req * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + req * stride_tb
    head_offset = kv_head * stride_ch
    # ALiBi: each query head's slope, in the scores' base 2 (zeros without ALiBi, never added).
    slopes = tl.zeros([BLOCK_G], dtype=tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
        slopes = slopes * 1.4426950408889634
    k_scale = 1.0
    v_scale = 1.0
    if FP8 != 0:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (pos < seqlen) & (pos >= start)
        block = tl.load(table + (pos // BLOCK_SIZE) * stride_tn, mask=valid, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_co + head_offset
        k_t = load_kv(
            key_cache_ptr + rows[None, :] + d[:, None] * stride_cd,
            valid[None, :] & d_mask[:, None], k_scale, FP8,
        )
        v = load_kv(
            value_cache_ptr + rows[:, None] + d[None, :] * stride_cd,
            valid[:, None] & d_mask[None, :], v_scale, FP8,
        )
        qk = tl.dot(q, k_t.to(q.dtype), input_precision=PRECISION)
        scores = scaled_scores(qk, scale, softcap, HAS_SOFTCAP)
        if HAS_ALIBI:
            # slope * (key position - the query's position, seqlen - 1).
            scores = scores + slopes[:, None] * (pos - (seqlen - 1)).to(tl.float32)[None, :]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, scores, v.to(q.dtype), PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + req * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # Partials: [batch, Hq, NUM_SPLITS, head_dim] and [batch, Hq, NUM_SPLITS], contiguous.
        num_heads = tl.num_programs(1) * GROUP
        row = (req * num_heads + heads) * NUM_SPLITS + split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)
        tl.store(
            part_out_ptr + row[:, None] * head_dim + d[None, :], out,
            mask=g_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ot, stride_oh, stride_od, head_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < head_dim
    row = (req * tl.num_programs(1) + head) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    total = tl.sum(weight, 0)
    parts = tl.load(
        part_out_ptr + row[:, None] * head_dim + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + req * stride_ot + head * stride_oh + d * stride_od
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Per-forward state every layer reuses: the split count and the partial-result buffers."""

    num_splits: int
    # [batch, Hq, num_splits, D] and [batch, Hq, num_splits] fp32; None with one split.
    part_out: torch.Tensor | None
    part_lse: torch.Tensor | None


def plan_decode(
    batch: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
) -> DecodePlan:
    """Allocates the split buffers once per forward (in a CUDA graph: once per capture)."""
    if num_splits == 1:
        return DecodePlan(1, None, None)
    part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32,
                           device=device)
    return DecodePlan(num_splits, part_out, part_lse)


def paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqlens_k: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    config: DecodeConfig | None = None,
    alibi_slopes: torch.Tensor | None = None,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """Attention of one query per request (q [batch, Hq, D]) over its paged context; [batch, Hq, D].

    seqlens_k[i] counts request i's context including the new token, whose K/V must already be in
    the cache. No host synchronisation and no value-dependent shapes: capturable.
    alibi_slopes: [Hq] float32, or None. kv_scales: an FP8 cache's (required then).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    config = config or decode_config(q.device)
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    splits = plan.num_splits
    k_scale, v_scale = scale_args(key_cache, kv_scales, out)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, kernel_view(key_cache), kernel_view(value_cache), block_tables, seqlens_k,
        # With one split the partial buffers are never touched; `out` stands in for them.
        out, out if plan.part_out is None else plan.part_out,
        out if plan.part_lse is None else plan.part_lse, k_scale, v_scale,
        *q.stride(), *key_cache.stride(), *block_tables.stride(), *out.stride(),
        scale, softcap or 0.0, sliding_window or 0, head_dim,
        out if alibi_slopes is None else alibi_slopes,
        BLOCK_SIZE=key_cache.shape[1], GROUP=group, NUM_SPLITS=splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=config.block_n, BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        HAS_ALIBI=alibi_slopes is not None,
        PRECISION=dot_precision(q.dtype == torch.float32), FP8=fp8_code(key_cache),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if plan.part_out is not None and plan.part_lse is not None:
        _decode_reduce_kernel[(batch, num_heads)](
            plan.part_out, plan.part_lse, out, *out.stride(), head_dim,
            NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
            num_warps=4,
        )
    return out
