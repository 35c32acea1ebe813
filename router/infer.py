"""Admission and lifecycle of the inference loop: what the HTTP layer calls.

`Infer.start()` learns the shards' capacity (Info, ClearCache, Warmup), sizes the budgets and the
block allocator, and starts the batching task. `submit()` admits a validated request at once or
refuses it (TGI: a request that cannot take a permit immediately gets 429).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from itertools import count

from opentelemetry import trace

from pytgi_proto import generate_pb2

from .batch_state import request_pb
from .block_allocator import BlockAllocator
from .client import ShardClient
from .errors import (
    IncompleteGenerationError,
    OverloadedError,
    UnhealthyError,
    ValidationError,
)
from .metrics import Metrics
from .queue import Entry, Queue
from .request import ValidRequest
from .request_stream import RequestStream
from .scheduler import Budgets, Scheduler

logger = logging.getLogger(__name__)


@dataclass
class InferSettings:
    max_concurrent_requests: int = 128
    max_batch_prefill_tokens: int = 4096
    max_batch_total_tokens: int | None = None  # None → from the shard's Warmup
    max_batch_size: int | None = None
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    max_input_tokens: int | None = None  # None → from Warmup
    max_total_tokens: int | None = None  # None → from Warmup
    # Bound on waiting requests; None → 2 x max_concurrent_requests (overflow → OverloadedError).
    max_queue_size: int | None = None
    # health(): a batch that succeeded this recently proves the shards; else a Health RPC with
    # this timeout.
    health_recent_s: float = 5.0
    health_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        problems = [
            f"`{name}` must be >= {low}, got {value}"
            for name, value, low in (
                ("max_concurrent_requests", self.max_concurrent_requests, 1),
                ("max_batch_prefill_tokens", self.max_batch_prefill_tokens, 1),
                ("max_batch_total_tokens", self.max_batch_total_tokens, 1),
                ("max_batch_size", self.max_batch_size, 1),
                ("waiting_served_ratio", self.waiting_served_ratio, 0),
                ("max_waiting_tokens", self.max_waiting_tokens, 0),
                ("max_input_tokens", self.max_input_tokens, 1),
                ("max_total_tokens", self.max_total_tokens, 2),
                ("max_queue_size", self.max_queue_size, 1),
            )
            if value is not None and value < low
        ]
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class ShardInfo:
    """What /info and validation need, filled at start()."""

    model_type: str
    dtype: str
    device_type: str
    block_size: int
    world_size: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_total_tokens: int
    max_batch_prefill_tokens: int
    num_blocks: int
    attention_impl: str
    window_size: int | None


class InferStartError(RuntimeError):
    """The settings and the shards' capacity are incompatible; the message says which flag."""


def _warmup_request(settings: InferSettings) -> generate_pb2.WarmupRequest:
    return generate_pb2.WarmupRequest(
        max_prefill_tokens=settings.max_batch_prefill_tokens,
        max_input_tokens=settings.max_input_tokens or 0,
        max_total_tokens=settings.max_total_tokens or 0,
        max_batch_size=settings.max_batch_size or 0,
        max_batch_total_tokens=settings.max_batch_total_tokens or 0,
    )


def derive_info(
    settings: InferSettings,
    info: generate_pb2.InfoResponse,
    warmup: generate_pb2.WarmupResponse,
    world_size: int,
) -> ShardInfo:
    """Final limits from the settings and the shards' answers, checked like TGI's router."""
    block_size = warmup.block_size or info.block_size
    if block_size < 1:
        raise InferStartError("the shards reported no KV block size")
    supported = warmup.max_supported_total_tokens
    num_blocks = warmup.num_blocks or supported // block_size + 1
    if num_blocks < 2:
        raise InferStartError(f"the shards' KV cache holds no usable block ({num_blocks})")
    capacity = (num_blocks - 1) * block_size
    max_batch_total = capacity
    if settings.max_batch_total_tokens is not None:
        if settings.max_batch_total_tokens > capacity:
            logger.warning("--max-batch-total-tokens=%d exceeds the KV cache (%d tokens): using %d",
                           settings.max_batch_total_tokens, capacity, capacity)
        max_batch_total = min(settings.max_batch_total_tokens, capacity)
    max_total = settings.max_total_tokens or warmup.max_total_tokens
    max_input = settings.max_input_tokens or warmup.max_input_tokens
    prefill = settings.max_batch_prefill_tokens
    if prefill > max_batch_total:
        # Harmless but meaningless: no prefill can hold more than the KV cache.
        logger.warning("--max-batch-prefill-tokens=%d exceeds the KV budget: using %d",
                       prefill, max_batch_total)
        prefill = max_batch_total
    # Defaults must not make a full-length request unschedulable; explicit values are checked.
    if settings.max_total_tokens is None:
        max_total = min(max_total, max_batch_total)
    if settings.max_input_tokens is None:
        max_input = min(max_input, prefill, max_total - 1)
    _check_limits(max_input, max_total, prefill, max_batch_total)
    return ShardInfo(
        model_type=info.model_type,
        dtype=info.dtype,
        device_type=info.device_type,
        block_size=block_size,
        world_size=info.world_size or world_size,
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_batch_total_tokens=max_batch_total,
        max_batch_prefill_tokens=prefill,
        num_blocks=num_blocks,
        attention_impl=info.attention_impl,
        window_size=info.window_size if info.HasField("window_size") else None,
    )


def _check_limits(max_input: int, max_total: int, prefill: int, max_batch_total: int) -> None:
    if prefill < 1:
        raise InferStartError(f"`max_batch_prefill_tokens` must be >= 1, got {prefill}")
    if max_input < 1 or max_input >= max_total:
        raise InferStartError(f"`max_input_tokens` ({max_input}) must be >= 1 and < "
                              f"`max_total_tokens` ({max_total})")
    if max_total > max_batch_total:
        raise InferStartError(f"Not enough memory to handle max_total_tokens={max_total}: the KV "
                              f"cache holds {max_batch_total} tokens (`max_batch_total_tokens`)")
    if max_input > prefill:
        raise InferStartError(f"`max_batch_prefill_tokens` ({prefill}) must be >= "
                              f"`max_input_tokens` ({max_input})")


class Infer:
    def __init__(self, client: ShardClient, settings: InferSettings, metrics: Metrics) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self._info: ShardInfo | None = None
        self._scheduler: Scheduler | None = None
        self._task: asyncio.Task[None] | None = None
        self._ids = count()
        self._in_flight = 0
        self._max_queue = settings.max_queue_size or 2 * settings.max_concurrent_requests
        self._stopping = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> ShardInfo:
        """Info, ClearCache, Warmup; sizes budgets and allocator; starts the batching task."""
        shard_info = await self.client.info()
        await self.client.clear_cache(None)
        warmup = await self.client.warmup(_warmup_request(self.settings))
        info = derive_info(self.settings, shard_info, warmup, self.client.world_size)
        allocator = BlockAllocator(
            info.num_blocks, info.block_size, info.max_batch_total_tokens // info.block_size
        )
        budgets = Budgets(
            max_batch_prefill_tokens=info.max_batch_prefill_tokens,
            max_batch_total_tokens=info.max_batch_total_tokens,
            max_batch_size=self.settings.max_batch_size,
            waiting_served_ratio=self.settings.waiting_served_ratio,
            max_waiting_tokens=self.settings.max_waiting_tokens,
        )
        self._scheduler = Scheduler(self.client, Queue(allocator), budgets, self.metrics,
                                    self._release)
        self._info = info
        self.metrics.batch_max_total_tokens.set(info.max_batch_total_tokens)
        self.metrics.kv_blocks_total.set(allocator.total)
        self.metrics.kv_blocks_free.set(allocator.free_count)
        self._task = asyncio.get_running_loop().create_task(
            self._scheduler.run(), name="pytgi-batching"
        )
        logger.info("inference ready: %s", info)
        return info

    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Refuses new requests, waits up to `drain_timeout` s for in-flight ones, then stops
        the batching task; whatever is still in flight ends with IncompleteGenerationError."""
        self._stopping = True
        if drain_timeout > 0 and self._in_flight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain_timeout)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        scheduler = self._scheduler
        if scheduler is not None:
            for entry in scheduler.queue.drain():
                entry.stream.fail(IncompleteGenerationError())
                self._release(entry)
            scheduler.running.fail_all(IncompleteGenerationError())
            self.metrics.queue_size.set(0)

    def submit(self, request: ValidRequest) -> RequestStream:
        """Admits `request` or raises: OverloadedError (429) when every permit is taken or the
        queue is full, UnhealthyError (503) when stopping, ValidationError (422) for a request
        these shards could never schedule."""
        scheduler = self._scheduler
        if self._stopping or scheduler is None:
            raise UnhealthyError("the server is not running")
        if self._in_flight >= self.settings.max_concurrent_requests:
            raise OverloadedError()
        if len(scheduler.queue) >= self._max_queue:
            raise OverloadedError()
        self._check_schedulable(request)
        entry_id = next(self._ids)
        try:
            pb = request_pb(entry_id, request)
        except (ValueError, TypeError) as err:
            raise ValidationError(str(err)) from err
        stream = RequestStream(lambda _: self._cancel(entry))
        entry = Entry(entry_id, request, stream, pb)
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            entry.trace_context = span_context
        self._in_flight += 1
        self._idle.clear()
        scheduler.queue.append(entry)
        self.metrics.queue_size.set(len(scheduler.queue))
        scheduler.notify()
        return stream

    def _check_schedulable(self, request: ValidRequest) -> None:
        """Defence in depth behind validation: a request no batch could ever hold would block
        the FIFO queue forever."""
        info = self.info
        prompt = len(request.input_ids)
        if prompt == 0:
            raise ValidationError("`inputs` cannot be empty")
        if request.stopping.max_new_tokens < 1:
            raise ValidationError("`max_new_tokens` must be strictly positive")
        if prompt > info.max_batch_prefill_tokens:
            raise ValidationError(f"`inputs` must have less than "
                                  f"{info.max_batch_prefill_tokens} tokens. Given: {prompt}")
        total = prompt + request.stopping.max_new_tokens
        if total > info.max_batch_total_tokens:
            raise ValidationError(f"`inputs` tokens + `max_new_tokens` must be <= "
                                  f"{info.max_batch_total_tokens}. Given: {prompt} `inputs` "
                                  f"tokens and {request.stopping.max_new_tokens} "
                                  f"`max_new_tokens`")

    def _cancel(self, entry: Entry) -> None:
        self._release(entry)
        if self._scheduler is not None:
            self._scheduler.cancel(entry.id)

    def _release(self, entry: Entry) -> None:
        """Gives back the entry's permit, once, whichever of finish/fail/cancel comes first."""
        if not entry.holds_permit:
            return
        entry.holds_permit = False
        entry.stream.detach()
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def health(self) -> bool:
        """True if a batch succeeded recently; otherwise asks the shards (Health RPC)."""
        scheduler = self._scheduler
        if scheduler is None or self._stopping:
            return False
        recent = time.monotonic() - scheduler.last_success < self.settings.health_recent_s
        if scheduler.healthy and recent:
            return True
        try:
            await asyncio.wait_for(self.client.health(), self.settings.health_timeout_s)
        except Exception as err:  # ShardError or timeout: either way not healthy
            logger.warning("shard health check failed: %s", err)
            scheduler.healthy = False
            return False
        scheduler.healthy = True
        return True

    @property
    def info(self) -> ShardInfo:
        if self._info is None:
            raise RuntimeError("Infer.start() has not run")
        return self._info

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queue_size(self) -> int:
        return len(self._scheduler.queue) if self._scheduler is not None else 0

    @property
    def kv_blocks_free(self) -> int:
        """Free KV blocks (block 0 excluded); equals kv_blocks_total when nothing runs."""
        return self._scheduler.allocator.free_count if self._scheduler is not None else 0

    @property
    def kv_blocks_total(self) -> int:
        return self._scheduler.allocator.total if self._scheduler is not None else 0
