"""The EAGLE-3 drafter (--speculator-model with an EAGLE-3 head, shard/models/llama/eagle3_head.py):
the head drafts from the target's hidden states of three layers, with a paged KV cache of its own.

Where the hidden states come from: hooks on the target's decoder layers take, in every eager
target forward the ModelRunner arms (prefill chunks, decode steps, verifications, look-aheads),
the residual streams entering the three chosen layers at every fed token, and write
fc(their concatenation) into a per-slot store: a [slots, hidden] tensor indexed by the KV slot
the token went to, with the target cache's blocks (same ids), so a row's slot table finds any of
its positions' fused state. Kept per position, as the head needs them for every position its
cache catches up, not only the latest forward's. Valid for exactly the positions whose target KV
is: the store is written by the forward that writes the KV, so prefix-cache hits, chunked
prefill and resumed requests (re-prefilled) need nothing; a rejected draft's slot holds a stale
state until the token that takes its place is fed, and no catch-up reads it before then. A graph
replay runs no hook: start-up turns the decode graphs off (as with the other heads).

The head's cache, and which position holds what (EAGLE's shift by one): head position p holds
the embedding of token p + 1 beside the target's fused state at p (whose logits chose token
p + 1), and proposes token p + 2. For a row of length L (tokens 0..L-1, L - 1 the newest, not
yet fed to the target) the target has states up to L - 2; DraftState.written counts the head
positions written, and a drafting step's catch-up forward feeds [written, L - 1) (the whole
sequence less one the first time, then the 1 to k + 1 tokens kept since), whose last position
gives the first draft. Each further draft i feeds the draft before it at position L - 2 + i with
the head's own pre-norm output at the position before as its hidden state. After the step
`written` is L - 1: the next catch-up rewrites the drafts' positions with the kept tokens, and
rejected ones are overwritten, as in the draft model's cache (shard/engine/draft_model.py,
whose catch-up plan and budget, and the metadata of both kinds of forward, this shares:
shard/engine/draft_steps.py). Each block id costs a block of the head's KV and of the store
beside the target's (bytes_per_token, the memory rule of Warmup).

Replicated on every rank: each rank's residual streams are whole after the row-parallel
all-reduce, so every rank stores and proposes the same; the target's embedding the head may
share is the tensor-parallel one, called by every rank in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.draft_steps import (
    CATCH_UP_TOKENS,
    Feed,
    catch_up_inputs,
    one_position_meta,
    plan_catch_up,
)
from pytgi_shard.engine.drafting import Drafts
from pytgi_shard.engine.step_inputs import ForwardInputs
from pytgi_shard.models.llama.eagle3_head import Eagle3Head

Embed = Callable[[torch.Tensor], torch.Tensor]


class Eagle3Drafter:
    """The head, its KV cache and the store of the target's fused states (the module's
    docstring), sized by the ModelRunner with the target's cache."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head, layers: Sequence[nn.Module], aux_layers: Sequence[int],
                 embed: Embed, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.head = head
        self.embed = embed
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.catch_up_tokens = CATCH_UP_TOKENS
        self.aux_layers = tuple(sorted(aux_layers))
        # While a target forward runs: its tokens' slots, and the streams taken so far.
        self._slots: torch.Tensor | None = None
        self._streams: list[torch.Tensor] = []
        self.kv_cache, self.store = self._allocate(1)
        for j in self.aux_layers:
            if j == 0:
                layers[0].register_forward_pre_hook(self._take_input)
            else:
                layers[j - 1].register_forward_hook(self._take_output)

    def bytes_per_token(self) -> int:
        """Bytes per token of context beside the target's cache: the head's KV and the store."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.head.kv_bytes_per_token(self.dtype) + self.head.config.hidden_size * element

    def _allocate(self, num_blocks: int) -> tuple[KVCache, torch.Tensor]:
        c = self.head.config
        kv = KVCache.allocate(1, num_blocks, self.block_size, c.num_kv_heads, c.head_dim,
                              self.dtype, self.device)
        store = torch.zeros(num_blocks * self.block_size, c.hidden_size, dtype=self.dtype,
                            device=self.device)
        return kv, store

    def resize(self, num_blocks: int) -> None:
        """The cache and store at `num_blocks` blocks (the target's count); the old go first."""
        self.kv_cache, self.store = self._allocate(1)
        if num_blocks > 1:
            self.kv_cache, self.store = self._allocate(num_blocks)

    # The ModelRunner's tap around each eager target forward (as HiddenStateDrafter's).
    def arm(self, inputs: ForwardInputs) -> None:
        self._slots = inputs.meta.slot_mapping
        self._streams = []

    def disarm(self) -> None:
        self._slots = None
        self._streams = []

    def _take_input(self, module: nn.Module, args: tuple[object, ...]) -> None:
        """The stream entering layer 0: the embedded tokens."""
        hidden = args[0]
        assert isinstance(hidden, torch.Tensor)
        self._take(hidden)

    def _take_output(self, module: nn.Module, args: tuple[object, ...],
                     output: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The stream after a layer: its branch output plus the residual it left to the next
        norm (shard/models/llama/model.py's layers return the two apart)."""
        out, residual = output
        self._take(out + residual)

    def _take(self, stream: torch.Tensor) -> None:
        slots = self._slots
        if slots is None or stream.shape[0] != slots.shape[0]:
            return
        self._streams.append(stream)
        if len(self._streams) == len(self.aux_layers):
            fused = self.head.fuse(torch.cat(self._streams, dim=-1))
            self.store[slots] = fused.to(self.dtype)
            self._streams = []

    @torch.inference_mode()
    def propose(self, batch: Batch, asks: Sequence[tuple[int, int]]) -> Drafts | None:
        """The asked rows caught up (within catch_up_tokens) and, for those caught up, k
        drafts each; one read back to the host at the end."""
        feed, drafting = plan_catch_up(batch, asks, self.catch_up_tokens, lag=1)
        if not feed:
            return None
        first, states = self._catch_up(batch, feed, [i for i, _ in drafting])
        for (row, _, end) in feed:
            draft = batch.requests[row].draft
            assert draft is not None
            draft.written = end
        if not drafting:
            return None
        rows = [feed[i][0] for i, _ in drafting]
        tokens = self._continue(batch, rows, [feed[i][2] for i, _ in drafting],
                                [k for _, k in drafting], first, states)
        return Drafts(rows, tokens)

    def _catch_up(
        self, batch: Batch, feed: Feed, drafting: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One varlen forward of the head over each fed row's positions [start, end): the
        first drafts and pre-norm states at the last position of the drafting rows."""
        inputs = catch_up_inputs(batch, feed, drafting, self.block_size)
        positions, slots = inputs.positions, inputs.meta.slot_mapping
        embeds = self.embed(batch.all_ids[inputs.row_of_token, positions + 1])
        tokens, prenorm = self.head.step(embeds, self.store[slots], positions, self.kv_cache,
                                         inputs.meta, inputs.last)
        return tokens, prenorm[inputs.last]

    def _continue(
        self, batch: Batch, rows: list[int], ends: list[int], ks: list[int],
        first: torch.Tensor, states: torch.Tensor,
    ) -> list[list[int]]:
        """Drafts 2..k of each drafting row: one-position steps, each feeding the row's latest
        draft at the position after the last, with the head's pre-norm state from there."""
        device = first.device
        out = torch.zeros(len(rows), max(ks), dtype=torch.long, device=device)
        out[:, 0] = first
        row_t = torch.tensor(rows, dtype=torch.long, device=device)
        end_t = torch.tensor(ends, dtype=torch.long, device=device)
        for i in range(1, max(ks)):
            active = [j for j, k in enumerate(ks) if k > i]
            at = torch.tensor(active, dtype=torch.long, device=device)
            these = row_t[at]
            positions = end_t[at] - 1 + i
            meta = one_position_meta(batch, these, positions,
                                     max(ends[j] for j in active) + i, self.block_size)
            tokens, prenorm = self.head.step(self.embed(out[at, i - 1]), states[at], positions,
                                             self.kv_cache, meta, None)
            out[at, i] = tokens
            states = states.clone()
            states[at] = prenorm
        return [row[:k] for row, k in zip(out.tolist(), ks, strict=True)]
