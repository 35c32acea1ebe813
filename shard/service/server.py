"""The shard's gRPC server: the RPCs of generate.proto, plus grpc.health.v1 and reflection.

grpc.health.v1 follows the engine (shard/service/serving_state.py): NOT_SERVING until Warmup and after an
unrecoverable error. Reflection is on for unix sockets, off over TCP unless --grpc-reflection;
with --shard-token every call but health checks needs the token (shard/service/token_auth.py). On a unix
socket the path is claimed first (refused while another live server answers on it) and only the
socket this process bound is removed at exit (shard/service/socket_guard.py).

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
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pytgi_proto import generate_pb2, generate_pb2_grpc
from pytgi_shard.device.failure import exit_on_device_failure
from pytgi_shard.engine.cut_short import CutShort
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.multi_step import decode_steps
from pytgi_shard.errors import BatchNotFound, InvalidRequest, OutOfMemory
from pytgi_shard.service.serving_state import ServingState
from pytgi_shard.service.socket_guard import claim_socket, release_socket, socket_inode
from pytgi_shard.service.token_auth import TokenInterceptor
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
    def __init__(
        self, engine: Engine, urls: list[str], executor: ThreadPoolExecutor, state: ServingState
    ) -> None:
        self.engine = engine
        self.urls = urls
        self.executor = executor
        self.state = state
        # CutShort's flag: set here on the event loop while the engine thread runs the
        # multi-step call it names (shard/engine/cut_short.py).
        self.cut = CutShort()

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
            await self.state.call_failed(e)  # NOT_SERVING for probes until the exit below
            exit_on_device_failure(e)  # a poisoned CUDA context: exit, the launcher restarts
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            await _abort(context, grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    async def Info(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return self.engine.info()

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            await self._run(context, self.engine.health)
        except BaseException as e:
            await self.state.health_checked(e)
            raise
        await self.state.health_checked(None)
        return generate_pb2.HealthResponse()

    async def ServiceDiscovery(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return generate_pb2.ServiceDiscoveryResponse(urls=self.urls)

    async def ClearCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        batch_id = request.id if request.HasField("id") else None
        if batch_id is None:
            self.cut.reset()
        await self._run(context, self.engine.clear, batch_id)
        return generate_pb2.ClearCacheResponse()

    async def FilterBatch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ids = list(request.request_ids)
        batch = await self._run(context, self.engine.filter, request.batch_id, ids)
        return generate_pb2.FilterBatchResponse(batch=batch)

    async def Warmup(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            response = await self._run(context, self.engine.warmup, request)
        except BaseException as e:
            await self.state.warmup_failed(e)
            raise
        await self.state.warmup_done()
        return response

    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._run(context, self.engine.prefill, request)

    async def Decode(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # One step (max_steps 0/1) is Engine.decode itself; more run on the engine thread in
        # one go (shard/engine/multi_step.py), until done or cut short.
        if request.max_steps <= 1:
            return await self._run(context, self.engine.decode, request)
        return await self._run(context, decode_steps, self.engine, request, self.cut)

    async def CutShort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Answered on the event loop, not queued behind the call it stops on the engine
        thread."""
        self.cut.request(request.call_id)
        return generate_pb2.CutShortResponse()

    async def LoadAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Reads and checks the adapter in a worker thread (steps go on meanwhile), then makes
        it selectable on the engine thread, between steps: every rank gets the same call from
        the router and loads it at the same index."""
        try:
            host = await asyncio.to_thread(self.engine.read_adapter, request)
        except InvalidRequest as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return await self._run(context, self.engine.load_adapter, request, host)

    async def UnloadAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._run(context, self.engine.unload_adapter, request)
        return generate_pb2.UnloadAdapterResponse()

    async def PrepareGrammar(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Compiles off the engine thread (shard/structured_output/compiler.py): steps run on meanwhile."""
        try:
            cached = await asyncio.wrap_future(self.engine.prepare_grammar(request))
        except InvalidRequest as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return generate_pb2.PrepareGrammarResponse(cached=cached)


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")


@dataclass
class RunningServer:
    """A started shard server and what stopping it must release."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    state: ServingState
    executor: ThreadPoolExecutor
    # The inode of the socket file this process bound (unix sockets), so only it is removed.
    socket_inode: int | None

    async def stop(self, settings: ShardSettings, grace: float) -> None:
        try:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace)
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)
            if settings.socket_path is not None:
                release_socket(settings.socket_path, self.socket_inode)


async def start_server(
    settings: ShardSettings, engine: Engine, urls: list[str], interceptors: list[Any]
) -> RunningServer:
    """Binds and starts the server; SocketInUse when a live server holds the socket path."""
    if settings.shard_token is not None:
        interceptors = [TokenInterceptor(settings.shard_token), *interceptors]
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    server = grpc.aio.server(interceptors=interceptors, options=_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    state = ServingState(health_servicer, ("", SERVICE_NAME))
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(
        ShardServicer(engine, urls, executor, state), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if settings.reflection_enabled:
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
    if settings.socket_path is not None:
        # Again right before binding: gRPC would unlink a live server's socket without a word.
        claim_socket(settings.socket_path)
    address = settings.listen_address
    if server.add_insecure_port(address) == 0:
        executor.shutdown(wait=False)
        raise RuntimeError(f"cannot bind {address}")
    inode = socket_inode(settings.socket_path) if settings.socket_path is not None else None
    await server.start()
    await state.start(settings.instance_id)
    log.info("serving on %s (NOT_SERVING until Warmup)", address)
    return RunningServer(server, health_servicer, state, executor, inode)


async def serve(
    settings: ShardSettings, engine: Engine, urls: list[str], interceptors: list[Any]
) -> None:
    """Serves until SIGTERM or SIGINT, then stops gracefully and removes its own socket."""
    running = await start_server(settings, engine, urls, interceptors)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("stopping")
    finally:
        await running.stop(settings, GRACE_SECONDS)
