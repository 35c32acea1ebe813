"""The batching task: continuous batching with chunked prefill, prefix caching and KV allocated
on demand (TGI v3's scheduler, with the block bookkeeping in the router).

One asyncio task owns the queue, the live entries and every shard call. Each step it plans
(`step_plan.plan_step`: grow the running sequences' blocks, preempting the newest when the pool
is short; continue prompts mid-prefill; admit newcomers), filters preempted requests out of the
shards' batch, then makes ONE call: a Prefill when any chunk is to be computed (the running
batch's decode rows ride in the same forward), a Decode otherwise: of up to --max-decode-steps
steps when nothing can join, leave or change between them (multi-step decode,
router/core/decode_steps.py), cut short when a newcomer arrives during it
(router/core/call_cutter.py). The decisions are pure functions of `step_plan` and
`decode_steps`, unit-tested without any shard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from opentelemetry import trace
from opentelemetry.trace import Link

from pytgi_proto import generate_pb2
from pytgi_router.core.batch_wire import build_batch
from pytgi_router.core.call_cutter import CallCutter
from pytgi_router.core.decode_steps import StepTime, grow_for_steps, steps_in_time, steps_wanted
from pytgi_router.core.errors import GenerationError
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.queue import Queue
from pytgi_router.core.request import Entry
from pytgi_router.core.running_batch import RunningBatch
from pytgi_router.core.shard_client import ShardCallError, ShardClient
from pytgi_router.core.speculation_stats import SpeculationStats
from pytgi_router.core.step_plan import (
    Budgets,
    StepPlan,
    admission_open,
    concat_reason,
    plan_step,
)
from pytgi_router.metrics import Metrics

logger = logging.getLogger(__name__)

# Best-effort cleanup after a failure must not hang the loop on a wedged shard.
CLEAR_CACHE_TIMEOUT_S = 5.0
UNEXPECTED_ERROR_PAUSE_S = 0.1

StepResponse = generate_pb2.PrefillResponse | generate_pb2.DecodeResponse


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


class Scheduler:
    def __init__(
        self,
        client: ShardClient,
        queue: Queue,
        cache: PrefixCache,
        budgets: Budgets,
        metrics: Metrics,
        release: Callable[[Entry], None],
        step_timeout_s: float | None = None,
    ) -> None:
        self.client = client
        # Deadline of every shard call: a wedged shard fails its batch instead of hanging it.
        self.step_timeout_s = step_timeout_s
        self.queue = queue
        self.cache = cache
        self.budgets = budgets
        self.metrics = metrics
        self.running = RunningBatch(cache, release)
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
        self._next_order = 0
        # Steps since newcomers last joined (the admission rule of shards without chunking).
        self._steps_since_admission = 0
        # Prompt tokens admitted and how many of them came from the prefix cache, since start.
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._speculation = SpeculationStats(metrics)
        self._tracer = trace.get_tracer(__name__)
        self._method_metrics = {m: _MethodMetrics(metrics, m) for m in ("prefill", "decode")}
        # The multi-step Decode call in flight, cut short for a newcomer.
        self._cutter = CallCutter(client, budgets)
        # Steps the last Decode answer ran, and whether it left a batch.
        self._decoded: tuple[int, bool] = (1, False)
        # The last Decode call's time per step, for the next call's steps (steps_in_time).
        self._step_time: StepTime | None = None

    def notify(self) -> None:
        """Work arrived (a submit): a multi-step Decode call in flight stops after its current
        step if the newcomer may join."""
        self._work.set()
        self._cutter.newcomer(len(self.running), len(self.queue))

    def cancel(self, entry_id: int) -> None:
        """A client cancelled: out of the queue now, or out of the live set after this step
        (its blocks may still be written by the step in flight until then; a multi-step call
        in flight is cut short after it)."""
        if self.queue.remove(entry_id) is not None:
            self.metrics.queue_size.set(len(self.queue))
        else:
            self.running.mark_cancelled(entry_id)
            self._cutter.cancelled()

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
            while await self._step():
                pass
            self._publish_batch_gauges()

    async def _step(self) -> bool:
        """Plans and runs one step; False when there was nothing to do (nothing live, nothing
        admissible)."""
        running = self.running
        running.drop_cancelled_prefills()
        admit = admission_open(
            self.budgets, len(running), len(self.queue), self._steps_since_admission
        )
        plan = plan_step(
            self.cache, self.budgets, running.entries.values(), running.prefilling.values(),
            self.queue, admit,
        )
        if plan.preempted:
            await self._preempt(plan)
        self._take_newcomers(plan)
        steps = 1
        if not plan.chunks and running.cached is not None:
            steps = self._decode_steps(plan, admit)
        grants = [generate_pb2.BlockGrant(request_id=e.id, blocks=blocks)
                  for e, blocks in plan.grants]
        cached = running.cached
        timeout = self.step_timeout_s
        if plan.chunks:
            running.start(plan.chunks)
            batch = build_batch(self._next_batch_id, plan.chunks, self.cache)
            self._next_batch_id += 1
            # TGI's shape: a batch span links to the request spans it serves (follows-from).
            links = [Link(e.trace_context) for e in plan.newcomers if e.trace_context is not None]
            done = await self._call(
                "prefill", lambda: self.client.prefill(batch, cached, timeout, grants),
                len(running), links, [chunk.entry for chunk in plan.chunks],
            )
            if done:
                running.chunks_written(plan.chunks)
        elif cached is not None:
            if timeout is not None:
                timeout *= steps
            # The count admission_open saw when planning, before this call's steps were added.
            call_id = self._cutter.open(steps, self._steps_since_admission - steps)
            done = await self._call(
                "decode", lambda: self.client.decode([cached], timeout, grants, steps, call_id),
                len(running),
            )
            if done and steps > 1:
                self._steps_cut(steps)
        else:
            return bool(plan.preempted)
        if done:
            for entry, blocks in plan.grants:
                entry.blocks_sent += len(blocks)
            for chunk in plan.chunks:
                if chunk.completes:
                    chunk.entry.blocks_sent = chunk.entry.blocks_held
        return True

    def _decode_steps(self, plan: StepPlan, admit: bool) -> int:
        """The steps of this Decode call (router/core/decode_steps.py); when more than one, the
        running rows' blocks cover them all (the plan's grants then carry the growth)."""
        running = self.running
        budgets = self.budgets
        wanted = steps_wanted(
            budgets, plan, len(running.prefilling), len(self.queue), admit,
            self._steps_since_admission, running.cancelling,
        )
        wanted = steps_in_time(wanted, budgets.max_decode_call_ms, self._step_time, len(running))
        if wanted <= 1:
            return 1
        steps, grants = grow_for_steps(self.cache, running.entries.values(), wanted)
        if grants is not None:
            plan.grants = grants
        # The admission rule of shards without chunking counts steps, not calls.
        self._steps_since_admission += steps - 1
        return steps

    def _steps_cut(self, asked: int) -> None:
        """After a call of `asked` steps: steps it did not run leave the admission count (it
        counts steps run); one stopped with a batch left was cut short for a newcomer."""
        ran, batch_left = self._decoded
        if ran < asked:
            self._steps_since_admission -= asked - ran
            if batch_left:
                self.metrics.decode_cut_short.inc()

    def _take_newcomers(self, plan: StepPlan) -> None:
        """Moves the plan's newcomers out of the queue (cancelled ones it met leave too)."""
        queue = self.queue
        for entry in plan.cancelled:
            queue.remove(entry.id)
        if not plan.newcomers:
            if self.running.cached is not None:
                self._steps_since_admission += 1
            return
        metrics = self.metrics
        if self.running.cached is not None:
            reason = concat_reason(self.budgets, self._steps_since_admission)
            metrics.batch_concat.labels(reason=reason).inc()
        self._steps_since_admission = 0
        metrics.batch_next_size.observe(len(plan.newcomers))
        now = time.monotonic()
        first = {chunk.entry.id: chunk.cache_len for chunk in plan.chunks}
        for entry in plan.newcomers:
            queue.remove(entry.id)
            if entry.order is None:
                # First admission: its prompt counts for the prefix cache's hit ratio.
                entry.order = self._next_order
                self._next_order += 1
                entry.started_at = now
                cached_tokens = first[entry.id]
                metrics.request_cached_tokens.observe(cached_tokens)
                self._cached_tokens += cached_tokens
                self._prompt_tokens += len(entry.request.input_ids)
        if self._prompt_tokens:
            metrics.prefix_cache_hit_ratio.set(self._cached_tokens / self._prompt_tokens)
        metrics.queue_size.set(len(queue))
        # Their blocks are held from now, not from the step's answer (a long prefill): the
        # gateway's picker reads the usage between steps.
        metrics.kv_free(self.cache.free_count)

    async def _preempt(self, plan: StepPlan) -> None:
        """The planner released the victims' blocks: take them out of the live set and the
        shards' batch, and queue them again at the head, oldest first. A cancelled victim just
        leaves."""
        running = self.running
        in_batch = [e for e in plan.preempted if e.id in running.entries]
        self.metrics.preemptions.inc(len(plan.preempted))
        logger.info("KV blocks short: preempting %d request(s) %s", len(plan.preempted),
                    [e.id for e in plan.preempted])
        for entry in plan.preempted:  # newest first: each goes in front of the previous
            if running.preempt(entry):
                self.queue.push_front(entry)
        if in_batch and running.cached is not None:
            await self._filter(list(running.entries))

    async def _call(
        self,
        method: str,
        call: Callable[[], Awaitable[StepResponse]],
        size: int,
        links: list[Link] | None = None,
        chunks: list[Entry] | None = None,
    ) -> bool:
        """One shard call, then routing its generations and filtering the batch; True when it
        succeeded. A prefill the shards refuse as invalid fails only the chunks' requests."""
        metrics = self._method_metrics[method]
        metrics.count.inc()
        start = time.perf_counter()
        self.step_started = time.monotonic()
        try:
            with self._tracer.start_as_current_span(
                method, links=links, attributes={"batch_size": size}
            ):
                response = await call()
        except Exception as err:  # ShardCallError, or a bug: either way this step is lost
            self.step_started = None
            self._cutter.close()
            metrics.failure.inc()
            if chunks is not None and refused_as_invalid(err):
                self._refuse(chunks, err)
                return False
            await self._fail_running(err)
            return False
        # (A cancelled task leaves it set: Infer then discards this scheduler.)
        self.step_started = None
        self._cutter.close()
        end = time.perf_counter()
        metrics.success.inc()
        metrics.duration.observe(end - start)
        metrics.forward.observe(response.forward_ns / 1e9)
        metrics.decode.observe(response.decode_ns / 1e9)
        if response.HasField("concat_ns"):
            metrics.concat.observe(response.concat_ns / 1e9)
        if isinstance(response, generate_pb2.DecodeResponse):
            self._speculation.observe(response)
            ran = len(response.step_sizes) or 1
            self.metrics.decode_steps.inc(ran)
            self._decoded = (ran, response.HasField("batch"))
            self._step_time = StepTime((end - start) / ran, size)
        self.healthy = True
        self.last_success = time.monotonic()
        try:
            cached = response.batch if response.HasField("batch") else None
            kept = self.running.apply_step(response.generations, cached)
            if kept is not None:
                await self._filter(kept)
        except Exception as err:
            await self._fail_running(err)
            return False
        metrics.filter.observe(time.perf_counter() - end)
        self._publish_batch_gauges()
        return True

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

    def _refuse(self, chunks: list[Entry], err: Exception) -> None:
        """The shards validate a Prefill before touching the cached batch, so an
        INVALID_ARGUMENT leaves it intact (its grants unapplied: they go out again with the
        next step): only the chunks' requests fail, the running ones keep decoding. (Should a
        shard have dropped the cached batch after all, the next step answers NOT_FOUND and the
        batch fails as any lost batch does.)"""
        logger.warning("prefill of %d request(s) refused by the shards: %s", len(chunks), err)
        self.running.fail_entries(chunks, GenerationError(str(err)))
        self._publish_batch_gauges()

    async def _fail_running(self, err: Exception) -> None:
        """Fails every live request, frees their blocks, clears the shards."""
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
        metrics.kv_free(self.cache.free_count)
        metrics.queue_size.set(len(self.queue))
