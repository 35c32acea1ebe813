"""Paged attention in plain PyTorch: the oracle for fast kernels and the production CPU path.

Each request's context is gathered from its blocks into a padded [batch, context, Hkv, D] view,
and one batched SDPA call attends over it under a mask that encodes causality, lengths and the
sliding window. Grouped-query heads are folded into the query-length axis ([B, Hkv, q * G, D]), so
keys and values are never repeated per query head.

A mixed forward (decode rows beside a chunk of prompt, chunked prefill) attends in two groups:
padded together, every one-token decode row would pay for the chunk's queries and the longest
context (measured on CPU: 8 decode rows beside a 256-token chunk over 3,000 cached tokens made a
step 5-15x slower than the chunk alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.attention.compiled_decode import attend_decode
from pytgi_shard.attention.kv_quant import KVScales, dequantize, quantize, required_scales
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.attention.plans import MaskKind


@dataclass(frozen=True, slots=True)
class ReferenceGroup:
    """Requests attended in one padded SDPA call: the flat indices of their new tokens in the
    forward, and their own metadata (whose plans cache the group's layout and masks)."""

    tokens: torch.Tensor
    meta: AttentionMetadata


def split_mixed(meta: AttentionMetadata) -> list[ReferenceGroup]:
    """The decode rows (one new token) and the other requests of a mixed forward as two groups;
    [] when the forward is not mixed. One host read of the query lengths per forward."""
    if meta.max_seqlen_q == 1:
        return []
    cu = meta.cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    single = q_lens == 1
    if not bool(single.any()) or bool(single.all()):
        return []
    groups = []
    for rows in (single.nonzero().flatten(), (~single).nonzero().flatten()):
        lens = q_lens[rows]
        total = int(lens.sum())
        starts = torch.cumsum(lens, 0) - lens
        offsets = torch.arange(total, device=cu.device) - torch.repeat_interleave(
            starts, lens, output_size=total
        )
        tokens = torch.repeat_interleave(cu[rows], lens, output_size=total) + offsets
        seqlens_k = meta.seqlens_k[rows]
        sub = AttentionMetadata(
            is_prefill=bool(lens.max() > 1),
            cu_seqlens_q=F.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32),
            seqlens_k=seqlens_k,
            slot_mapping=meta.slot_mapping[tokens],
            block_tables=meta.block_tables[rows],
            max_seqlen_q=int(lens.max()),
            max_seqlen_k=int(seqlens_k.max()),
            block_size=meta.block_size,
            spans=None if meta.spans is None else meta.spans[tokens],
        )
        groups.append(ReferenceGroup(tokens, sub))
    return groups


@dataclass(frozen=True, slots=True)
class ReferenceLayout:
    """Where each flat token sits in the padded batch, and which blocks to gather."""

    # [T] int64: the request of each flat token and its index among that request's new tokens.
    token_request: torch.Tensor
    token_offset: torch.Tensor
    # [B, blocks] int64: the blocks covering the longest context.
    blocks: torch.Tensor
    # [B, max_q] int64: the context position of each (padded) query.
    query_pos: torch.Tensor
    # [B, max_q, 2] int64: each query's bidirectional span (AttentionMetadata.spans; (0, 0)
    # for padded rows and tokens in none), or None when the forward has none.
    query_span: torch.Tensor | None = None


def _layout(meta: AttentionMetadata, num_tokens: int) -> ReferenceLayout:
    cu = meta.cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    batch = q_lens.shape[0]
    device = cu.device
    token_request = torch.repeat_interleave(
        torch.arange(batch, device=device), q_lens, output_size=num_tokens
    )
    token_offset = torch.arange(num_tokens, device=device) - cu[token_request]
    num_blocks = -(-meta.max_seqlen_k // meta.block_size)
    blocks = meta.block_tables[:, :num_blocks].long()
    first = (meta.seqlens_k.long() - q_lens).unsqueeze(1)
    query_pos = first + torch.arange(meta.max_seqlen_q, device=device).unsqueeze(0)
    query_span = None
    if meta.spans is not None:
        query_span = torch.zeros(batch, meta.max_seqlen_q, 2, dtype=torch.long, device=device)
        query_span[token_request, token_offset] = meta.spans.long()
    return ReferenceLayout(token_request, token_offset, blocks, query_pos, query_span)


def _mask(meta: AttentionMetadata, layout: ReferenceLayout, sliding_window: int | None) -> torch.Tensor:
    """[B, max_q, context] bool: query (b, i) may attend to context position j."""
    context = layout.blocks.shape[1] * meta.block_size
    j = torch.arange(context, device=layout.blocks.device).view(1, 1, -1)
    qpos = layout.query_pos.unsqueeze(-1)
    # Padded query rows (beyond a request's new tokens) still see real keys, so no row is empty.
    mask = (j <= qpos) & (j < meta.seqlens_k.long().view(-1, 1, 1))
    if sliding_window is not None:
        mask &= qpos - j < sliding_window
    if layout.query_span is not None:
        # (causal and windowed) or within the query's bidirectional span: transformers'
        # or_mask of the block ids over the (sliding) causal mask.
        lo, hi = layout.query_span[..., :1], layout.query_span[..., 1:]
        mask |= (j >= lo) & (j < hi)
    return mask


def _gather(
    cache: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """[B, Hkv, context, D]: each request's blocks, in order, as one padded context in `dtype`
    (an FP8 cache's blocks dequantized: gathered first, so only the context is converted)."""
    batch, num_blocks = blocks.shape
    # index_select copies whole blocks; advanced indexing is markedly slower on CPU.
    gathered = cache.index_select(0, blocks.reshape(-1))
    if scale is not None:
        gathered = dequantize(gathered, scale, dtype)
    return gathered.view(batch, num_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _write(
    cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None
) -> None:
    """x [T, Hkv, D] into the cache's slots; quantized (as bytes: CPU index_copy_ has no FP8
    kernel) when the cache is FP8."""
    rows = cache.view(-1, *x.shape[1:])
    if scale is None:
        rows.index_copy_(0, slots, x)
    else:
        rows.view(torch.uint8).index_copy_(0, slots, quantize(x, scale, cache.dtype))


def _softcapped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """SDPA with Gemma 2's bounded scores, softcap * tanh(q.k * scale / softcap): SDPA has no
    hook between the product and the softmax, so the scores are materialised (the ops and their
    order are transformers' eager attention's; the softmax in float32 as there)."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, values)


def _alibi_bias(
    mask: torch.Tensor, layout: ReferenceLayout, slopes: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """ALiBi as an additive mask [B, Hkv, max_q * group, context]: slope_h * (j - query position)
    where `mask` (the grouped boolean mask) allows key j, -inf elsewhere. Relative to the query,
    the bias differs from BLOOM's slope * j by a constant per row, which the softmax ignores."""
    batch, _, rows, context = mask.shape
    max_q = layout.query_pos.shape[1]
    group = rows // max_q
    j = torch.arange(context, device=mask.device).view(1, 1, -1)
    rel = (j - layout.query_pos.unsqueeze(-1)).float()  # [B, max_q, context]
    per_head = slopes.float().view(1, -1, 1, group, 1)  # [1, Hkv, 1, group, 1]
    bias = (rel.view(batch, 1, max_q, 1, context) * per_head).reshape(batch, -1, rows, context)
    return bias.masked_fill(~mask, float("-inf")).to(dtype)


class ReferenceAttention(AttentionBackend):
    name = "reference"

    def _plan(self, meta: AttentionMetadata, num_tokens: int) -> ReferenceLayout:
        layout = meta.plans.reference_layout
        if layout is None:
            layout = meta.plans.reference_layout = _layout(meta, num_tokens)
        return layout

    def _plan_mask(
        self, meta: AttentionMetadata, layout: ReferenceLayout, sliding_window: int | None, group: int
    ) -> torch.Tensor:
        """The mask in the grouped layout [B, 1, max_q * group, context], once per forward."""
        kind = MaskKind(sliding_window, group)
        mask = meta.plans.reference_masks.get(kind)
        if mask is None:
            base = _mask(meta, layout, sliding_window)
            b, q, c = base.shape
            mask = base.view(b, 1, q, 1, c).expand(b, 1, q, group, c).reshape(b, 1, q * group, c)
            meta.plans.reference_masks[kind] = mask
        return mask

    def _plan_alibi(
        self,
        meta: AttentionMetadata,
        layout: ReferenceLayout,
        sliding_window: int | None,
        mask: torch.Tensor,
        slopes: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """ALiBi's additive mask for these slopes, once per forward (every layer shares them)."""
        group = mask.shape[2] // layout.query_pos.shape[1]
        kind = MaskKind(sliding_window, group, tuple(float(s) for s in slopes.tolist()))
        bias = meta.plans.reference_masks.get(kind)
        if bias is None:
            bias = meta.plans.reference_masks[kind] = _alibi_bias(mask, layout, slopes, dtype)
        return bias

    def _groups(self, meta: AttentionMetadata) -> list[ReferenceGroup]:
        groups = meta.plans.reference_groups
        if groups is None:
            groups = meta.plans.reference_groups = split_mixed(meta)
        return groups

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
        if softcap is not None and alibi_slopes is not None:
            raise ValueError("soft-capping and ALiBi together are not supported")
        scales = required_scales(key_cache, kv_scales)
        k_scale, v_scale = (None, None) if scales is None else (scales.key, scales.value)
        _write(key_cache, meta.slot_mapping, k, k_scale)
        _write(value_cache, meta.slot_mapping, v, v_scale)
        groups = self._groups(meta)
        if not groups:
            return self._attend(
                q, key_cache, value_cache, meta, scale, sliding_window, softcap, alibi_slopes,
                scales,
            )
        out = torch.empty_like(q)
        for g in groups:
            part = self._attend(
                q.index_select(0, g.tokens), key_cache, value_cache, g.meta, scale,
                sliding_window, softcap, alibi_slopes, scales,
            )
            out.index_copy_(0, g.tokens, part)
        return out

    def _attend(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        """Attention of `q` (the new tokens of `meta`'s requests, their K/V already written;
        `kv_scales` given when the cache is FP8)."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[2]
        group = num_heads // num_kv_heads

        layout = self._plan(meta, num_tokens)
        batch, max_q = layout.query_pos.shape
        mask = self._plan_mask(meta, layout, sliding_window, group)
        bias = None
        if alibi_slopes is not None:
            bias = self._plan_alibi(meta, layout, sliding_window, mask, alibi_slopes, q.dtype)
        if max_q == 1 and meta.compiled:
            # A compiled decode step: the gather fused into the attention's own loops.
            return attend_decode(q, key_cache, value_cache, layout.blocks, mask[:, 0, 0],
                                 scale, softcap, bias, kv_scales)
        k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales.key, kv_scales.value)
        keys = _gather(key_cache, layout.blocks, k_scale, q.dtype)
        values = _gather(value_cache, layout.blocks, v_scale, q.dtype)
        if bias is not None:
            mask = bias

        if max_q == 1:
            # Decode: one token per request, already in request order.
            grouped = q.view(batch, num_kv_heads, group, head_dim)
        else:
            padded = q.new_zeros(batch, max_q, num_heads, head_dim)
            padded[layout.token_request, layout.token_offset] = q
            grouped = (
                padded.view(batch, max_q, num_kv_heads, group, head_dim)
                .transpose(1, 2)
                .reshape(batch, num_kv_heads, max_q * group, head_dim)
            )
        if softcap is None:
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
        else:
            out = _softcapped_attention(grouped, keys, values, mask, scale, softcap)
        if max_q == 1:
            return out.reshape(num_tokens, num_heads, head_dim)
        out = (
            out.view(batch, num_kv_heads, max_q, group, head_dim)
            .transpose(1, 2)
            .reshape(batch, max_q, num_heads, head_dim)
        )
        return out[layout.token_request, layout.token_offset]
