"""One request's stream of events, from the batching task to the HTTP handler, and the events.

A request yields at most one `Prefill`, then one `Token` per generated token, the last of which
is an `End` (a `Token` subclass carrying the finished text). Failures raise an `InferError`.

Hot path: the batching task pushes one event per generated token for every running request, so a
push is a deque append plus, only when the reader is parked, one future resolution. No asyncio.Queue
(its locking and bookkeeping cost several times more per item).

Bounded: a reader that stops reading (a streaming client that does not read its socket: the SSE
writer waits on the transport) would let the events pile up for the whole generation. Past
MAX_PENDING_EVENTS unread events the request is cancelled (its batch slot and KV blocks freed),
the pending events dropped, and the reader, if it ever comes back, gets a clear error.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pytgi_router.core.errors import GenerationError, IncompleteGenerationError, InferError

# About 1024 tokens behind (beyond what the socket buffers already hold): ~0.3 MB per request.
MAX_PENDING_EVENTS = 1024


@dataclass(slots=True)
class TokenInfo:
    id: int
    text: str
    logprob: float
    special: bool


@dataclass(slots=True)
class Prefill:
    """Prompt tokens with their logprobs (the first is NaN), when prefill logprobs were asked."""

    tokens: list[TokenInfo]


@dataclass(slots=True)
class Token:
    token: TokenInfo
    top_tokens: list[TokenInfo] = field(default_factory=list)


@dataclass(slots=True)
class End(Token):
    generated_text: str = ""
    # "length" | "eos_token" | "stop_sequence"
    finish_reason: str = "length"
    generated_tokens: int = 0
    seed: int | None = None
    # Monotonic timestamps (time.monotonic()) for the response headers and metrics.
    queued_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0


Event = Prefill | Token | End


class RequestStream:
    """AsyncIterator of `Prefill?`, `Token`..., `End`; raises an `InferError` on failure."""

    __slots__ = ("queued_at", "_events", "_waiter", "_closed", "_error", "_on_cancel",
                 "_cancelled", "_max_pending")

    def __init__(
        self,
        on_cancel: Callable[[RequestStream], None] | None = None,
        max_pending: int = MAX_PENDING_EVENTS,
    ) -> None:
        self.queued_at = time.monotonic()
        self._events: deque[Event] = deque()
        self._max_pending = max_pending
        self._waiter: asyncio.Future[None] | None = None
        # Closed: no more events will come (End pushed, failed, or cancelled).
        self._closed = False
        self._error: InferError | None = None
        self._on_cancel = on_cancel
        self._cancelled = False

    # Reader side -------------------------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        while True:
            if self._events:
                return self._events.popleft()
            if self._error is not None:
                raise self._error
            if self._closed:
                raise StopAsyncIteration
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
            # Woken by the batching task's push: it is about to send the next shard call, whose
            # gRPC task was queued after this wake-up. Yielding once more lets that call go out
            # first, so the shards compute the next step while the readers write their events
            # (without it, a single stream's shard waited ~2 ms a call for the SSE writes).
            await asyncio.sleep(0)

    def cancel(self) -> None:
        """The client went away: the request leaves the queue or its batch (idempotent), and
        its unread events are dropped (a multi-step Decode delivers several at once: none of
        them is read after a cancel)."""
        if self._cancelled:
            return
        self._cancelled = True
        self._events.clear()
        if not self._closed:
            self._closed = True
            self._wake()
        if self._on_cancel is not None:
            callback, self._on_cancel = self._on_cancel, None
            callback(self)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def closed(self) -> bool:
        return self._closed

    # Writer side (the batching task) -----------------------------------------------------------

    def push(self, event: Event) -> None:
        if self._closed:
            return
        if len(self._events) >= self._max_pending:
            self._fell_behind()
            return
        self._events.append(event)
        if type(event) is End:
            self._closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: InferError) -> None:
        """Ends the stream with `error`, after any events already pushed have been read."""
        if self._closed:
            return
        self._closed = True
        self._error = error
        self._wake()

    def close_incomplete(self) -> None:
        """Ends a stream that will never get its `End` (the batch lost the request)."""
        self.fail(IncompleteGenerationError())

    def _fell_behind(self) -> None:
        """The reader is `max_pending` events behind: drop them, fail, cancel the request."""
        self._events.clear()
        self.fail(GenerationError(
            f"the client fell {self._max_pending} events behind the generation: request cancelled"
        ))
        self.cancel()

    def detach(self) -> None:
        """The request finished: a late cancel() must not reach the batching task any more."""
        self._on_cancel = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
