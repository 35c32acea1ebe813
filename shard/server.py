"""The shard's gRPC server: the eight RPCs of generate.proto, plus grpc.health.v1 and reflection.

Each RPC is a thin call into the Engine. Engine work runs on one dedicated thread, in arrival
order, so the event loop stays free (health checks answer during a long prefill) and calls never
overlap on the model or the caches. Errors become gRPC statuses: the caller's mistakes
INVALID_ARGUMENT / NOT_FOUND, exhausted memory RESOURCE_EXHAUSTED, anything else INTERNAL (the
engine has already dropped the batches involved); the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pytgi_proto import generate_pb2, generate_pb2_grpc
from pytgi_shard.device_failure import exit_on_device_failure
from pytgi_shard.engine import Engine
from pytgi_shard.errors import BatchNotFound, InvalidRequest, OutOfMemory
from pytgi_shard.settings import ShardSettings

log = logging.getLogger(__name__)

T = TypeVar("T")
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["TextGenerationService"].full_name
# Prefill responses with prompt logprobs and top tokens can be large: no size cap.
_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    BatchNotFound: grpc.StatusCode.NOT_FOUND,
    OutOfMemory: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
GRACE_SECONDS = 5.0


class ShardServicer(generate_pb2_grpc.TextGenerationServiceServicer):
    def __init__(self, engine: Engine, urls: list[str], executor: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.urls = urls
        self.executor = executor

    async def _run(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn` on the engine thread, carrying the trace context there."""
        loop = asyncio.get_running_loop()
        call = contextvars.copy_context().run
        try:
            return await loop.run_in_executor(self.executor, call, fn, *args)
        except (InvalidRequest, BatchNotFound, OutOfMemory) as e:
            await _abort(context, _STATUS[type(e)], str(e))
        except Exception as e:
            log.exception("%s failed", getattr(fn, "__name__", "call"))
            exit_on_device_failure(e)  # a poisoned CUDA context: exit, the launcher restarts
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            await _abort(context, grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    async def Info(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return self.engine.info()

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._run(context, self.engine.health)
        return generate_pb2.HealthResponse()

    async def ServiceDiscovery(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return generate_pb2.ServiceDiscoveryResponse(urls=self.urls)

    async def ClearCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        batch_id = request.id if request.HasField("id") else None
        await self._run(context, self.engine.clear, batch_id)
        return generate_pb2.ClearCacheResponse()

    async def FilterBatch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ids = list(request.request_ids)
        batch = await self._run(context, self.engine.filter, request.batch_id, ids)
        return generate_pb2.FilterBatchResponse(batch=batch)

    async def Warmup(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._run(context, self.engine.warmup, request)

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._run(context, self.engine.prefill, request)

    async def Decode(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._run(context, self.engine.decode, request)


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")


async def serve(
    settings: ShardSettings, engine: Engine, urls: list[str], interceptors: list[Any]
) -> None:
    """Serves until SIGTERM or SIGINT, then stops gracefully and removes the socket."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    server = grpc.aio.server(interceptors=interceptors, options=_OPTIONS)
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(
        ShardServicer(engine, urls, executor), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = settings.listen_address
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"cannot bind {address}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving on %s", address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("stopping")
        await health_servicer.enter_graceful_shutdown()
        await server.stop(GRACE_SECONDS)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        remove_socket(settings)


def remove_socket(settings: ShardSettings) -> None:
    """A socket file left by a dead process would look like readiness: it must go."""
    if settings.uds_path is not None:
        Path(f"{settings.uds_path}-{settings.rank}").unlink(missing_ok=True)
