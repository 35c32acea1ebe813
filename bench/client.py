"""One streamed request, timed on the client exactly as vLLM's `bench serve` times it.

TTFT: request sent -> first payload carrying generated text. ITL: every gap between consecutive
such payloads. E2E latency: request sent -> end of the stream. Timestamps are taken when a network
chunk arrives, so events that arrive together (a buffering proxy) show as zero gaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import httpx

from pytgi_bench.api import Api, StreamState
from pytgi_bench.sse import SSEDecoder
from pytgi_bench.transport import Transport, TransportError
from pytgi_bench.workload import WorkloadItem


@dataclass(slots=True)
class RequestResult:
    ok: bool
    # perf_counter() when the request was sent.
    start: float
    # Seconds; 0.0 when no token arrived.
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    input_tokens: int | None = None
    max_new_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _http_error(status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error", body.decode("utf-8", "replace"))
        if isinstance(error, dict):
            error = error.get("message", error)
    except (ValueError, AttributeError):
        error = body.decode("utf-8", "replace")
    return f"HTTP {status}: {str(error).strip()[:300] or '(empty body)'}"


def _deadline(seconds: float) -> contextlib.AbstractAsyncContextManager[None]:
    # asyncio.timeout (3.11+) is one timer per request, not one per read.
    timeout = getattr(asyncio, "timeout", None)
    return timeout(seconds) if timeout is not None else contextlib.nullcontext()


async def send_request(
    transport: Transport,
    api: Api,
    item: WorkloadItem,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float,
) -> RequestResult:
    """POSTs `body` (the JSON of `item`) to `api.path` and times the streamed response."""
    state = StreamState()
    decoder = SSEDecoder()
    itl: list[float] = []
    ttft = 0.0
    start = last = time.perf_counter()
    result = RequestResult(ok=False, start=start, max_new_tokens=item.max_new_tokens)
    try:
        async with _deadline(timeout_s), transport.post(api.path, body, headers) as response:
            if response.status != 200:
                result.error = _http_error(response.status, await response.body())
                result.latency = time.perf_counter() - start
                return result
            async for chunk in response.chunks():
                now = time.perf_counter()
                for data in decoder.feed(chunk):
                    if data and api.on_data(data, state):
                        if ttft == 0.0:
                            ttft = now - start
                        else:
                            itl.append(now - last)
                        last = now
            for data in decoder.close():
                if data:
                    api.on_data(data, state)
    except TransportError as exc:
        result.error = str(exc)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except TimeoutError:
        result.error = f"timed out after {timeout_s:g} s"
    except ValueError as exc:
        result.error = f"malformed stream event: {exc}"
    result.latency = time.perf_counter() - start
    result.ttft = ttft
    result.itl = itl
    result.input_tokens = (
        state.prompt_tokens if state.prompt_tokens is not None else item.input_tokens
    )
    result.output_tokens = state.output_tokens if state.output_tokens is not None else state.chunks
    result.finish_reason = state.finish_reason
    if result.error is None:
        if state.error is not None:
            result.error = state.error
        elif not state.done:
            result.error = "stream ended before its final event"
        elif state.chunks == 0:
            result.error = "stream carried no tokens"
    result.ok = result.error is None
    return result
