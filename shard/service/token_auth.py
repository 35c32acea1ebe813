"""The optional shared token of shard gRPC over TCP (--shard-token / SHARD_TOKEN).

Anyone who reaches a shard's port could otherwise clear its cache, re-run Warmup or prefill with
other requests' KV blocks. With a token set, every call must carry `authorization: Bearer
<token>` metadata (the router's client adds it); anything else ends UNAUTHENTICATED before it
reaches the engine. The comparison is hmac.compare_digest, whose time does not depend on how
much of a guess matches. grpc.health.v1 stays open: Kubernetes' gRPC probes cannot send metadata
and the answer (SERVING or not) reveals nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

METADATA_KEY = "authorization"
OPEN_PREFIX = "/grpc.health.v1.Health/"


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata a client sends with every call; None without a token."""
    return None if token is None else ((METADATA_KEY, f"Bearer {token}"),)


def token_matches(metadata: Any, expected: bytes) -> bool:
    """Whether the call's `authorization` metadata is `Bearer <expected>` (constant time)."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            given = value.encode() if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(given, expected)
    return False


async def _deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong shard token")


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong shard token")
    yield None  # unreachable: abort raises; makes this an async generator


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only refuses."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny_stream, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny_unary, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny_stream, **codec)
    return grpc.unary_unary_rpc_method_handler(_deny_unary, **codec)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks that does not carry the shard token."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIX):
            return handler
        if token_matches(details.invocation_metadata, self._expected):
            return handler
        return _denied(handler)
