"""CUDA graphs for decode steps, bucketed by batch size (TGI's --cuda-graphs).

A decode step launches hundreds of small kernels whose launch cost, not their work, bounds small
batches. The runner captures one graph per bucket of batch sizes over persistent input buffers;
a step copies its inputs into the first rows of the buffers, pads the rest, and replays the
graph of the smallest bucket that holds it. Padded rows are requests of one token at position 0
whose K/V go to slot 0 of block 0, the block the router never hands out; their logits are
dropped. Batches above the largest bucket, or with block tables wider than the buffers, run
eagerly. With LoRA adapters each row's adapter slot is one more input buffer (padding rows: 0,
the base model): the adapted layers read it on the device (shard/lora/layer.py), so a step of
any mix of adapters replays the same graph.

A varlen step that wants logits at every token (a --speculate verification step: each row's
last token and its drafts) runs as a decode step of one row per token (`token_rows`: each
token's request's block table and its own context, position + 1), bucketed by its token count:
shard/engine/verify_graphs.py says why this is exact and why it is preferred to capturing the
varlen kernel.

Speculator heads (Medusa, the MLP speculator) read the target's final hidden state, which a hook
on the LM head keeps (shard/engine/hidden_drafter.py). A replay runs no Python hook, so the
runner hands the hook's tensor over itself: with a `tap`, the capture arms it over the buffers
and keeps the hidden-state tensor the hook saw, which lives in the graph's memory and holds each
replay's hidden states; after a replay the tap gets that tensor and the buffers' slots.

On a CPU there are no graphs to capture; each bucket's padded forward is compiled instead
(--cpu-graphs: `compile_bucket`, shard/engine/cpu_graphs.py, after Warmup on a thread,
shard/engine/background_compile.py) and `forward` calls the compiled step where a GPU replays:
the same buckets, buffers and padding, but not a static context: the block tables' width is the
compiled step's one free size, so each step attends what its longest row needs (`compile_bucket`).
When either is off, and why: shard/engine/graphs_off.py.

A graph freezes every shape and every host-side value it saw, so the metadata it is captured with
states the largest context (max_seqlen_k = max_blocks_per_seq * block_size) rather than the
step's: only a backend whose launches do not depend on that value gains from a graph (Triton's
decode does; the reference backend gathers max_seqlen_k keys per request, so it is never captured
in production, though it captures correctly).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from pytgi_shard.attention.kv_cache import SCRATCH_SLOT, KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.engine.batch import ForwardInputs
from pytgi_shard.engine.cpu_graphs import FreeSize, NotCompilable, Step, compile_step
from pytgi_shard.lora.layer import RowAdapters, lora_rows_of
from pytgi_shard.models.model import Model

log = logging.getLogger(__name__)

class HiddenTap(Protocol):
    """Keeps the hidden states a forward's LM head reads and the KV slot of each row's token
    (hidden_drafter.HiddenStateDrafter): armed before an eager forward, set after a replay."""

    hidden: torch.Tensor | None
    slots: torch.Tensor | None

    def arm(self, inputs: ForwardInputs) -> None: ...

    def disarm(self) -> None: ...


def resolve_buckets(sizes: Sequence[int], max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes to capture: `sizes`, those above the router's max_batch_size (0: no cap)
    collapsed onto it, so that a capped list still covers every batch the router can form."""
    if max_batch_size > 0:
        sizes = [min(size, max_batch_size) for size in sizes]
    return tuple(sorted(set(sizes)))


def bucket_for(buckets: Sequence[int], batch_size: int) -> int | None:
    """The smallest bucket that holds `batch_size` (buckets sorted), None when none does."""
    i = bisect.bisect_left(buckets, batch_size)
    return buckets[i] if i < len(buckets) else None


def token_rows(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per flat token of a varlen step: its request's row [T] int64 and the context it attends
    to as a decode query, its position + 1 [T] int32. On the device, without a host
    synchronisation (a replay's inputs are copied on the stream).

    Request r's q_len new tokens sit at context positions seqlens_k[r] - q_len ..
    seqlens_k[r] - 1, so its flat token t (cu[r] <= t < cu[r + 1]) is at seqlens_k[r] -
    cu[r + 1] + t.
    """
    ends = meta.cu_seqlens_q[1:].long()
    t = torch.arange(num_tokens, device=ends.device)
    rows = torch.searchsorted(ends, t, right=True)
    seqlens = meta.seqlens_k.long()[rows] - ends[rows] + t + 1
    return rows, seqlens.to(torch.int32)


@dataclass(frozen=True, slots=True)
class _Buffers:
    """The graphs' inputs: every replay reads these addresses, so they live as long as the runner."""

    input_ids: torch.Tensor  # [max_bucket] int64
    positions: torch.Tensor  # [max_bucket] int64
    slot_mapping: torch.Tensor  # [max_bucket] int64
    seqlens_k: torch.Tensor  # [max_bucket] int32
    cu_seqlens_q: torch.Tensor  # [max_bucket + 1] int32: 0, 1, 2, ... (one token per request)
    block_tables: torch.Tensor  # [max_bucket, max_blocks_per_seq] int32
    adapters: torch.Tensor  # [max_bucket] int64: each row's LoRA slot (0: the base model)

    @classmethod
    def allocate(cls, rows: int, max_blocks: int, device: torch.device) -> _Buffers:
        def long() -> torch.Tensor:
            return torch.zeros(rows, dtype=torch.long, device=device)

        return cls(
            input_ids=long(),
            positions=long(),
            slot_mapping=torch.full((rows,), SCRATCH_SLOT, dtype=torch.long, device=device),
            seqlens_k=torch.ones(rows, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(rows, max_blocks, dtype=torch.int32, device=device),
            adapters=long(),
        )


class DecodeGraphRunner:
    """Runs decode forwards padded to batch-size buckets: replayed from a CUDA graph once
    captured, else eagerly over the same buffers (CPU, tests, and the run before a capture).

    `pad_eagerly` makes `takes` accept bucketed batches without graphs, so that the padding path
    runs inside the engine on any device (tests).
    """

    def __init__(
        self,
        model: Model,
        buckets: Sequence[int],
        max_blocks_per_seq: int,
        block_size: int,
        pad_eagerly: bool = False,
    ) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be batch sizes >= 1, got {list(buckets)}")
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        self.model = model
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.pad_eagerly = pad_eagerly
        self._buffers = _Buffers.allocate(self.buckets[-1], max_blocks_per_seq, model.device)
        # Rows [0, _rows) may hold a real request; in those rows, block-table columns from
        # _width on are 0. Every other row is a padding row. Lets a step reset only what the
        # previous step left behind.
        self._rows = 0
        self._width = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # On a CPU, each bucket's compiled step (shard/engine/cpu_graphs.py) instead of a graph.
        self._compiled: dict[int, Step] = {}
        # The thread compiling them after Warmup (shard/engine/background_compile.py), if any.
        self.compiling: threading.Thread | None = None
        self._outputs: dict[int, torch.Tensor] = {}
        self._captured_cache: KVCache | None = None
        # The model's LoRA rows holder (None: no adapted layer), bound to the adapters buffer.
        self._lora: RowAdapters | None = lora_rows_of(model)
        # Speculator heads' hidden-state tap (set before capture), and per bucket the hidden
        # states tensor its hook saw while capturing: each replay rewrites it.
        self.tap: HiddenTap | None = None
        self._hidden: dict[int, torch.Tensor] = {}

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs.keys() | self._compiled.keys()))

    def takes(self, inputs: ForwardInputs, kv_cache: KVCache) -> bool:
        """Whether `forward` runs this step through a graph (or its eager padding): a decode step
        (or a varlen step with logits at every token, one row per token) that fits a bucket and
        the block-table width, over the cache the graphs were captured on."""
        bucket = self._bucket(inputs)
        if bucket is None:
            return False
        return self.pad_eagerly or (kv_cache is self._captured_cache and (
            bucket in self._graphs or bucket in self._compiled))

    def _bucket(self, inputs: ForwardInputs) -> int | None:
        """The bucket of a step with logits at every token (a decode step, or a verification
        step as one row per token) that fits the buffers; None for anything else."""
        if inputs.lm_head_indices is not None:
            return None
        if inputs.meta.block_tables.shape[1] > self.max_blocks_per_seq:
            return None
        return bucket_for(self.buckets, _tokens(inputs))

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs, kv_cache: KVCache) -> torch.Tensor:
        """Float32 logits [tokens, vocab] of a decode (or verification) step, as Model.forward
        returns them.

        After a replay they are a view of the graph's output: valid until the next forward of
        this runner (consume or copy them first; work queued on the same stream is ordered).
        """
        meta = inputs.meta
        bucket = self._bucket(inputs)
        if bucket is None:
            with self._bound(inputs.adapters):
                return self.model.forward(
                    inputs.input_ids, inputs.positions, kv_cache, meta, inputs.lm_head_indices
                )
        n = _tokens(inputs)
        self._load(inputs)
        graph = self._graphs.get(bucket) if kv_cache is self._captured_cache else None
        step = self._compiled.get(bucket) if kv_cache is self._captured_cache else None
        if step is not None:
            return step(kv_cache, -(-meta.max_seqlen_k // self.block_size))[:n]
        if graph is not None:
            graph.replay()
            if self.tap is not None and bucket in self._hidden:
                self.tap.hidden = self._hidden[bucket]
                self.tap.slots = self._buffers.slot_mapping[:bucket]
            return self._outputs[bucket][:n]
        return self._run(bucket, kv_cache, meta.max_seqlen_k)[:n]

    def _load(self, inputs: ForwardInputs) -> None:
        """Copies the step's n tokens into rows [0, n) and leaves every later row a padding row:
        a decode step's requests as they are, a varlen step's tokens as one row each (its
        request's block table, its own context: `token_rows`).

        The one path by which inputs reach the buffers, for the eager run as for the replay.
        """
        b, meta = self._buffers, inputs.meta
        n, width = _tokens(inputs), meta.block_tables.shape[1]
        b.input_ids[:n].copy_(inputs.input_ids)
        b.positions[:n].copy_(inputs.positions)
        b.slot_mapping[:n].copy_(meta.slot_mapping)
        if n == meta.batch_size:
            b.seqlens_k[:n].copy_(meta.seqlens_k)
            b.block_tables[:n, :width].copy_(meta.block_tables)
        else:
            rows, seqlens = token_rows(meta, n)
            b.seqlens_k[:n].copy_(seqlens)
            b.block_tables[:n, :width].copy_(meta.block_tables.index_select(0, rows))
        if inputs.adapters is not None:
            b.adapters[:n].copy_(inputs.adapters)
        elif self._lora is not None:
            b.adapters[:n].zero_()
        if self._width > width:
            b.block_tables[:n, width : self._width].zero_()
        if self._rows > n:
            self._pad(n, self._rows)
        self._rows, self._width = n, width

    def _pad(self, start: int, stop: int) -> None:
        """Rows [start, stop) become padding: token 0 at position 0 of a one-token context whose
        K/V go to the scratch slot and whose block table is all block 0."""
        b = self._buffers
        b.input_ids[start:stop].zero_()
        b.positions[start:stop].zero_()
        b.slot_mapping[start:stop].fill_(SCRATCH_SLOT)
        b.seqlens_k[start:stop].fill_(1)
        b.block_tables[start:stop].zero_()
        b.adapters[start:stop].zero_()

    def _metadata(
        self, b: _Buffers, bucket: int, max_seqlen_k: int, compiled: bool
    ) -> AttentionMetadata:
        """A fresh metadata (backends cache per-forward plans in it) over the first rows."""
        return AttentionMetadata(
            is_prefill=False,
            cu_seqlens_q=b.cu_seqlens_q[: bucket + 1],
            seqlens_k=b.seqlens_k[:bucket],
            slot_mapping=b.slot_mapping[:bucket],
            block_tables=b.block_tables[:bucket],
            max_seqlen_q=1,
            max_seqlen_k=max_seqlen_k,
            block_size=self.block_size,
            compiled=compiled,
        )

    def _run(
        self, bucket: int, kv_cache: KVCache, max_seqlen_k: int, buffers: _Buffers | None = None,
        compiled: bool = False,
    ) -> torch.Tensor:
        """The bucket's forward over the buffers (eager, or being captured); a tap is armed
        with the buffers' slots (padding rows: the scratch slot, which no row looks up).
        `buffers`: others of the same shapes, which a compiled step is traced over (its
        inputs; shard/engine/cpu_graphs.py); `compiled`: the forward written for the compiler
        (AttentionMetadata.compiled)."""
        b = self._buffers if buffers is None else buffers
        meta = self._metadata(b, bucket, max_seqlen_k, compiled)
        ids, positions = b.input_ids[:bucket], b.positions[:bucket]
        if self.tap is not None:
            self.tap.arm(ForwardInputs(ids, positions, meta, None, ids))
        try:
            with self._bound(b.adapters[:bucket]):
                return self.model.forward(ids, positions, kv_cache, meta)
        finally:
            if self.tap is not None:
                self.tap.disarm()

    @contextmanager
    def _bound(self, adapters: torch.Tensor | None) -> Iterator[None]:
        """The LoRA rows bound to `adapters` around a forward (nothing without adapters)."""
        if self._lora is None:
            yield
            return
        self._lora.bind(adapters)
        try:
            yield
        finally:
            self._lora.clear()

    @torch.inference_mode()
    def capture(self, kv_cache: KVCache) -> None:
        """Captures every bucket's graph over `kv_cache`, largest first, in one memory pool.

        Graphs replay one at a time, so they share a pool: the largest capture's temporaries
        hold every smaller one's. Each capture follows an eager run of the same shapes on the
        capture stream, which compiles and tunes kernels and creates the stream's library
        handles outside the capture. Every rank must capture the same buckets in the same order
        (the tensor-parallel collectives are captured into the graphs).
        """
        device = self.model.device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}")
        self.release()
        self._pad(0, self.buckets[-1])
        self._rows, self._width = 0, 0
        static_max = self.max_blocks_per_seq * self.block_size
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        start = time.perf_counter()
        try:
            with torch.cuda.stream(stream):
                for bucket in reversed(self.buckets):
                    self._run(bucket, kv_cache, static_max)
                    graph = torch.cuda.CUDAGraph()
                    if self.tap is not None:
                        self.tap.hidden = None  # what the hook sees while capturing, only
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        output = self._run(bucket, kv_cache, static_max)
                    self._graphs[bucket] = graph
                    self._outputs[bucket] = output
                    if self.tap is not None and self.tap.hidden is not None:
                        self._hidden[bucket] = self.tap.hidden
        except BaseException:
            self.release()
            raise
        finally:
            torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self._captured_cache = kv_cache
        log.debug(
            "captured decode graphs %s in %.1f s", list(self.buckets), time.perf_counter() - start
        )

    def compile_bucket(self, bucket: int, kv_cache: KVCache) -> Step:
        """The bucket's compiled step over `kv_cache` (shard/engine/cpu_graphs.py), traced over
        buffers of its own, so that steps may run over the runner's meanwhile; NotCompilable
        when the model's decode forward reads a tensor back to the host, its compiled step
        differs from eager, or a hidden-state tap would need a Python hook.

        Unlike a CUDA graph, the step's context is not static: the block tables' width is the
        compiled step's free size, and each step attends the blocks its longest row covers
        (the eager forward's context), up to the buffers' width."""
        if self.tap is not None:
            raise NotCompilable("a speculator reads the hidden states of eager forwards")
        traced = _Buffers.allocate(self.buckets[-1], self.max_blocks_per_seq, self.model.device)
        # Traced as written for the compiler, checked against the plain forward.
        step = compile_step(self.traced_forward(bucket, True), kv_cache, _fields(traced),
                            FreeSize(_TABLES, dim=1), eager=self.traced_forward(bucket, False))
        live = _fields(self._buffers)
        return lambda cache, blocks: step(cache, live, blocks)

    def traced_forward(self, bucket: int, compiled: bool) -> Callable[..., torch.Tensor]:
        """The bucket's forward as cpu_graphs traces it: over a cache and the buffers' tensors
        (in field order), attending the block tables' width; `compiled`: written for the
        compiler (AttentionMetadata.compiled)."""

        def run(cache: KVCache, *tensors: torch.Tensor) -> torch.Tensor:
            buffers = _Buffers(*tensors)
            return self._run(bucket, cache, buffers.block_tables.shape[1] * self.block_size,
                             buffers, compiled)

        return run

    def add_compiled(self, bucket: int, step: Step) -> None:
        """Decode steps of `bucket` run `step` from now on (over the cache `expect_compiled`
        named: a step is bound to the cache it was compiled over)."""
        self._compiled[bucket] = step

    def expect_compiled(self, kv_cache: KVCache) -> None:
        """Steps will be compiled over `kv_cache` (in the background): until each bucket's is
        added, its steps run eagerly."""
        self.release()
        self._captured_cache = kv_cache

    def expects(self, kv_cache: KVCache) -> bool:
        """Whether steps compiled over `kv_cache` are still wanted (not released since)."""
        return self._captured_cache is kv_cache

    def release(self) -> None:
        """Drops the graphs and their outputs, so that their memory pool can be freed."""
        self._compiled = {}
        self._graphs.clear()
        self._outputs.clear()
        self._hidden.clear()
        self._captured_cache = None


# The block tables' index among the buffers' fields: a compiled step's free size.
_TABLES = [f.name for f in fields(_Buffers)].index("block_tables")


def _fields(buffers: _Buffers) -> tuple[torch.Tensor, ...]:
    """The buffers' tensors themselves, in field order (dataclasses.astuple would copy them)."""
    return tuple(getattr(buffers, f.name) for f in fields(_Buffers))


def _tokens(inputs: ForwardInputs) -> int:
    """The step's flat tokens: its rows in the buffers (a decode step: one per request)."""
    return int(inputs.input_ids.shape[0])
