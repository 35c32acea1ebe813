"""One rank's model runner: the model and everything that lives on the device beside it.

The Engine (shard/engine/engine.py) answers the RPCs, keeps the batches and chooses tokens; it
hands this runner a step's flat inputs and gets logits back. The runner owns what a forward needs
and what is sized against device memory: the KV cache (block 0 alone until Warmup sizes it), the
decode CUDA graphs captured over that cache, the forwards launched one step ahead (the overlap
scheduler's look-aheads, shard/engine/lookahead.py), the Health forward, and Warmup's sizing
(the measurements are shard/engine/warmup.py's functions on plain values).

Warmup sizes the cache from the peak of a real prefill and decode, which only the Engine can run
(batches, sampling, detokenizing): the Engine passes size_kv_cache a callable that runs the
warmup batch through its own Prefill and Decode, and the runner measures the device around it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.device.distributed import Dist
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.decode_graphs import DecodeGraphRunner
from pytgi_shard.engine.draft_model import DraftModel, draft_share_line
from pytgi_shard.engine.eagle3 import Eagle3Drafter
from pytgi_shard.engine.forward_timer import ForwardTimer
from pytgi_shard.engine.graphs_off import graphs_off_reason
from pytgi_shard.engine.hidden_drafter import HiddenStateDrafter
from pytgi_shard.engine.kv_format import capacity_line, resolve_kv_format
from pytgi_shard.engine.lookahead import Lookahead, Lookaheads
from pytgi_shard.engine.step_inputs import ForwardInputs
from pytgi_shard.engine.verify_graphs import (
    draft_buckets,
    most_verified_tokens,
    verification_buckets,
)
from pytgi_shard.engine.warmup import (
    CacheSize,
    Limits,
    agree,
    allocation_failure,
    cache_blocks,
    capture_graphs,
    graph_buckets,
    graph_bytes,
    graph_sizes,
    is_out_of_memory,
    no_cache_room,
    peak_bytes,
    prefill_failure,
    prompt_lengths,
    warmup_batch,
)
from pytgi_shard.errors import OutOfMemory
from pytgi_shard.lora.layer import RowAdapters
from pytgi_shard.models.model import Model
from pytgi_shard.settings import ShardSettings

log = logging.getLogger(__name__)

# Runs a warmup batch to its end (a Prefill, then a Decode while requests remain): the Engine's.
RunBatch = Callable[[generate_pb2.Batch], None]


class ModelRunner:
    def __init__(self, model: Model, dist: Dist, settings: ShardSettings,
                 lora_rows: RowAdapters | None = None,
                 draft: DraftModel | HiddenStateDrafter | Eagle3Drafter | None = None) -> None:
        self.model = model
        # The draft model (--speculator-model): its KV cache has the target's blocks, sized
        # and resized with it (shard/engine/draft_model.py).
        self.draft = draft if isinstance(draft, DraftModel) else None
        # Speculator heads (--speculator-model): told which KV slots each eager forward's LM
        # head rows are, they keep its hidden states (shard/engine/hidden_drafter.py).
        self.hidden_tap = draft if isinstance(draft, HiddenStateDrafter | Eagle3Drafter) else None
        # An EAGLE-3 head (--speculator-model): tapped like the heads, and its KV cache and
        # store of the target's fused states sized with the target's (shard/engine/eagle3.py).
        self.eagle = draft if isinstance(draft, Eagle3Drafter) else None
        # The rows of each LoRA adapter, bound around every eager forward (the decode graphs
        # bind it to their own buffer); the model's LoraLinear layers read it (shard/lora/).
        self.lora_rows = lora_rows or RowAdapters()
        self.dist = dist
        self.settings = settings
        self.block_size = settings.block_size
        # The cache's dtype (FP8 with its scales under --kv-cache-dtype), for every allocation.
        self.kv_format = resolve_kv_format(settings, model)
        # Block 0 only, for Health, until Warmup sizes the cache.
        self.kv_cache = self.allocate_kv_cache(1)
        # Decode forwards through CUDA graphs; Warmup captures them over the cache it sizes.
        self.decode_graphs: DecodeGraphRunner | None = None
        self.lookaheads = Lookaheads()

    def allocate_kv_cache(self, num_blocks: int) -> KVCache:
        m = self.model
        kv = self.kv_format
        return KVCache.allocate(
            m.num_layers, num_blocks, self.block_size, m.num_kv_heads, m.head_dim, kv.dtype,
            m.device, kv.scales,
        )

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Replaces the KV cache by one of `num_blocks` blocks. The old one goes first (block 0
        alone meanwhile), so two caches are never held at once; if the new one cannot be
        allocated, block 0 alone is left, and Health still works. The look-aheads go too: they
        wrote into the old cache."""
        self.lookaheads.clear()
        self.kv_cache = self.allocate_kv_cache(1)
        if self.draft is not None:
            self.draft.resize(1)
        if self.eagle is not None:
            self.eagle.resize(1)
        if num_blocks > 1:
            self.kv_cache = self.allocate_kv_cache(num_blocks)
            if self.draft is not None:
                self.draft.resize(num_blocks)
            if self.eagle is not None:
                self.eagle.resize(num_blocks)

    def forward(self, inputs: ForwardInputs) -> tuple[torch.Tensor, ForwardTimer, bool]:
        """The model's logits for `inputs`, through a CUDA graph when one fits (then the logits
        are a view of the graph's output, which its next replay overwrites: the bool says so)."""
        timer = ForwardTimer(self.model.device)
        graphs = self.decode_graphs
        # A vision-language prefill (inputs.media) is never graphed: its rows need the model's
        # image and M-RoPE inputs, which a decode graph does not take.
        if inputs.media is None and graphs is not None and graphs.takes(inputs, self.kv_cache):
            logits, graphed = graphs.forward(inputs, self.kv_cache), True
        else:
            self.lora_rows.bind(inputs.adapters)
            if self.hidden_tap is not None:
                self.hidden_tap.arm(inputs)
            try:
                logits, graphed = self.model.forward(
                    inputs.input_ids,
                    inputs.positions,
                    self.kv_cache,
                    inputs.meta,
                    inputs.lm_head_indices,
                    **({"media": inputs.media} if inputs.media is not None else {}),
                ), False
            finally:
                self.lora_rows.clear()
                if self.hidden_tap is not None:
                    self.hidden_tap.disarm()
        timer.stop()
        return logits, timer, graphed

    def look_ahead(self, batch: Batch) -> None:
        """Queues the next decode forward of every request of `batch` (shard/engine/lookahead.py)."""
        logits, timer, graphed = self.forward(batch.lookahead_inputs())
        if graphed:
            logits = logits.clone()
        self.lookaheads.add(Lookahead(list(batch.request_ids), logits, timer))

    @torch.inference_mode()
    def health(self) -> None:
        """Proves the device still computes: a one-token forward into reserved block 0, through
        the batch-1 decode graph when Warmup captured one (on a GPU one replay, not a forward's
        worth of launches).

        With several ranks the forward's collectives could interleave with a Prefill/Decode that
        another rank is running, so there Health computes on the device without collectives.
        """
        device = self.model.device
        if self.dist.world_size > 1:
            x = torch.ones(2, 2, device=device)
            if float((x @ x).sum()) != 8.0:
                raise RuntimeError(f"device {device} computed a wrong result")
            return
        zero = torch.zeros(1, dtype=torch.long, device=device)
        meta = AttentionMetadata.build([1], [0], [[0]], self.block_size, device)
        logits, _, _ = self.forward(ForwardInputs(zero, zero, meta, None, zero))
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError("health check forward produced non-finite logits")

    def size_kv_cache(self, limits: Limits, run_batch: RunBatch) -> CacheSize:
        """Runs the largest prefill the router will send through `run_batch` (in a cache of its
        own size, shrunk back to block 0 after), measures the decode graphs, and returns the
        cache size every rank agrees on. The previous Warmup's graphs are let go first: they
        hold the old cache and their memory pool."""
        self.release_graphs()
        model = self.model
        if self.draft is not None:
            # Its catch-up forward peaks below the prefill measured here (a draft no larger).
            self.draft.catch_up_tokens = max(limits.max_prefill_tokens, 1)
        if self.eagle is not None:
            self.eagle.catch_up_tokens = max(limits.max_prefill_tokens, 1)
        lengths = prompt_lengths(limits, model.max_position_embeddings)
        batch = warmup_batch(lengths, model.vocab_size, self.block_size)
        blocks_used = 1 + sum(len(r.blocks) for r in batch.requests)
        peak = self._warmup_peak(batch, blocks_used, sum(lengths), run_batch)
        # Verification steps replay the decode graphs as one row per token (verify_graphs.py).
        most = most_verified_tokens(self.settings.speculate)
        buckets = verification_buckets(
            graph_buckets(self.settings, model, self.dist.caps, limits, self.dist.world_size),
            graph_sizes(self.settings, self.dist.caps), most,
        )
        if buckets and self.hidden_tap is not None and self._graph_tap() is None:
            # A graph's replay runs no Python hook: this tap would see no hidden state.
            log.info("CUDA graphs off: the speculator reads the hidden states of eager forwards")
            buckets = ()
        # Before the cache is sized, the longest context is bounded by the model's.
        longest = limits.max_total_tokens or model.max_position_embeddings
        graph_room = (
            graph_bytes(model, self.kv_cache, self.block_size, buckets, longest) if buckets else 0
        )
        if self._draft_buckets(buckets):
            assert self.draft is not None
            graph_room += graph_bytes(self.draft.model, self.draft.kv_cache, self.block_size,
                                      self._draft_buckets(buckets), longest)
        # A draft model's cache has a block for every block id of the target's: each id costs
        # both models' bytes (shard/engine/draft_model.py).
        draft_bytes = self.draft.bytes_per_token() if self.draft is not None else 0
        if self.eagle is not None:
            draft_bytes += self.eagle.bytes_per_token()
        mine = cache_blocks(limits, model, self.block_size, self.settings, peak + graph_room,
                            draft_bytes)
        num_blocks = agree(self.dist, model.device, mine)
        if num_blocks < 2:
            raise no_cache_room()
        return CacheSize(num_blocks, buckets, graph_room)

    def _warmup_peak(
        self, batch: generate_pb2.Batch, num_blocks: int, prefill_tokens: int, run_batch: RunBatch
    ) -> int:
        """Runs the batch in a cache of its own size; returns the peak bytes beyond the cache."""
        try:
            self.resize_kv_cache(num_blocks)
            model = self.model

            def run() -> None:
                run_batch(batch)
                # A vision tower's largest image peaks apart from the prefill: measured too.
                model.warmup_images()

            return peak_bytes(model.device, run)
        except (RuntimeError, MemoryError) as e:
            if not is_out_of_memory(e):
                raise
            raise prefill_failure(prefill_tokens) from e
        finally:
            self.resize_kv_cache(1)

    def allocate_sized(self, size: CacheSize) -> None:
        """The cache at the size Warmup measured; an OutOfMemory when the device cannot hold it."""
        try:
            self.resize_kv_cache(size.num_blocks)
        except (RuntimeError, MemoryError) as e:
            if not is_out_of_memory(e):
                raise
            raise allocation_failure(size.num_blocks) from e
        log.info(capacity_line(self.kv_format, self.model, size.num_blocks, self.block_size))
        if self.draft is not None:
            log.info(draft_share_line(self.draft, self.kv_cache, size.num_blocks))
        if self.eagle is not None:
            log.info("EAGLE-3 head: %d bytes per token beside the target's cache (its KV and "
                     "the target's fused hidden states)", self.eagle.bytes_per_token())

    def _graph_tap(self) -> HiddenStateDrafter | None:
        """The hidden-state tap the decode graphs hand each replay's hidden states to: Medusa's
        and the MLP speculator's (their final hidden state, decode_graphs.HiddenTap)."""
        tap = self.hidden_tap
        return tap if isinstance(tap, HiddenStateDrafter) else None

    def _draft_buckets(self, buckets: tuple[int, ...]) -> tuple[int, ...]:
        """The draft model's graph buckets (verify_graphs.draft_buckets); () without a draft
        model, without the target's graphs, or when the draft's forward is not capturable."""
        draft = self.draft
        if draft is None or not buckets:
            return ()
        reason = graphs_off_reason(self.settings, draft.model, self.dist.caps,
                                   self.dist.world_size)
        if reason is not None:
            log.info("draft model CUDA graphs off: %s", reason)
            return ()
        return draft_buckets(buckets, most_verified_tokens(self.settings.speculate))

    def release_graphs(self) -> None:
        """Lets the previous Warmup's graphs go: they hold the old cache and their memory pool."""
        if self.decode_graphs is not None:
            self.decode_graphs.release()
            self.decode_graphs = None
        if self.draft is not None and self.draft.graphs is not None:
            self.draft.graphs.release()
            self.draft.graphs = None

    def capture_graphs(self, size: CacheSize, max_total_tokens: int) -> None:
        """The decode graphs over the sized cache; on OutOfMemory the cache is given back
        (block 0 stays, for Health) and the error raised, failing this Warmup."""
        try:
            self.decode_graphs = capture_graphs(
                self.model, self.kv_cache, self.block_size, size, max_total_tokens,
                self._graph_tap(),
            )
            if self.draft is not None and self._draft_buckets(size.graph_buckets):
                # The draft model's own (its one-token forwards, short catch-ups).
                self.draft.graphs = capture_graphs(
                    self.draft.model, self.draft.kv_cache, self.block_size,
                    replace(size, graph_buckets=self._draft_buckets(size.graph_buckets)),
                    max_total_tokens,
                )
        except OutOfMemory:
            # The cache took the room the graphs were measured to need.
            self.resize_kv_cache(1)
            torch.cuda.empty_cache()
            raise
