"""What a forward needs to know about the flat, paged batch it runs on."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes one forward over a flat batch: all new tokens of all requests in one dimension.

    Request i contributes the new tokens `cu_seqlens_q[i]:cu_seqlens_q[i+1]` of the flat inputs;
    after this forward its KV cache holds `seqlens_k[i]` tokens (the ones already cached plus the
    new ones), laid out in the blocks `block_tables[i, :ceil(seqlens_k[i] / block_size)]`.
    """

    # True when some request has more than one new token (a prefill); decode steps have exactly one.
    is_prefill: bool
    # [batch + 1] int32: prefix sums of new tokens per request.
    cu_seqlens_q: torch.Tensor
    # [batch] int32: tokens in the cache per request once this forward's K/V are written.
    seqlens_k: torch.Tensor
    # [num_tokens] int64: the cache slot (block * block_size + offset) each new token's K/V goes to.
    slot_mapping: torch.Tensor
    # [batch, max_blocks] int32: the blocks of each request, padded with 0.
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int

    @property
    def batch_size(self) -> int:
        return int(self.seqlens_k.shape[0])
