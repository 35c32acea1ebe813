"""Attention of an encoder-decoder (T5) over the paged cache, in plain PyTorch.

Where a request's K/V live: its blocks hold first one slot per prompt token, the cross-attention
K/V of every decoder layer (computed once from the encoder's output at Prefill), then its
decoder's tokens, the decoder's self-attention K/V (decoder position d at table position
encoder_length + d). The router's block accounting is then already right: a request of P prompt
tokens and n generated ones holds P + n (+1) slots, and each slot costs what any decoder's KV
slot costs (every decoder layer's key and value).

Attention reads a request's keys by gathering its slots into a padded [batch, heads, keys, dim]
view, and one batched SDPA call (scale 1: T5 does not scale its scores) attends under an
additive mask that carries the relative position bias. The Triton kernels have no such bias,
so encoder-decoders take this path whatever --attention says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pytgi_shard.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class EncoderInputs:
    """The prompts a Prefill encodes, flat (no padding), and where their cross-attention K/V go."""

    # [tokens] int64: every prompt's tokens, one after the other.
    input_ids: torch.Tensor
    # [batch + 1] int64: prefix sums of the prompts' lengths.
    cu_seqlens: torch.Tensor
    max_length: int
    # [tokens] int64: the cache slot of each prompt token (the first slots of its request).
    cross_slots: torch.Tensor


@dataclass(kw_only=True)
class EncoderDecoderMetadata(AttentionMetadata):
    """A decoder forward of an encoder-decoder. The inherited fields describe the decoder's
    tokens as for any decoder (positions are decoder positions from 0, the decoder start token's;
    seqlens_k counts the decoder's tokens; slot_mapping is where this forward's self-attention
    K/V go); the request's encoder_length slots before them hold its cross-attention K/V."""

    # [batch] int64: each request's prompt length.
    encoder_lengths: torch.Tensor
    max_encoder_length: int
    # The prompts to encode before the decoder runs (a Prefill's newcomers), else None.
    encoder: EncoderInputs | None = None

    @classmethod
    def of(cls, meta: AttentionMetadata) -> EncoderDecoderMetadata:
        """`meta` itself, or a plain metadata read as requests without encoder tokens (Health's
        one-token forward): no cross-attention context, the decoder from table position 0."""
        if isinstance(meta, EncoderDecoderMetadata):
            return meta
        zeros = torch.zeros_like(meta.seqlens_k, dtype=torch.long)
        return cls(
            is_prefill=meta.is_prefill, cu_seqlens_q=meta.cu_seqlens_q, seqlens_k=meta.seqlens_k,
            slot_mapping=meta.slot_mapping, block_tables=meta.block_tables,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
            block_size=meta.block_size, encoder_lengths=zeros, max_encoder_length=0,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class PaddedQueries:
    """Where each flat token sits in a padded [batch, max_q] layout."""

    token_request: torch.Tensor
    token_offset: torch.Tensor
    batch: int
    max_q: int

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, max_q: int, num_tokens: int) -> PaddedQueries:
        cu = cu_seqlens.long()
        lens = cu[1:] - cu[:-1]
        batch = int(lens.shape[0])
        request = torch.repeat_interleave(
            torch.arange(batch, device=cu.device), lens, output_size=num_tokens
        )
        offset = torch.arange(num_tokens, device=cu.device) - cu[request]
        return cls(request, offset, batch, max_q)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, dim] -> [batch, heads, max_q, dim] (zeros in the padding)."""
        padded = x.new_zeros(self.batch, self.max_q, *x.shape[1:])
        padded[self.token_request, self.token_offset] = x
        return padded.transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, heads, max_q, dim] -> [tokens, heads, dim]."""
        return x.transpose(1, 2)[self.token_request, self.token_offset]


@dataclass(frozen=True, slots=True)
class EncoderLayout:
    """An encoder forward's padded layout: every prompt attends to all of its own tokens."""

    queries: PaddedQueries
    # [max_len] int64: the positions 0..max_len-1 (queries' and keys' alike).
    positions: torch.Tensor
    # [batch, 1, 1, max_len] bool: key j is one of the request's prompt tokens.
    keys_allowed: torch.Tensor

    @classmethod
    def of(cls, inputs: EncoderInputs) -> EncoderLayout:
        queries = PaddedQueries.of(inputs.cu_seqlens, inputs.max_length, len(inputs.input_ids))
        positions = torch.arange(inputs.max_length, device=inputs.input_ids.device)
        lens = (inputs.cu_seqlens[1:] - inputs.cu_seqlens[:-1]).long()
        allowed = positions.view(1, -1) < lens.view(-1, 1)
        return cls(queries, positions, allowed.view(queries.batch, 1, 1, -1))


@dataclass(frozen=True, slots=True)
class DecoderLayout:
    """A decoder forward's gathers and masks, derived once and used by every layer."""

    queries: PaddedQueries
    # [batch, max_q] int64: each padded query's decoder position.
    query_pos: torch.Tensor
    # [max_seqlen_k] int64: the decoder positions of the self-attention keys.
    key_pos: torch.Tensor
    # [batch, max_seqlen_k]: the slot of each request's decoder position j (masked beyond it).
    self_slots: torch.Tensor
    # [batch, 1, max_q, max_seqlen_k] bool: causal, within the request's decoder tokens.
    self_allowed: torch.Tensor
    # [tokens]: this forward's tokens' decoder positions (their keys are placed there).
    token_pos: torch.Tensor
    # [batch, max_encoder_length]: the slots of each request's cross-attention K/V.
    cross_slots: torch.Tensor
    # [batch, 1, 1, max_encoder_length] bool: within the request's prompt.
    cross_allowed: torch.Tensor

    @classmethod
    def of(cls, meta: EncoderDecoderMetadata, positions: torch.Tensor) -> DecoderLayout:
        queries = PaddedQueries.of(meta.cu_seqlens_q, meta.max_seqlen_q, len(positions))
        device = positions.device
        cu = meta.cu_seqlens_q.long()
        seqlens = meta.seqlens_k.long()
        first = (seqlens - (cu[1:] - cu[:-1])).unsqueeze(1)
        query_pos = first + torch.arange(meta.max_seqlen_q, device=device).unsqueeze(0)
        key_pos = torch.arange(meta.max_seqlen_k, device=device)
        enc = meta.encoder_lengths.long().unsqueeze(1)
        self_slots = table_slots(meta.block_tables, enc + key_pos, meta.block_size)
        # Padded query rows (beyond a request's new tokens) still see real keys: no empty row.
        allowed = (key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)) & (
            key_pos.view(1, 1, -1) < seqlens.view(-1, 1, 1)
        )
        cross_pos = torch.arange(meta.max_encoder_length, device=device)
        cross_slots = table_slots(meta.block_tables, cross_pos.expand(queries.batch, -1),
                                  meta.block_size)
        cross_allowed = cross_pos.view(1, -1) < enc
        return cls(
            queries, query_pos, key_pos, self_slots, allowed.unsqueeze(1), positions,
            cross_slots, cross_allowed.view(queries.batch, 1, 1, -1),
        )  # fmt: skip


def table_slots(block_tables: torch.Tensor, table_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slot of each table position ([batch, n] int64) of each request's blocks.
    Positions past a request's table read its last column: callers mask them out."""
    columns = torch.clamp(table_pos // block_size, max=max(block_tables.shape[1] - 1, 0))
    blocks = block_tables.long().gather(1, columns)
    return blocks * block_size + table_pos % block_size


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[batch, heads, n, dim]: the cache's K or V at `slots` ([batch, n])."""
    flat = cache.view(-1, *cache.shape[2:])
    batch, n = slots.shape
    return flat.index_select(0, slots.reshape(-1)).view(batch, n, *cache.shape[2:]).transpose(1, 2)


def additive(allowed: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask SDPA takes: `bias` (or 0) where allowed, -inf elsewhere."""
    if bias is None:
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, float("-inf")
        )
    return bias.to(dtype).masked_fill(~allowed, float("-inf"))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q . k + mask) . v, unscaled as T5 ([batch, heads, q, dim] queries)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0)
