"""The router's gRPC client to every shard rank.

Every call goes to every rank at once (tensor-parallel ranks must all run each forward) and rank
0's answer is returned. A failure on any rank fails the call: the other ranks' calls are cancelled
rather than awaited, since a rank whose peer died may block in a collective until its timeout.
With tracing on, the OpenTelemetry aio interceptors put the current span context in each call's
metadata, so the shards' spans join the router's trace; off, the channels carry no interceptor
(it costs a few percent of the router's CPU on every decode step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from pytgi_proto import generate_pb2, generate_pb2_grpc

T = TypeVar("T")

# Prefill responses with prompt logprobs and top tokens can be large: no message size cap.
# A channel that leaves READY means the shard process went away (the watchdog reconnects), so
# it must not go idle on its own after a quiet half hour, gRPC's default.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.client_idle_timeout_ms", 2**31 - 1),
    # While a restarted shard loads, connect attempts retry quickly rather than backing off
    # towards gRPC's two-minute default.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """What the shards' token interceptor (pytgi_shard.service.token_auth) checks on every call."""
    return None if token is None else (("authorization", f"Bearer {token}"),)


class ShardCallError(Exception):
    """A shard call failed (any rank): the message is what the client sees after
    "Request failed during generation: "."""


class GrammarRefused(ShardCallError):
    """A shard refused a grammar in PrepareGrammar (INVALID_ARGUMENT): the request's 422."""


class AdapterRefused(ShardCallError):
    """A shard refused a LoRA adapter in LoadAdapter (INVALID_ARGUMENT): the message names the
    reason, as the shards' start-up refusal would."""


def _raise_refusal(err: ShardCallError, refusal: type[ShardCallError], default: str) -> None:
    """Raises `refusal` with the shard's message when `err` is its INVALID_ARGUMENT: the
    request's own fault (a grammar, an adapter), not a failed shard; else returns."""
    cause = err.__cause__
    if isinstance(cause, grpc.aio.AioRpcError) and (
        cause.code() == grpc.StatusCode.INVALID_ARGUMENT
    ):
        raise refusal(cause.details() or default) from cause


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return err.details() or err.code().name.lower()
    if isinstance(err, asyncio.TimeoutError):
        return "timed out"
    return f"{type(err).__name__}: {err}"


def _open_channel(address: str, traced: bool) -> grpc.aio.Channel:
    interceptors = aio_client_interceptors() if traced else None
    return grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS, interceptors=interceptors)


def prefill_request(
    batch: generate_pb2.Batch,
    cached: generate_pb2.CachedBatch | None,
    grants: Sequence[generate_pb2.BlockGrant] = (),
) -> generate_pb2.PrefillRequest:
    """Prefill of `batch`, mixed with the cached batch's next decode step when there is one
    (`grants`: new blocks of the cached batch's requests)."""
    request = generate_pb2.PrefillRequest(batch=batch, grants=grants)
    if cached is not None:
        request.cached_batch.CopyFrom(cached)
    return request


class ShardClient:
    def __init__(
        self, channels: list[grpc.aio.Channel], urls: list[str], token: str | None = None
    ) -> None:
        self.urls = urls
        self._channels = channels
        self._stubs = [generate_pb2_grpc.TextGenerationServiceStub(c) for c in channels]
        self._metadata = token_metadata(token)

    @classmethod
    async def connect(
        cls, master: str, timeout: float = 10.0, traced: bool = False, token: str | None = None
    ) -> ShardClient:
        """Connects to rank 0 at `master` ("unix:///path" or "host:port"), discovers the other
        ranks, and connects to them; ShardCallError if any is unreachable within `timeout` s.
        `traced`: propagate the current span to the shards; `token`: the shards' --shard-token,
        sent as metadata with every call."""
        channels = [_open_channel(master, traced)]
        try:
            await asyncio.wait_for(channels[0].channel_ready(), timeout)
            stub = generate_pb2_grpc.TextGenerationServiceStub(channels[0])
            response = await stub.ServiceDiscovery(
                generate_pb2.ServiceDiscoveryRequest(), timeout=timeout,
                metadata=token_metadata(token),
            )
            urls = list(response.urls) or [master]
            # Index = rank; rank 0 is the master we already hold a channel to.
            channels.extend(_open_channel(url, traced) for url in urls[1:])
            ready = [asyncio.wait_for(c.channel_ready(), timeout) for c in channels[1:]]
            await asyncio.gather(*ready)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as err:
            await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
            raise ShardCallError(f"cannot connect to the shards at {master}: {_describe(err)}") from err
        return cls(channels, urls, token)

    @property
    def world_size(self) -> int:
        return len(self._stubs)

    def connection_lost(self) -> bool:
        """Whether a rank's connection dropped since `connect` (its process died or restarted):
        cheap, no RPC. A restarted shard answers again on the same address, but un-warmed."""
        ready = grpc.ChannelConnectivity.READY
        return any(c.get_state(try_to_connect=False) != ready for c in self._channels)

    async def _all(self, rpc: str, request: Any, timeout: float | None = None) -> Any:
        """Calls `rpc` on every rank; rank 0's answer, or ShardCallError as soon as one fails."""
        calls: list[Awaitable[Any]] = [
            getattr(stub, rpc)(request, timeout=timeout, metadata=self._metadata)
            for stub in self._stubs
        ]
        if len(calls) == 1:
            # The single-shard hot path: no tasks, no extra scheduling.
            try:
                return await calls[0]
            except Exception as err:  # AioRpcError, or UsageError on a closed channel
                raise ShardCallError(f"Server error: {_describe(err)}") from err
        tasks = [asyncio.ensure_future(call) for call in calls]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        for rank, task in enumerate(tasks):
            if task in done and task.exception() is not None:
                for other in pending:
                    other.cancel()
                failure = task.exception()
                assert failure is not None
                raise ShardCallError(f"Server error (rank {rank}): {_describe(failure)}") from failure
        return tasks[0].result()

    async def info(self, timeout: float | None = None) -> generate_pb2.InfoResponse:
        response: generate_pb2.InfoResponse = await self._all(
            "Info", generate_pb2.InfoRequest(), timeout
        )
        return response

    async def health(self, timeout: float | None = None) -> None:
        await self._all("Health", generate_pb2.HealthRequest(), timeout)

    async def service_discovery(self) -> list[str]:
        response = await self._all("ServiceDiscovery", generate_pb2.ServiceDiscoveryRequest())
        return list(response.urls)

    async def clear_cache(self, batch_id: int | None = None, timeout: float | None = None) -> None:
        request = generate_pb2.ClearCacheRequest()
        if batch_id is not None:
            request.id = batch_id
        await self._all("ClearCache", request, timeout)

    async def warmup(
        self, req: generate_pb2.WarmupRequest, timeout: float | None = None
    ) -> generate_pb2.WarmupResponse:
        response: generate_pb2.WarmupResponse = await self._all("Warmup", req, timeout)
        return response

    async def prefill(
        self,
        batch: generate_pb2.Batch,
        cached: generate_pb2.CachedBatch | None,
        timeout: float | None = None,
        grants: Sequence[generate_pb2.BlockGrant] = (),
    ) -> generate_pb2.PrefillResponse:
        request = prefill_request(batch, cached, grants)
        response: generate_pb2.PrefillResponse = await self._all("Prefill", request, timeout)
        return response

    async def decode(
        self,
        batches: list[generate_pb2.CachedBatch],
        timeout: float | None = None,
        grants: Sequence[generate_pb2.BlockGrant] = (),
        max_steps: int = 1,
        call_id: int = 0,
    ) -> generate_pb2.DecodeResponse:
        """One decode step, or up to `max_steps` back to back (multi-step decode: the answer's
        step_sizes group its Generations by step); `call_id` (non-zero) lets `cut_short` stop
        such a call early."""
        request = generate_pb2.DecodeRequest(batches=batches, grants=grants)
        if max_steps > 1:
            request.max_steps = max_steps
            request.call_id = call_id
        response: generate_pb2.DecodeResponse = await self._all("Decode", request, timeout)
        return response

    async def cut_short(self, call_id: int, timeout: float | None = None) -> None:
        """Asks every rank to stop the multi-step Decode call `call_id` after its current step
        (the ranks agree on which); harmless when the call has ended."""
        await self._all("CutShort", generate_pb2.CutShortRequest(call_id=call_id), timeout)

    async def filter_batch(
        self, batch_id: int, request_ids: list[int], timeout: float | None = None
    ) -> generate_pb2.CachedBatch | None:
        response = await self._all(
            "FilterBatch",
            generate_pb2.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids),
            timeout,
        )
        return response.batch if response.HasField("batch") else None

    async def prepare_grammar(
        self, grammar_type: int, grammar: str, timeout: float | None = None
    ) -> bool:
        """Every rank compiles the grammar into its cache (answered once compiled); True when
        rank 0 had it already. GrammarRefused when a rank refuses it."""
        request = generate_pb2.PrepareGrammarRequest(grammar_type=grammar_type, grammar=grammar)  # type: ignore[arg-type]
        try:
            response = await self._all("PrepareGrammar", request, timeout)
        except ShardCallError as err:
            _raise_refusal(err, GrammarRefused, "invalid grammar")
            raise
        return bool(response.cached)

    async def load_adapter(self, name: str, source: str, index: int,
                           timeout: float | None = None) -> int:
        """Every rank reads the PEFT adapter at `source` into wire index `index`; its rank.
        AdapterRefused when a rank refuses it (the others may have loaded it: unload_adapter
        the index on all to roll back)."""
        request = generate_pb2.LoadAdapterRequest(name=name, source=source, index=index)
        try:
            response = await self._all("LoadAdapter", request, timeout)
        except ShardCallError as err:
            _raise_refusal(err, AdapterRefused, "adapter refused")
            raise
        return int(response.rank)

    async def unload_adapter(self, index: int, timeout: float | None = None) -> None:
        """Every rank frees wire index `index` (its rows in flight, if any, finish first)."""
        await self._all("UnloadAdapter", generate_pb2.UnloadAdapterRequest(index=index), timeout)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)
