"""The draft model (--speculator-model): a model of the target's tokenizer proposes each asked
row's k drafts autoregressively, from a paged KV cache of its own.

Its cache has the target cache's blocks: the same number, the same ids, so a row's block and
slot tables index both, and the router's allocator, grants, prefix cache and preemption need
nothing new. Each block id holds a block in both caches; the memory rule
(ModelRunner.size_kv_cache, warmup.cache_blocks) divides the KV memory by the two models'
bytes per token added together.

What the draft cache holds for a sequence is written lazily, by the request's own drafting:
DraftState.written counts the sequence's first positions whose KV this request wrote there. A
drafting step's first forward feeds positions [written, length) (the catch-up: the whole prompt
on a request's first drafting step, then the one to k + 1 tokens kept since) and takes the
first draft from its last position's logits; k - 1 one-token forwards then feed each draft to
get the next. Drafts' KV goes to the slots after the known tokens (the router holds k of them
per row for the verification); after the step `written` is the length the step started from:
the next catch-up writes the kept drafts' slots again with the same tokens, and rejected ones
are overwritten, as in the target's cache.

Why lazily, rather than alongside every forward of the target:
- a request that hits the prefix cache joins with its cached blocks' KV written in the target's
  cache by whichever request computed them, which may never have drafted (a batch too large to
  draft, a sampling row), so the draft cache's copy of those blocks cannot be trusted: each
  request writes its own. Rewriting a shared block that another live request reads writes the
  same tokens at the same positions: the KV differs at most by float rounding, which only that
  request's drafts can see, never its output (verification is exact);
- batches too large to draft, and rows that never draft, never pay a draft forward;
- chunked prefill, preemption and resume need nothing: a resumed request is a new
  RequestState, written 0.
Its cost: a request's first drafting step runs its sequence through the draft model, at most
`catch_up_tokens` per step (the prefill budget Warmup measured the peak with: a draft model no
larger than the target peaks below it); a longer sequence is caught up over several steps and
drafts once it is.

Draft forwards choose the argmax of the draft's logits over the vocabulary both models share.
With CUDA graphs the draft has decode graphs of its own (`graphs`, captured over its cache by
the ModelRunner, buckets verify_graphs.draft_buckets): its one-token forwards replay them, and so
does a catch-up small enough for a bucket (the one to k + 1 tokens kept since the last step, as
one row per token: decode_graphs.token_rows), with logits at every token; a longer catch-up (a
request's first) runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.decode_graphs import DecodeGraphRunner
from pytgi_shard.engine.draft_steps import (
    CATCH_UP_TOKENS,
    Feed,
    catch_up_inputs,
    one_position_meta,
    plan_catch_up,
)
from pytgi_shard.engine.drafting import Drafts
from pytgi_shard.engine.step_inputs import ForwardInputs
from pytgi_shard.models.model import Model


class DraftModel:
    """A draft model and its KV cache, sized by the ModelRunner with the target's."""

    name = "draft-model"

    def __init__(self, model: Model, target_vocab: int, block_size: int) -> None:
        self.model = model
        # The ids both vocabularies have (a checkpoint may pad its embedding past the tokenizer).
        self.vocab = min(model.vocab_size, target_vocab)
        self.block_size = block_size
        self.catch_up_tokens = CATCH_UP_TOKENS
        self.kv_cache = self._allocate(1)
        # Its decode graphs over `kv_cache` (None: every forward eager); the ModelRunner's.
        self.graphs: DecodeGraphRunner | None = None

    def bytes_per_token(self) -> int:
        """Bytes of this rank's draft cache per token of context (in the draft's dtype)."""
        m = self.model
        return KVCache.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, m.dtype)

    def _allocate(self, num_blocks: int) -> KVCache:
        m = self.model
        return KVCache.allocate(
            m.num_layers, num_blocks, self.block_size, m.num_kv_heads, m.head_dim, m.dtype,
            m.device,
        )

    def resize(self, num_blocks: int) -> None:
        """The cache at `num_blocks` blocks (the target's count); the old one goes first."""
        self.kv_cache = self._allocate(1)
        if num_blocks > 1:
            self.kv_cache = self._allocate(num_blocks)

    @torch.inference_mode()
    def propose(self, batch: Batch, asks: Sequence[tuple[int, int]]) -> Drafts | None:
        """The asked rows caught up (within catch_up_tokens) and, for those caught up, k
        drafts each; one read back to the host at the end."""
        feed, drafting = plan_catch_up(batch, asks, self.catch_up_tokens)
        if not feed:
            return None
        first = self._catch_up(batch, feed, [i for i, _ in drafting])
        for (row, _, end) in feed:
            draft = batch.requests[row].draft
            assert draft is not None
            draft.written = end
        if not drafting:
            return None
        rows = [feed[i][0] for i, _ in drafting]
        ks = [k for _, k in drafting]
        tokens = self._continue(batch, rows, [feed[i][2] for i, _ in drafting], ks, first)
        return Drafts(rows, tokens)

    def _catch_up(self, batch: Batch, feed: Feed, drafting: list[int]) -> torch.Tensor:
        """One varlen forward over each fed row's positions [start, end) (written into the
        draft cache), with logits at the last position of the drafting ones: their first
        drafts, [len(drafting)] on the device."""
        inputs = catch_up_inputs(batch, feed, drafting, self.block_size)
        last = inputs.last
        ids = batch.all_ids[inputs.row_of_token, inputs.positions]
        every = ForwardInputs(ids, inputs.positions, inputs.meta, None, last)
        if self.graphs is not None and self.graphs.takes(every, self.kv_cache):
            logits = self.graphs.forward(every, self.kv_cache).index_select(0, last)
        else:
            logits = self.model.forward(ids, inputs.positions, self.kv_cache, inputs.meta, last)
        return logits[:, : self.vocab].argmax(dim=-1)

    def _continue(
        self, batch: Batch, rows: list[int], lengths: list[int], ks: list[int],
        first: torch.Tensor,
    ) -> list[list[int]]:
        """Drafts 2..k of each drafting row: one-token forwards, each feeding the rows' latest
        draft at its position (its KV into the slot after the previous one), for the rows whose
        k goes that far."""
        device = first.device
        out = torch.zeros(len(rows), max(ks), dtype=torch.long, device=device)
        out[:, 0] = first
        row_t = torch.tensor(rows, dtype=torch.long, device=device)
        length_t = torch.tensor(lengths, dtype=torch.long, device=device)
        for i in range(1, max(ks)):
            active = [j for j, k in enumerate(ks) if k > i]
            at = torch.tensor(active, dtype=torch.long, device=device)
            these = row_t[at]
            positions = length_t[at] - 1 + i
            meta = one_position_meta(batch, these, positions,
                                     max(lengths[j] for j in active) + i, self.block_size)
            logits = self._decode(ForwardInputs(out[at, i - 1], positions, meta, None, at))
            out[at, i] = logits[:, : self.vocab].argmax(dim=-1)
        return [row[:k] for row, k in zip(out.tolist(), ks, strict=True)]

    def _decode(self, inputs: ForwardInputs) -> torch.Tensor:
        """A one-token forward's logits, through the draft's graphs when they take it (then a
        view of the graph's output: consumed before the next forward)."""
        if self.graphs is not None and self.graphs.takes(inputs, self.kv_cache):
            return self.graphs.forward(inputs, self.kv_cache)
        return self.model.forward(
            inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, None
        )


def draft_share_line(draft: DraftModel, target: KVCache, num_blocks: int) -> str:
    """Warmup's word on the memory rule: each block id holds a block in both caches, so the
    KV memory splits between them in proportion to their bytes per token."""
    k = target.keys[0]
    target_bytes = 2 * len(target.keys) * k[0, 0].numel() * k.element_size()
    draft_bytes = draft.bytes_per_token()
    share = draft_bytes / (draft_bytes + target_bytes)
    return (
        f"draft model KV cache: {num_blocks} blocks beside the target's, {draft_bytes} bytes "
        f"per token against the target's {target_bytes}: {share:.0%} of the KV memory"
    )
