"""pytgi without HTTP, gRPC or a second process: the router's real Infer (queue, block allocator,
batching task with its budgets) driving the shard's real Engine through a direct-call client.

This is row (a) of bench/compare/run.py. Compared with row (b), end to end over HTTP, the difference
is exactly what the process split costs: HTTP parsing and SSE writing, validation/tokenization,
protobuf serialization and gRPC transport between router and shard. The diagnostic row
`pytgi-grpc` splits that cost in two: the same in-process router core, but the shard in its own
process behind gRPC (no HTTP).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from pytgi_bench.compare.system_result import SystemResult
from pytgi_proto import generate_pb2
from pytgi_router.server import run_event_loop

if TYPE_CHECKING:
    from pytgi_router.core.shard_client import ShardClient

Prompts = list[list[int]]
T = TypeVar("T")


class InProcessShardClient:
    """The router's ShardClient interface over one in-process Engine (one rank, no transport).

    Engine calls run one at a time on a dedicated thread, as the shard's gRPC server runs them,
    so the router's own code keeps running on the event loop while the model computes.
    """

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self._engine = engine
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.urls = ["in-process"]

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    @property
    def world_size(self) -> int:
        return 1

    def connection_lost(self) -> bool:
        return False

    # `timeout` (the router's deadline of a shard call) has nothing to bound in-process.
    async def info(self, timeout: float | None = None) -> generate_pb2.InfoResponse:
        return await self._call(self._engine.info)

    async def health(self, timeout: float | None = None) -> None:
        await self._call(self._engine.health)

    async def service_discovery(self) -> list[str]:
        return list(self.urls)

    async def clear_cache(self, batch_id: int | None = None, timeout: float | None = None) -> None:
        await self._call(self._engine.clear, batch_id)

    async def warmup(
        self, req: generate_pb2.WarmupRequest, timeout: float | None = None
    ) -> generate_pb2.WarmupResponse:
        return await self._call(self._engine.warmup, req)

    async def prefill(
        self,
        batch: generate_pb2.Batch,
        cached: generate_pb2.CachedBatch | None,
        timeout: float | None = None,
        grants: Sequence[generate_pb2.BlockGrant] = (),
    ) -> generate_pb2.PrefillResponse:
        from pytgi_router.core.shard_client import prefill_request

        return await self._call(self._engine.prefill, prefill_request(batch, cached, grants))

    async def decode(
        self,
        batches: list[generate_pb2.CachedBatch],
        timeout: float | None = None,
        grants: Sequence[generate_pb2.BlockGrant] = (),
    ) -> generate_pb2.DecodeResponse:
        request = generate_pb2.DecodeRequest(batches=batches, grants=grants)
        return await self._call(self._engine.decode, request)

    async def filter_batch(
        self, batch_id: int, request_ids: list[int], timeout: float | None = None
    ) -> generate_pb2.CachedBatch | None:
        return await self._call(self._engine.filter, batch_id, request_ids)

    async def prepare_grammar(
        self, grammar_type: int, grammar: str, timeout: float | None = None
    ) -> bool:
        request = generate_pb2.PrepareGrammarRequest(grammar_type=grammar_type, grammar=grammar)  # type: ignore[arg-type]
        return await asyncio.wrap_future(self._engine.prepare_grammar(request))

    async def close(self) -> None:
        self._thread.shutdown(wait=True)


def load_engine(model_dir: Path, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """The shard's Engine for `model_dir` on one rank, built as `pytgi-shard serve` builds it."""
    from pytgi_shard.service.startup import load_engine as shard_load_engine
    from pytgi_shard.settings import ShardSettings

    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    return shard_load_engine(ShardSettings(model_path=model_dir, dtype=names[dtype]))


async def _generate_all(infer, prompts: Prompts, new_tokens: int) -> int:  # type: ignore[no-untyped-def]
    """Submits every prompt at once (64 concurrent clients) and drains every stream."""
    from pytgi_proto.parameters import neutral_sampling
    from pytgi_router.core.request import StoppingParameters, ValidRequest
    from pytgi_router.core.request_stream import End

    async def one(ids: list[int]) -> int:
        request = ValidRequest(
            inputs="",
            input_ids=ids,
            truncate=len(ids),
            sampling=neutral_sampling(),
            stopping=StoppingParameters(max_new_tokens=new_tokens),
        )
        async for event in infer.submit(request):
            if isinstance(event, End):
                return int(event.generated_tokens)
        raise RuntimeError("stream ended without its End event")

    return sum(await asyncio.gather(*(one(ids) for ids in prompts)))


class _ShardProcess:
    """One `pytgi-shard serve` child on a unix socket, for the gRPC-only row."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="pytgi-bench-shard-"))
        self.socket = self._dir / "s"
        names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        command = [
            str(Path(sys.executable).with_name("pytgi-shard")),
            "serve",
            str(model_dir),
            "--uds-path",
            str(self.socket),
            "--dtype",
            names[dtype],
        ]
        # The same thread budget as this process (compare.py gives every system the same).
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
        self._log = (self._dir / "shard.log").open("wb")
        self._process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    async def wait_ready(self, timeout_s: float = 300.0) -> str:
        deadline = time.perf_counter() + timeout_s
        ready = Path(f"{self.socket}-0")
        while not ready.exists():
            if self._process.poll() is not None or time.perf_counter() > deadline:
                log = (self._dir / "shard.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"pytgi-shard did not start:\n{log}")
            await asyncio.sleep(0.1)
        return f"unix://{ready}"

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


async def _timed_rounds(
    client: ShardClient,
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    device: str,
    result: SystemResult,
    started: float,
) -> SystemResult:
    from pytgi_router.core.infer import Infer, InferSettings
    from pytgi_router.metrics import Metrics

    settings = InferSettings(max_concurrent_requests=max(128, len(prompts)))
    infer = Infer(client, settings, Metrics())
    info = await infer.start()
    result.startup_s = time.perf_counter() - started
    result.extra["max_batch_total_tokens"] = info.max_batch_total_tokens
    result.extra["max_batch_prefill_tokens"] = info.max_batch_prefill_tokens
    try:
        await _generate_all(infer, prompts[: min(4, len(prompts))], min(new_tokens, 8))
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            begin = time.perf_counter()
            tokens = await _generate_all(infer, prompts, new_tokens)
            result.wall_s.append(time.perf_counter() - begin)
            result.output_tokens.append(tokens)
    finally:
        await infer.stop()
    return result


async def _run_inprocess(
    model_dir: Path,
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    dtype: torch.dtype,
    device: str,
    result: SystemResult,
) -> SystemResult:
    started = time.perf_counter()
    direct = InProcessShardClient(load_engine(model_dir, dtype))
    try:
        return await _timed_rounds(
            cast("ShardClient", direct), prompts, new_tokens, repeats, device, result, started
        )
    finally:
        await direct.close()


async def _run_grpc(
    model_dir: Path,
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    dtype: torch.dtype,
    device: str,
    result: SystemResult,
) -> SystemResult:
    from pytgi_router.core.shard_client import ShardClient

    started = time.perf_counter()
    shard = _ShardProcess(model_dir, dtype)
    try:
        client = await ShardClient.connect(await shard.wait_ready())
        try:
            return await _timed_rounds(
                client, prompts, new_tokens, repeats, device, result, started
            )
        finally:
            await client.close()
    finally:
        shard.stop()


def pytgi_inprocess(
    model_dir: Path,
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    dtype: torch.dtype,
    device: str,
) -> SystemResult:
    result = SystemResult(
        "pytgi-inprocess", "pytgi router Infer + shard Engine in one process (no HTTP, no gRPC)"
    )
    return run_event_loop(
        _run_inprocess(model_dir, prompts, new_tokens, repeats, dtype, device, result)
    )


def pytgi_grpc(
    model_dir: Path,
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    dtype: torch.dtype,
    device: str,
) -> SystemResult:
    """The router's Infer in this process, the shard in its own over gRPC: no HTTP, no SSE."""
    result = SystemResult(
        "pytgi-grpc", "pytgi router Infer in-process + pytgi-shard process over gRPC (no HTTP)"
    )
    return run_event_loop(_run_grpc(model_dir, prompts, new_tokens, repeats, dtype, device, result))
