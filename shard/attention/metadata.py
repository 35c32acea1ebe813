"""What a forward needs to know about the flat, paged batch it runs on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pytgi_shard.attention.plans import AttentionPlans


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
    # Tensors a backend derives from the fields above (indices, masks) once per forward and every
    # layer then reuses (shard/attention/plans.py). Empty when the metadata is built, so build a
    # new metadata for every forward rather than mutating one in place.
    plans: AttentionPlans = field(default_factory=AttentionPlans, repr=False, compare=False)
    # [num_tokens, 2] int32, or None (every token causal): for each new token, the context
    # positions [lo, hi) of the bidirectional span it belongs to, which it attends to whole,
    # later positions included, beside its causal (and windowed) past; (0, 0) for a token in
    # none. PaliGemma's prefix (image + prompt) and each Gemma 3 image are such spans
    # (noncausal_spans builds it). A span must end within the keys of this forward (the
    # router never ends a chunk inside one), and decode tokens are in none.
    spans: torch.Tensor | None = None
    # True when the forward is traced to be compiled (a --cpu-graphs decode step): the reference
    # backend then writes decode attention as reductions the compiler fuses with the cache's
    # gather (shard/attention/compiled_decode.py), which eager PyTorch would materialise.
    compiled: bool = False

    @property
    def batch_size(self) -> int:
        return int(self.seqlens_k.shape[0])

    @classmethod
    def build(
        cls,
        new_tokens: Sequence[int],
        cached_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Metadata for requests with `new_tokens[i]` new tokens after `cached_tokens[i]` cached.

        A plain host-side constructor (tests, tools, warmup); the engine's hot path may build
        the same fields faster from its own arrays.
        """
        if not len(new_tokens) == len(cached_tokens) == len(block_tables):
            raise ValueError("new_tokens, cached_tokens and block_tables differ in length")
        slots: list[int] = []
        seqlens_k: list[int] = []
        for new, cached, blocks in zip(new_tokens, cached_tokens, block_tables, strict=True):
            total = cached + new
            if new < 1 or len(blocks) * block_size < total:
                raise ValueError(
                    f"a request with {new} new tokens after {cached} cached needs "
                    f"{-(-total // block_size)} blocks of {block_size}, has {len(blocks)}"
                )
            slots.extend(blocks[p // block_size] * block_size + p % block_size
                         for p in range(cached, total))
            seqlens_k.append(total)
        width = max(len(b) for b in block_tables)
        table = [list(b) + [0] * (width - len(b)) for b in block_tables]
        cu = [0]
        for new in new_tokens:
            cu.append(cu[-1] + new)
        return cls(
            is_prefill=max(new_tokens) > 1,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seqlens_k=torch.tensor(seqlens_k, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(table, dtype=torch.int32, device=device),
            max_seqlen_q=max(new_tokens),
            max_seqlen_k=max(seqlens_k),
            block_size=block_size,
        )


def noncausal_spans(
    new_tokens: Sequence[int],
    cached_tokens: Sequence[int],
    spans: Sequence[Sequence[tuple[int, int]]],
    device: torch.device,
) -> torch.Tensor | None:
    """AttentionMetadata.spans for requests with `new_tokens[i]` new tokens after
    `cached_tokens[i]` cached and bidirectional spans `spans[i]` ([lo, hi) context positions,
    disjoint); None when no new token lies in a span (the forward is plain causal). A span
    that ends past this forward is refused: its tokens here would miss its later keys. One
    that starts before it may only come from a prefix-cache hit ending inside the span, whose
    blocks the router keys by the whole span's content (prefix_cache.span_keyed): their KV was
    computed over this very span."""
    rows: list[tuple[int, int]] = []
    found = False
    for new, cached, request_spans in zip(new_tokens, cached_tokens, spans, strict=True):
        row = [(0, 0)] * new
        for lo, hi in request_spans:
            first, last = max(lo, cached), min(hi, cached + new)
            if first >= last:
                continue
            if hi > cached + new:
                raise ValueError(f"bidirectional span [{lo}, {hi}) is split: this forward "
                                 f"computes tokens [{cached}, {cached + new}) of it")
            row[first - cached : last - cached] = [(lo, hi)] * (last - first)
            found = True
        rows.extend(row)
    if not found:
        return None
    return torch.tensor(rows, dtype=torch.int32, device=device).view(-1, 2)
