"""Admission and lifecycle of the inference loop: what the HTTP layer calls.

`Infer.start()` learns the shards' capacity (Info, ClearCache, Warmup), sizes the budgets and the
KV blocks (with their prefix cache), and starts the batching task. `submit()` admits a validated request at once or
refuses it (TGI: a request that cannot take a permit immediately gets 429). `reconnect()` starts
over on a fresh connection after the shards were lost (the watchdog calls it), with the same
request limits, so the HTTP side never notices more than a spell of 503s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from itertools import count

from opentelemetry import trace

from pytgi_proto import generate_pb2
from pytgi_router.core.adapter_cap import live_adapters
from pytgi_router.core.batch_wire import request_pb
from pytgi_router.core.capacity import (
    ShardInfo,
    derive_info,
    new_cache,
    pinned_settings,
    warmup_request,
)
from pytgi_router.core.errors import (
    GenerationError,
    IncompleteGenerationError,
    InferError,
    OverloadedError,
    UnhealthyError,
    ValidationError,
)
from pytgi_router.core.infer_settings import InferSettings
from pytgi_router.core.lora_adapters import AdapterTable
from pytgi_router.core.lora_updates import LoraUpdates
from pytgi_router.core.queue import Queue
from pytgi_router.core.request import Entry, ValidRequest
from pytgi_router.core.request_stream import RequestStream
from pytgi_router.core.scheduler import Scheduler
from pytgi_router.core.shard_client import GrammarRefused, ShardCallError, ShardClient
from pytgi_router.core.shard_probe import ShardProbe
from pytgi_router.core.sizing_report import sizing_lines
from pytgi_router.core.step_plan import Budgets
from pytgi_router.metrics import Metrics

logger = logging.getLogger(__name__)

# Opens a fresh client to the same shard addresses (after a restart of the shard group).
Connect = Callable[[], Awaitable[ShardClient]]


class Infer:
    def __init__(
        self,
        client: ShardClient,
        settings: InferSettings,
        metrics: Metrics,
        connect: Connect | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self._connect = connect
        self._info: ShardInfo | None = None
        self._scheduler: Scheduler | None = None
        self._task: asyncio.Task[None] | None = None
        self._ids = count()
        self._in_flight = 0
        # Waiting requests; None: only the permits bound them (a queued request holds one).
        self._max_queue = settings.max_queue_size
        self._stopping = False
        # From the moment the shards are known lost until reconnect() succeeds.
        self._down = False
        self._idle = asyncio.Event()
        self._idle.set()
        # Constrained entries whose grammar the shards are compiling (PrepareGrammar): they
        # join the queue once it is ready, so no step compiles it.
        self._preparing: dict[asyncio.Task[None], Entry] = {}
        # /health's Health RPC: one in flight at a time, its answer reused for health_cache_s.
        self._probe = ShardProbe(self._health_rpc, settings.health_cache_s)
        # The LoRA adapters served, by name (the shards' Info at start; live loads and unloads).
        self.adapters = AdapterTable()
        # /v1/load_lora_adapter and /v1/unload_lora_adapter, and their replay on a restart.
        self.lora_updates = LoraUpdates(self)

    async def start(self) -> ShardInfo:
        """Info, ClearCache, Warmup; sizes budgets and KV blocks; starts the batching task."""
        info = await self._handshake(self.settings)
        self.adapters = AdapterTable(info.lora_adapters, info.max_loras,
                                     info.lora_runtime_updates)
        self._install(info)
        logger.info("inference ready: %s", info)
        return info

    async def reconnect(self) -> ShardInfo:
        """Serves again after the shards were lost (a rank died, the group restarted, a call
        timed out): every request in flight fails, then a fresh client (same addresses) runs
        Info, ClearCache and Warmup, and batching restarts with new budgets and KV blocks: the
        prefix cache starts empty, since the shards' KV memory is new.

        Raises (ShardCallError, InferStartError, a timeout) while the shards are not back; the
        server stays down (503) until a call succeeds.
        """
        if self._stopping:
            raise UnhealthyError("the server is stopping")
        self._down = True
        await self._stop_batching(GenerationError("the shards were lost"))
        if self._connect is not None:
            await self.client.close()  # fails a live load's call on the lost group
        # No live LoRA load or unload until the new group holds the table's adapters.
        async with self.lora_updates.held():
            if self._connect is not None:
                self.client = await self._connect()
            # The validator was built for the limits already served: the group must take them.
            info = await self._handshake(pinned_settings(self.settings, self.info),
                                         explain=False)
            await self.lora_updates.replay(info.lora_adapters)
        self._install(info)
        self._probe.forget()
        self._down = False
        self.metrics.shard_reconnects.inc()
        logger.info("reconnected to the shards: %s", info)
        return info

    async def _handshake(self, settings: InferSettings, explain: bool = True) -> ShardInfo:
        """Info, ClearCache, Warmup and the served limits; `explain` logs where each came from
        (at start-up: after a reconnect they are the pinned ones, whatever their origin)."""
        timeout = settings.shard_step_timeout_s
        shard_info = await self.client.info(timeout)
        await self.client.clear_cache(None, timeout)
        warmup = await self.client.warmup(warmup_request(settings), timeout)
        served = derive_info(settings, shard_info, warmup, self.client.world_size)
        # What was chosen and why, one line per limit (zero-config sizing).
        if explain:
            for line in sizing_lines(settings, shard_info, warmup, served):
                logger.info("%s", line)
        return served

    def _install(self, info: ShardInfo) -> None:
        """New KV blocks (an empty prefix cache), budgets and batching task for the shards'
        (new) capacity."""
        cache = new_cache(info, self.settings.prefix_caching)
        budgets = Budgets.of(self.settings, info)
        self._scheduler = Scheduler(self.client, Queue(), cache, budgets, self.metrics,
                                    self._release, self.settings.shard_step_timeout_s)
        self._info = info
        self.metrics.batch_max_total_tokens.set(info.max_batch_total_tokens)
        self.metrics.kv_capacity(info.block_size, cache.total)
        self.metrics.kv_free(cache.free_count)
        self._task = asyncio.get_running_loop().create_task(
            self._scheduler.run(), name="pytgi-batching"
        )

    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Refuses new requests, waits up to `drain_timeout` s for in-flight ones, then stops
        the batching task; whatever is still in flight ends with IncompleteGenerationError."""
        self._stopping = True
        if drain_timeout > 0 and self._in_flight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain_timeout)
        await self._stop_batching(IncompleteGenerationError())

    async def _stop_batching(self, error: InferError) -> None:
        """Cancels the batching task; every queued and running request ends with `error`."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for task, entry in list(self._preparing.items()):
            task.cancel()
            entry.stream.fail(error)
            self._release(entry)
        self._preparing.clear()
        scheduler = self._scheduler
        if scheduler is not None:
            for entry in scheduler.queue.drain():
                entry.stream.fail(error)
                self._release(entry)
            scheduler.running.fail_all(error)
            self.metrics.queue_size.set(0)
            self.metrics.batch_current_size.set(0)
            self.metrics.batch_current_max_tokens.set(0)
            self.metrics.kv_free(scheduler.cache.free_count)

    def submit(self, request: ValidRequest) -> RequestStream:
        """Admits `request` or raises: OverloadedError (429) when every permit is taken or the
        queue is full, UnhealthyError (503) when stopping, ValidationError (422) for a request
        these shards could never schedule."""
        scheduler = self._scheduler
        if self._stopping or scheduler is None:
            raise UnhealthyError("the server is not running")
        if self._down:
            raise UnhealthyError("the shards are unavailable: reconnecting")
        if self._in_flight >= self.settings.max_concurrent_requests:
            raise OverloadedError()
        if self._max_queue is not None and len(scheduler.queue) >= self._max_queue:
            raise OverloadedError()
        self._check_schedulable(request)
        self._check_vocabulary(request)
        self._check_adapter(request)
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
        self.adapters.enter(entry_id, request.adapter_index)
        if pb.parameters.grammar_type != generate_pb2.GRAMMAR_TYPE_NONE:
            task = asyncio.get_running_loop().create_task(self._prepare_then_queue(entry))
            self._preparing[task] = entry
            task.add_done_callback(lambda done: self._preparing.pop(done, None))
        else:
            self._queue(scheduler, entry)
        return stream

    @contextlib.contextmanager
    def permit(self) -> Iterator[None]:
        """One max_concurrent_requests permit for work that is no generation (a /tokenize of a
        body near the payload limit costs seconds of the router's CPU), 429 when none is left."""
        if self._in_flight >= self.settings.max_concurrent_requests:
            raise OverloadedError()
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def _queue(self, scheduler: Scheduler, entry: Entry) -> None:
        scheduler.queue.append(entry)
        self.metrics.queue_size.set(len(scheduler.queue))
        scheduler.notify()

    async def _prepare_then_queue(self, entry: Entry) -> None:
        """A constrained entry joins the queue once every shard compiled its grammar
        (PrepareGrammar, off the shards' steps: the running batches go on meanwhile). A
        refusal is the request's 422, a failed call its generation error."""
        scheduler = self._scheduler
        params = entry.pb.parameters
        try:
            await self.client.prepare_grammar(
                params.grammar_type, params.grammar, self.settings.shard_step_timeout_s
            )
        except GrammarRefused as err:
            self._end(entry, ValidationError(str(err)))
            return
        except ShardCallError as err:
            self._end(entry, GenerationError(str(err)))
            return
        if entry.stream.closed:  # cancelled meanwhile: its permit is back already
            return
        if scheduler is None or scheduler is not self._scheduler or self._stopping:
            self._end(entry, GenerationError("the shards were lost"))
            return
        self._queue(scheduler, entry)

    def _end(self, entry: Entry, error: InferError) -> None:
        entry.stream.fail(error)
        self._release(entry)

    def _check_schedulable(self, request: ValidRequest) -> None:
        """Defence in depth behind validation: a request no batch could ever hold would block
        the FIFO queue forever."""
        info = self.info
        prompt = len(request.input_ids)
        if prompt == 0:
            raise ValidationError("`inputs` cannot be empty")
        if request.stopping.max_new_tokens < 1:
            raise ValidationError("`max_new_tokens` must be strictly positive")
        if prompt > info.max_batch_prefill_tokens and not info.support_chunking:
            raise ValidationError(f"`inputs` must have less than "
                                  f"{info.max_batch_prefill_tokens} tokens. Given: {prompt}")
        total = prompt + request.stopping.max_new_tokens
        if total > info.max_batch_total_tokens:
            raise ValidationError(f"`inputs` tokens + `max_new_tokens` must be <= "
                                  f"{info.max_batch_total_tokens}. Given: {prompt} `inputs` "
                                  f"tokens and {request.stopping.max_new_tokens} "
                                  f"`max_new_tokens`")

    def _check_vocabulary(self, request: ValidRequest) -> None:
        """A token id the model has no embedding row for (a tokenizer's added token beyond the
        model's vocabulary) is refused here, with its own 422, rather than by the shard."""
        vocab_size = self.info.vocab_size
        if vocab_size and request.input_ids:
            highest = max(request.input_ids)
            if highest >= vocab_size:
                raise ValidationError(
                    f"`inputs` holds token id {highest}, outside the model's vocabulary of "
                    f"{vocab_size} tokens (a tokenizer token the model has no embedding for)"
                )

    def _check_adapter(self, request: ValidRequest) -> None:
        """The adapter validation resolved is still the one loaded: an unload (or an unload and
        a load reusing its index) between validation and here would otherwise run the request
        under no adapter, or another one's weights."""
        if request.adapter_index and not self.adapters.current(request.adapter_index,
                                                               request.adapter_key):
            raise ValidationError(f"`adapter_id` {request.adapter_name!r} is not a loaded "
                                  "adapter (it was unloaded)")

    def _cancel(self, entry: Entry) -> None:
        self._release(entry)
        if self._scheduler is not None:
            self._scheduler.cancel(entry.id)

    def _release(self, entry: Entry) -> None:
        """Gives back the entry's permit, once, whichever of finish/fail/cancel comes first.
        Its adapter's in-flight count drops only once it is out of the running batch: a
        cancelled entry stays there (on the shards too) until the scheduler retires it, which
        calls this again."""
        if not self._in_running_batch(entry):
            self.adapters.leave(entry.id)
        if not entry.holds_permit:
            return
        entry.holds_permit = False
        entry.stream.detach()
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    def _in_running_batch(self, entry: Entry) -> bool:
        running = self._scheduler.running if self._scheduler is not None else None
        return running is not None and (entry.id in running.entries
                                        or entry.id in running.prefilling)

    async def health(self) -> bool:
        """`/health`: False at once while the shards are lost or the server stops. True while a
        batch succeeded recently, or while a step runs within its own deadline
        (`shard_step_timeout_s` fails a wedged one): one slow CPU step is not a failure.
        Otherwise the shared, cached Health RPC answers (ShardProbe). Never marks the
        scheduler unhealthy: only the watchdog's own check leads to a reconnect."""
        scheduler = self._scheduler
        if scheduler is None or self._stopping or self._down or self.client.connection_lost():
            return False
        if scheduler.healthy:
            if scheduler.step_started is not None:
                return True
            if time.monotonic() - scheduler.last_success < self.settings.health_recent_s:
                return True
        return await self._probe.healthy(not_before=scheduler.last_failure)

    async def check_shards(self) -> bool:
        """The watchdog's own Health RPC after a batch failed: True marks the scheduler healthy
        again, False says the shards are lost (the watchdog then reconnects)."""
        scheduler = self._scheduler
        try:
            await self._health_rpc()
        except Exception as err:  # ShardCallError or timeout: either way the shards are not serving
            logger.warning("shard health check failed: %s", err)
            return False
        if scheduler is not None and scheduler is self._scheduler:
            scheduler.healthy = True
        return True

    async def _health_rpc(self) -> None:
        self.metrics.shard_health_checks.inc()
        await self.client.health(self.settings.health_timeout_s)

    def needs_reconnect(self) -> bool | None:
        """The watchdog's cheap check: True when the shards are known lost (a connection
        dropped, a failed batch could not be cleared, or reconnect() has not succeeded yet),
        None when only a Health RPC can tell (a batch failed), False when all is well or a call
        is still within its deadline."""
        scheduler = self._scheduler
        if self._stopping or scheduler is None:
            return False
        if self._down or scheduler.cache_unknown or self.client.connection_lost():
            return True
        if scheduler.healthy or scheduler.step_started is not None:
            return False
        return None

    @property
    def info(self) -> ShardInfo:
        if self._info is None:
            raise RuntimeError("Infer.start() has not run")
        return self._info

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def adapter_activity(self) -> tuple[set[int], set[int]]:
        """(adapters of the waiting requests, adapters of the admitted ones), by wire index:
        what vllm:lora_requests_info reports."""
        scheduler = self._scheduler
        if scheduler is None:
            return set(), set()
        waiting = {e.request.adapter_index for e in scheduler.queue}
        waiting |= {e.request.adapter_index for e in self._preparing.values()}
        running = live_adapters([*scheduler.running.entries.values(),
                                 *scheduler.running.prefilling.values()])
        return waiting - {0}, running

    @property
    def queue_size(self) -> int:
        return len(self._scheduler.queue) if self._scheduler is not None else 0

    @property
    def kv_blocks_free(self) -> int:
        """KV blocks no live request holds (block 0 excluded): free ones and cached prefixes
        nobody uses (evicted on demand). Equals kv_blocks_total when nothing runs."""
        return self._scheduler.cache.free_count if self._scheduler is not None else 0

    @property
    def kv_blocks_total(self) -> int:
        return self._scheduler.cache.total if self._scheduler is not None else 0

    @property
    def running_count(self) -> int:
        """Requests in the running batch (prefilling or decoding)."""
        return len(self._scheduler.running) if self._scheduler is not None else 0

    def flush_prefix_cache(self) -> bool:
        """Forgets every cached prefix (SGLang's /flush_cache, which routers call on all their
        workers), only while nothing is in flight: a live sequence's blocks cannot be dropped,
        and the blocks themselves need no shard call (the router decides what they hold)."""
        scheduler = self._scheduler
        if scheduler is None or self._in_flight or len(scheduler.running) or len(scheduler.queue):
            return False
        scheduler.cache.clear()
        self.metrics.kv_free(scheduler.cache.free_count)
        return True
