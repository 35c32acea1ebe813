"""The batching task: continuous batching under token budgets, as TGI's `batching_task`.

One asyncio task owns the queue's admission, the running batch and every Prefill/Decode call.
It waits for work, prefills a new batch, then decodes it step after step; between steps it may
admit waiting requests, prefilled onto the running batch (the shards concatenate), when enough are
waiting (`waiting_served_ratio`) or they have waited long enough (`max_waiting_tokens` steps).
The decisions are pure functions below, unit-tested without any shard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.trace import Link

from pytgi_proto import contracts as c
from pytgi_proto import generate_pb2
from pytgi_router.core.batch_state import RunningBatch, build_batch
from pytgi_router.core.capacity import ShardInfo
from pytgi_router.core.errors import GenerationError
from pytgi_router.core.infer_settings import InferSettings
from pytgi_router.core.queue import Queue
from pytgi_router.core.request import Entry
from pytgi_router.core.shard_client import ShardCallError, ShardClient
from pytgi_router.metrics import Metrics

logger = logging.getLogger(__name__)

# Best-effort cleanup after a failure must not hang the loop on a wedged shard.
CLEAR_CACHE_TIMEOUT_S = 5.0
UNEXPECTED_ERROR_PAUSE_S = 0.1

StepResponse = generate_pb2.PrefillResponse | generate_pb2.DecodeResponse


@dataclass(frozen=True, slots=True)
class Budgets:
    """The scheduler's limits, fixed at startup from the settings and the shards' Warmup."""

    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int | None = None
    waiting_served_ratio: float = c.WAITING_SERVED_RATIO
    max_waiting_tokens: int = c.MAX_WAITING_TOKENS

    @classmethod
    def of(cls, settings: InferSettings, served: ShardInfo) -> Budgets:
        """The budgets for the limits served (the KV and prefill budgets as the shards' Warmup
        fixed them) under the settings' batching knobs."""
        return cls(
            max_batch_prefill_tokens=served.max_batch_prefill_tokens,
            max_batch_total_tokens=served.max_batch_total_tokens,
            max_batch_size=settings.max_batch_size,
            waiting_served_ratio=settings.waiting_served_ratio,
            max_waiting_tokens=settings.max_waiting_tokens,
        )


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """Arguments of `Queue.next_batch` for one admission attempt."""

    min_size: int | None
    max_size: int | None
    prefill_token_budget: int
    token_budget: int


def new_batch_limits(budgets: Budgets) -> BatchLimits:
    """Nothing is running: take as much as the budgets allow."""
    return BatchLimits(
        None, budgets.max_batch_size, budgets.max_batch_prefill_tokens,
        budgets.max_batch_total_tokens,
    )


def extension_limits(
    budgets: Budgets, running_size: int, running_tokens: int, waiting_steps: int
) -> BatchLimits:
    """Limits for requests joining a running batch of `running_size` requests holding
    `running_tokens` KV tokens, `waiting_steps` decode steps after the last admission.

    Pausing the running requests for a prefill is worth it only for enough newcomers
    (running_size x waiting_served_ratio) unless they have waited max_waiting_tokens steps.
    """
    min_size: int | None = None
    if waiting_steps < budgets.max_waiting_tokens:
        min_size = int(running_size * budgets.waiting_served_ratio)
    max_size = None
    if budgets.max_batch_size is not None:
        max_size = max(0, budgets.max_batch_size - running_size)
    token_budget = budgets.max_batch_total_tokens - running_tokens
    return BatchLimits(min_size, max_size, budgets.max_batch_prefill_tokens, token_budget)


class _MethodMetrics:
    """One method's labelled children, resolved once: `.labels()` costs a locked dict lookup,
    too much for every decode step."""

    def __init__(self, metrics: Metrics, method: str) -> None:
        self.count = metrics.batch_inference_count.labels(method=method)
        self.success = metrics.batch_inference_success.labels(method=method)
        self.failure = metrics.batch_inference_failure.labels(method=method)
        self.duration = metrics.batch_inference_duration.labels(method=method)
        self.forward = metrics.batch_forward_duration.labels(method=method)
        self.decode = metrics.batch_decode_duration.labels(method=method)
        self.filter = metrics.batch_filter_duration.labels(method=method)
        # TGI labels every concatenation "decode".
        self.concat = metrics.batch_concat_duration.labels(method="decode")


def refused_as_invalid(err: Exception) -> bool:
    """Whether a shard call failed because a shard answered INVALID_ARGUMENT (the request, not
    the shard, is at fault)."""
    cause = err.__cause__
    return (isinstance(err, ShardCallError) and isinstance(cause, grpc.aio.AioRpcError)
            and cause.code() == grpc.StatusCode.INVALID_ARGUMENT)


def concat_reason(limits: BatchLimits) -> str:
    """The `reason` label of tgi_batch_concat for a batch admitted under `limits`."""
    return "backpressure" if limits.min_size is not None else "wait_exceeded"


class Scheduler:
    def __init__(
        self,
        client: ShardClient,
        queue: Queue,
        budgets: Budgets,
        metrics: Metrics,
        release: Callable[[Entry], None],
        step_timeout_s: float | None = None,
    ) -> None:
        self.client = client
        # Deadline of every shard call: a wedged shard fails its batch instead of hanging it.
        self.step_timeout_s = step_timeout_s
        self.queue = queue
        self.budgets = budgets
        self.metrics = metrics
        self.running = RunningBatch(queue.allocator, release)
        self.allocator = queue.allocator
        # False after a failed batch, True again after a successful one (or a passing Health).
        self.healthy = True
        # A failed batch whose ClearCache failed too: the shards may still hold its state, so
        # only a reconnection (ClearCache + Warmup) makes them trustworthy again.
        self.cache_unknown = False
        self.last_success = 0.0
        # time.monotonic() of the last failed batch: a Health answer from before it is stale.
        self.last_failure = 0.0
        # time.monotonic() when the shard call in progress began; None between calls.
        self.step_started: float | None = None
        self._work = asyncio.Event()
        self._next_batch_id = 0
        self._tracer = trace.get_tracer(__name__)
        self._method_metrics = {m: _MethodMetrics(metrics, m) for m in ("prefill", "decode")}

    def notify(self) -> None:
        """Work arrived (a submit)."""
        self._work.set()

    def cancel(self, entry_id: int) -> None:
        """A client cancelled: out of the queue now, or out of the running batch after this
        step (its blocks are still in the shards' batch until then)."""
        if self.queue.remove(entry_id) is not None:
            self.metrics.queue_size.set(len(self.queue))
        else:
            self.running.mark_cancelled(entry_id)

    async def run(self) -> None:
        """The loop. Never returns; cancelled by Infer.stop(). A bug fails the running batch
        instead of killing the task: a dead task would leave every later request hanging."""
        while True:
            try:
                await self._serve()
            except Exception as err:
                await self._fail_running(err)
                # Retry the queue after a pause, in case the bug hit admission itself.
                await asyncio.sleep(UNEXPECTED_ERROR_PAUSE_S)
                self._work.set()

    async def _serve(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while (entries := self._admit(new_batch_limits(self.budgets))) is not None:
                await self._prefill(entries)
                waiting_steps = 1
                while self.running.cached is not None:
                    limits = extension_limits(
                        self.budgets, len(self.running), self.running.reserved_tokens,
                        waiting_steps,
                    )
                    if (entries := self._admit(limits)) is not None:
                        self.metrics.batch_concat.labels(reason=concat_reason(limits)).inc()
                        await self._prefill(entries)
                        waiting_steps = 1
                    if self.running.cached is not None:
                        await self._decode()
                        waiting_steps += 1
                self._publish_batch_gauges()

    def _admit(self, limits: BatchLimits) -> list[Entry] | None:
        entries = self.queue.next_batch(
            limits.min_size, limits.max_size, limits.prefill_token_budget, limits.token_budget
        )
        if entries is not None:
            self.metrics.batch_next_size.observe(len(entries))
            self.metrics.queue_size.set(len(self.queue))
        return entries

    async def _prefill(self, entries: list[Entry]) -> None:
        """Prefills `entries` as a new batch, concatenated onto the running one if any."""
        # From here on a failure fails the newcomers with the running requests, and frees
        # their blocks.
        self.running.add(entries)
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        batch = build_batch(batch_id, entries, self.allocator.block_size)
        now = time.monotonic()
        for entry in entries:
            entry.started_at = now
        cached = self.running.cached
        # TGI's shape: a batch span links to the request spans it serves (follows-from).
        links = [Link(e.trace_context) for e in entries if e.trace_context is not None]
        timeout = self.step_timeout_s
        await self._step(
            "prefill", lambda: self.client.prefill(batch, cached, timeout), len(entries), links,
            entries,
        )

    async def _decode(self) -> None:
        cached = self.running.cached
        assert cached is not None
        timeout = self.step_timeout_s
        await self._step(
            "decode", lambda: self.client.decode([cached], timeout), len(self.running)
        )

    async def _step(
        self,
        method: str,
        call: Callable[[], Awaitable[StepResponse]],
        size: int,
        links: list[Link] | None = None,
        newcomers: list[Entry] | None = None,
    ) -> None:
        """One shard call, then routing its generations and filtering the batch. A prefill of
        `newcomers` that the shards refuse as invalid fails only them."""
        metrics = self._method_metrics[method]
        metrics.count.inc()
        start = time.perf_counter()
        self.step_started = time.monotonic()
        try:
            with self._tracer.start_as_current_span(
                method, links=links, attributes={"batch_size": size}
            ):
                response = await call()
        except Exception as err:  # ShardCallError, or a bug: either way this batch is lost
            self.step_started = None
            metrics.failure.inc()
            if newcomers is not None and refused_as_invalid(err):
                self._refuse(newcomers, err)
                return
            await self._fail_running(err)
            return
        # (A cancelled task leaves it set: Infer then discards this scheduler.)
        self.step_started = None
        end = time.perf_counter()
        metrics.success.inc()
        metrics.duration.observe(end - start)
        metrics.forward.observe(response.forward_ns / 1e9)
        metrics.decode.observe(response.decode_ns / 1e9)
        if response.HasField("concat_ns"):
            metrics.concat.observe(response.concat_ns / 1e9)
        self.healthy = True
        self.last_success = time.monotonic()
        try:
            cached = response.batch if response.HasField("batch") else None
            kept = self.running.apply_step(response.generations, cached)
            if kept is not None:
                await self._filter(kept)
        except Exception as err:
            await self._fail_running(err)
            return
        metrics.filter.observe(time.perf_counter() - end)
        self._publish_batch_gauges()

    async def _filter(self, kept: list[int]) -> None:
        cached = self.running.cached
        assert cached is not None
        if kept:
            filtered = await self.client.filter_batch(cached.id, kept, self.step_timeout_s)
            if filtered is None:
                self.running.drop_batch()
            else:
                self.running.cached = filtered
        else:
            await self.client.clear_cache(cached.id, self.step_timeout_s)
            self.running.cached = None

    def _refuse(self, newcomers: list[Entry], err: Exception) -> None:
        """The shards validate a new batch before touching the cached one, so an
        INVALID_ARGUMENT leaves it intact: only the newcomers fail, the running requests keep
        decoding. (Should a shard have dropped the cached batch after all, the next Decode
        answers NOT_FOUND and the batch fails as any lost batch does.)"""
        logger.warning("prefill of %d new request(s) refused by the shards: %s",
                       len(newcomers), err)
        self.running.fail_entries(newcomers, GenerationError(str(err)))
        self._publish_batch_gauges()

    async def _fail_running(self, err: Exception) -> None:
        """Fails every request of the running batch, frees their blocks, clears the shards."""
        if isinstance(err, ShardCallError):
            logger.error("batch failed: %s", err)
            reason = str(err)
        else:
            logger.exception("batch failed on an unexpected error", exc_info=err)
            reason = f"{type(err).__name__}: {err}"
        self.healthy = False
        self.last_failure = time.monotonic()
        self.running.fail_all(GenerationError(reason))
        self._publish_batch_gauges()
        try:
            await self.client.clear_cache(None, CLEAR_CACHE_TIMEOUT_S)
        except Exception as clear_err:  # the shard may be gone or wedged: the watchdog's turn
            logger.warning("ClearCache after a failed batch failed: %s", clear_err)
            self.cache_unknown = True

    def _publish_batch_gauges(self) -> None:
        metrics = self.metrics
        metrics.batch_current_size.set(len(self.running))
        metrics.batch_current_max_tokens.set(self.running.reserved_tokens)
        metrics.kv_blocks_free.set(self.allocator.free_count)
        metrics.queue_size.set(len(self.queue))
