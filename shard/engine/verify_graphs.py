"""Verification steps (--speculate) through the decode CUDA graphs: a varlen step as one decode
row per token.

A verification step feeds each row its last token and its drafts (1 + k tokens) and wants logits
at every one (shard/engine/verification.py). Causal attention of a row's token j over the paged
cache is exactly a decode query whose context is the row's first `position + 1` keys: every
token's K/V is written into the cache before any layer's attention reads it, and a key past a
query's position is outside that query's context. So the step is a decode step of T "rows", one
per token, each with the block table of its request and its own context length, and the decode
graph of the smallest batch bucket that holds T tokens replays it (DecodeGraphRunner does the
expansion: decode_graphs.token_rows). Padding rows are the decode graphs' own (token 0 at
position 0 into the scratch slot, logits dropped).

Why this rather than capturing the varlen (prefill) kernel per (batch, tokens-per-row) bucket:
- no graph of its own: the decode graphs already captured (1, 2, 4, ... 32 by default) hold every
  verification step (at most drafting.STEP_TOKENS tokens), so speculation adds no capture time
  and no graph memory; `verification_buckets` only adds the sizes a low --max-batch-size cut off;
- every layer but attention is per token anyway; in attention, the decode kernel reads a row's
  KV once per KV head per token (T times per row), where the Triton prefill kernel reads it once
  per query head (GROUP times: Llama-3-8B's 32 query heads over 8 KV heads, 4 times) and spends a
  64-row query tile on 1 + k <= 17 tokens. At the sizes that draft (batch <= 2, context of a few
  thousand tokens) either is a few percent of the weights' bytes a step reads (8B shape, 1k
  context, k = 4: 5 x 128 MiB of KV against 16 GB of weights); a decode kernel that puts a
  row's T x GROUP query rows in one tile (one KV read per row) is what would remove it, for long
  contexts.
- the prefill kernel's grid depends on the host value max_seqlen_q, so capturing it needs a
  graph per tokens-per-row bucket as well as per batch bucket.
Not yet measured on a GPU: bench/experiments/verify_attention.py times both layouts.
"""

from __future__ import annotations

from collections.abc import Sequence

from pytgi_shard.engine.decode_graphs import bucket_for
from pytgi_shard.engine.drafting import DRAFTING_BATCH, STEP_TOKENS


def most_verified_tokens(speculate: int, drafting_batch: int = DRAFTING_BATCH) -> int:
    """The most tokens a verification step carries: each drafting row's last token and its
    drafts, within the step's cap (0 without --speculate)."""
    if speculate <= 0:
        return 0
    return min(STEP_TOKENS, drafting_batch * (1 + speculate))


def verification_buckets(
    buckets: Sequence[int], sizes: Sequence[int], most_tokens: int
) -> tuple[int, ...]:
    """The batch buckets to capture so that verification steps of up to `most_tokens` tokens
    replay a graph: `buckets` (the decode ones, after --max-batch-size collapsed them), plus the
    --cuda-graphs `sizes` up to the first that holds `most_tokens`. () stays (): graphs off."""
    if not buckets or most_tokens <= max(buckets):
        return tuple(buckets)
    ordered = sorted(set(sizes))
    top = bucket_for(ordered, most_tokens)
    extra = [s for s in ordered if top is None or s <= top]
    return tuple(sorted(set(buckets) | set(extra)))


def draft_buckets(buckets: Sequence[int], most_tokens: int) -> tuple[int, ...]:
    """The draft model's buckets: its graphed forwards (one-token drafts, the catch-up of the
    tokens kept since the last step) never carry more than a verification step, so the target's
    buckets up to the first that holds `most_tokens` (all of them when none does)."""
    ordered = sorted(set(buckets))
    top = bucket_for(ordered, most_tokens)
    return tuple(s for s in ordered if top is None or s <= top)
